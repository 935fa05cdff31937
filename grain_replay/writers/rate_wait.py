"""A writer's side of a rate limit: ``flush()`` waits while it would run ahead of a learner.

See :mod:`grain_replay.store.progress` for what the learners publish and
docs/rate_limits.md for the rule. Without a live rate-limited learner the cost
is one failed ``scandir`` of the learners' folder per flush.
"""

from __future__ import annotations

import logging
import math
import time

from grain_replay.errors import InvalidArgumentError, RateLimitTimeoutError
from grain_replay.store.progress import InsertedCount, LearnerWatch, Progress, learners_dir

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


class WriterGate:
    """Holds one writer's commits back while a live learner of its store is behind.

    Args:
      store: the store's path.
      parts: whether it is a many-writer store (inserted rows are every writer's,
        from the manifests) or a plain one (this writer's own).
      timeout: seconds a flush may wait; None waits as long as it takes.
      who: the writer, as error messages name it.
    """

    def __init__(self, store: str, *, parts: bool, timeout: float | None, who: str) -> None:
        self._watch = LearnerWatch(learners_dir(store, parts=parts))
        self._count = InsertedCount(store) if parts else None
        self._timeout = timeout
        self._who = who
        # Seconds every wait took, in all: those that timed out included.
        self.waited_s = 0.0

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
        learners = self._watch.live()
        if not learners or pending <= 0:
            return 0.0
        start = time.monotonic()
        try:
            return self._wait(learners, start, committed, pending)
        finally:
            self.waited_s += time.monotonic() - start

    def _wait(self, learners: list[Progress], start: float, committed: int, pending: int) -> float:
        told = start
        poll = _POLL_MIN_S
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
            poll = min(2 * poll, _POLL_MAX_S)
            learners = self._watch.live()

    def _message(self, p: Progress, inserted: int, pending: int, waited: float) -> str:
        r, e, m = p.samples_per_insert, p.tolerance, p.min_size
        ahead = r * (inserted + pending - m) - p.sampled
        return (
            f"{self._who}: flush() waited {waited:.1f} s for learner {p.describe()}: with "
            f"{inserted} rows inserted and {pending} more pending, samples_per_insert * "
            f"(inserted - min_size) - sampled = {r:g} * ({inserted} + {pending} - {m}) - "
            f"{p.sampled} = {ahead:.0f} rows would exceed tolerance {e:g}. Fix: speed up the "
            "learner (or check it still iterates), raise its tolerance or lower its "
            "samples_per_insert; rate_limit_timeout= bounds this wait."
        )
