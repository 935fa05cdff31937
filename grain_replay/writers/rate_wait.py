"""A writer's side of a rate limit: ``flush()`` waits while it would run ahead of a learner.

See :mod:`grain_replay.store.progress` for what the learners publish,
:mod:`grain_replay.store.rate_limit` for the limit a store declares and
docs/rate_limits.md for the rule. With no learner and no declared limit the cost
is one failed ``scandir`` of the learners' folder per flush (and one ``stat`` of
the declaration, until there is one).
"""

from __future__ import annotations

import logging
import math
import time

from grain_replay.errors import InvalidArgumentError, InvalidSamplingError, RateLimitTimeoutError
from grain_replay.store.object_folder import POLL_MAX_S as OBJECT_POLL_MAX_S
from grain_replay.store.object_folder import POLL_MIN_S as OBJECT_POLL_MIN_S
from grain_replay.store.object_folder import ObjectFolder, ObjectInsertedCount
from grain_replay.store.objects import ObjectStore
from grain_replay.store.progress import (
    InsertedCount,
    LearnerWatch,
    Progress,
    learners_dir,
    stand_in,
)
from grain_replay.store.rate_limit import RateLimit, declare, read_declared

__all__ = ["LOG_EVERY_S", "WriterGate", "check_rate_limit_timeout"]

logger = logging.getLogger(__name__)

# A waiting writer says why every this many seconds (rate_limit_timeout=None).
LOG_EVERY_S = 30.0
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.01


def check_rate_limit_timeout(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(
            f"{where}: rate_limit_timeout must be seconds (a positive number) or None (wait "
            f"as long as it takes), got {value!r}. Fix: rate_limit_timeout=None or seconds, "
            "e.g. 60.0."
        )
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(
            f"{where}: rate_limit_timeout must be positive and finite, or None, got "
            f"{value!r}. Fix: rate_limit_timeout=None (wait as long as it takes) or seconds > 0."
        )
    return float(value)


def check_writer_limit(
    limit: object, timeout: float | None, where: str
) -> tuple[RateLimit | None, float | None]:
    """A writer's ``rate_limit=`` and its flush timeout (``rate_limit_timeout=``, else the
    limit's ``timeout``), checked."""
    if limit is None:
        return None, timeout
    if not isinstance(limit, RateLimit):
        raise InvalidArgumentError(
            f"{where}: rate_limit must be a gr.RateLimit or None, got {limit!r} "
            f"({type(limit).__name__}). Fix: rate_limit=gr.RateLimit(min_size=..., "
            "samples_per_insert=...)."
        )
    if timeout is not None and limit.timeout is not None and timeout != limit.timeout:
        raise InvalidArgumentError(
            f"{where}: rate_limit_timeout={timeout!r} but rate_limit.timeout="
            f"{limit.timeout!r}: both bound the same wait of flush(). Fix: pass one of them."
        )
    return limit, timeout if timeout is not None else limit.timeout


class WriterGate:
    """Holds one writer's commits back while the learner of its store is behind.

    The learner is the live one (its published progress); while none is live and the
    store declares a limit, the last learner's count (closed or gone), else a learner
    that handed out nothing (:func:`grain_replay.store.progress.stand_in`).

    Args:
      store: the store's path.
      parts: whether it is a many-writer store (inserted rows are every writer's,
        from the manifests) or a plain one (this writer's own).
      timeout: seconds a flush may wait; None waits as long as it takes.
      who: the writer, as error messages name it.
    """

    def __init__(
        self,
        store: str,
        *,
        parts: bool,
        timeout: float | None,
        who: str,
        objects: ObjectStore | None = None,
    ) -> None:
        self._dir: str | ObjectFolder
        self._count: InsertedCount | ObjectInsertedCount | None
        self._polls = (_POLL_MIN_S, _POLL_MAX_S)
        if objects is not None:  # a many-writer store on object storage
            self._dir = ObjectFolder(objects)
            self._count = ObjectInsertedCount(objects)
            self._polls = (OBJECT_POLL_MIN_S, OBJECT_POLL_MAX_S)
        else:
            self._dir = learners_dir(store, parts=parts)
            self._count = InsertedCount(store) if parts else None
        self._watch = LearnerWatch(self._dir)
        self._timeout = timeout
        self._who = who
        self._limit: RateLimit | None = None  # the store's, once read (it never changes)
        # Seconds every wait took, in all: those that timed out included.
        self.waited_s = 0.0

    def declare(self, limit: RateLimit) -> None:
        """Declares ``limit`` in the store (the first declaration stays), before this
        writer's first row.

        Raises:
          InvalidSamplingError: the store, or a live learner of it, has another limit.
        """
        for p in self._watch.live():
            if not p.limit().agrees(limit):
                raise InvalidSamplingError(
                    f"{self._who}: rate_limit={limit.terms()} contradicts the limit of the "
                    f"live learner {p.describe()}: {p.limit().terms()}. Expected one limit "
                    f"per store, on every writer and learner. Fix: pass "
                    f"rate_limit={p.limit().terms()}, or close that learner first."
                )
        self._limit = declare(self._dir, limit, self._who)

    def declared(self) -> RateLimit | None:
        """The store's declared limit (re-read until there is one)."""
        if self._limit is None:
            self._limit = read_declared(self._dir)
        return self._limit

    def _learners(self) -> list[Progress]:
        """The learners to hold for: the live ones, else the declared limit's stand-in."""
        live, gone = self._watch.scan()
        if live:
            return live
        limit = self.declared()
        if limit is None:
            return []
        held = stand_in(limit, gone)
        return [] if held is None else [held]

    def _counts(self, committed: int) -> tuple[int, int]:
        if self._count is None:
            return committed, committed
        return self._count.read()

    def wait(self, committed: int, pending: int) -> float:
        """Returns once ``pending`` rows may be committed; the seconds it waited.

        Args:
          committed: this writer's committed rows (a plain store's inserted rows).
          pending: the rows the flush is about to commit.

        Raises:
          RateLimitTimeoutError: the learner stayed behind for longer than the timeout
            (the rows stay pending: a later flush commits them).
        """
        if pending <= 0:
            return 0.0
        learners = self._learners()
        if not learners:
            return 0.0
        start = time.monotonic()
        try:
            return self._wait(learners, start, committed, pending)
        finally:
            self.waited_s += time.monotonic() - start

    def _wait(self, learners: list[Progress], start: float, committed: int, pending: int) -> float:
        told = start
        poll, most = self._polls
        while True:
            inserted, live = self._counts(committed)
            blocking = [p for p in learners if p.blocks_insert(inserted, live, pending)]
            if not blocking:
                return time.monotonic() - start
            now = time.monotonic()
            waited = now - start
            if self._timeout is not None and waited > self._timeout:
                raise RateLimitTimeoutError(self._message(blocking[0], inserted, pending, waited))
            if now - told >= LOG_EVERY_S:
                told = now
                logger.warning("%s", self._message(blocking[0], inserted, pending, waited))
            time.sleep(poll)
            poll = min(2 * poll, most)
            learners = self._learners()

    def _message(self, p: Progress, inserted: int, pending: int, waited: float) -> str:
        r, e, m = p.samples_per_insert, p.tolerance, p.min_size
        ahead = r * (inserted + pending - m) - p.sampled
        learner = "learner" if p.batch else "its store's limit, holding for"
        return (
            f"{self._who}: flush() waited {waited:.1f} s for {learner} {p.describe()}: with "
            f"{inserted} rows inserted and {pending} more pending, samples_per_insert * "
            f"(inserted - min_size) - sampled = {r:g} * ({inserted} + {pending} - {m}) - "
            f"{p.sampled} = {ahead:.0f} rows would exceed tolerance {e:g}. Fix: speed up the "
            "learner (or check it still iterates; with no learner yet, start one), raise its "
            "tolerance or lower its samples_per_insert; rate_limit_timeout= bounds this wait."
        )
