"""Samples-per-insert rate limits: the learner's side (options, refusals, waits, progress).

The rule (Reverb's ``SampleToInsertRatio``): rows handed out stay within
``r * (inserted - min_size) +- e``. The learner gates its *draws* (a batch is
drawn in the consuming process, before any worker reads it): batch ``t`` is
drawn only once ``(t + 1) * B <= r * (inserted - min_size) + e`` (``B`` the
global batch) and ``min_size`` rows are live, so neither a batch handed out nor
one drawn ahead for the loader's workers is ever past the ceiling. Writers wait
for the floor (``grain_replay.writers.rate_wait``), reading the progress this
module publishes into the store (:mod:`grain_replay.store.progress`) from the
moment the loader is built (:meth:`RateLimiter.hold`: the loader's limiter
publishes ``sampled = 0`` and hands its file to the first iterator). The limit is
the sampler's, or the one its store declares (:mod:`grain_replay.store.rate_limit`):
one that contradicts the store's is refused. What is read from the store (its
counts, its learners' folder, the limit it declares) is
:mod:`grain_replay.sampling.rate.store_reads`'s. See docs/rate_limits.md.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from grain_replay.errors import (
    InvalidSamplingError,
    RateLimitTimeoutError,
    ReplayCheckpointError,
)
from grain_replay.sampling.rate.options import default_tolerance, least_tolerance
from grain_replay.sampling.rate.publish import ProgressPublisher
from grain_replay.sampling.rate.store_reads import StoreCounts, learners_folder, sampling_limit
from grain_replay.sources.capabilities import OnObjectStorage
from grain_replay.store import progress as learners_lib
from grain_replay.store.object_folder import POLL_MAX_S as OBJECT_POLL_MAX_S
from grain_replay.store.object_folder import POLL_MIN_S as OBJECT_POLL_MIN_S
from grain_replay.store.rate_limit import RateLimit

__all__ = ["LOG_EVERY_S", "RateLimiter", "make_limiter"]

logger = logging.getLogger(__name__)

# A waiting learner says why every this many seconds (timeout=None).
LOG_EVERY_S = 30.0
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.01


class RateLimiter:
    """The learner's side of a rate limit, in the process that hands batches out.

    Counts are global rows: this process's batches times ``batch_size * shard_count``
    (the processes of one learner step in lockstep). Batch ``t`` may be drawn once
    ``(t + 1) * B <= r * (inserted - min_size) + e`` and ``min_size`` rows are live.

    Args:
      source: the replayed store.
      limit: the limit it samples by (the sampler's, or its store's).
      owner: the sampler's name (``UniformReplay``), as messages name it.
      batch_size: rows per batch of this process.
      shard_index, shard_count: this process among the learner's processes.
      refresh: asks the sampler to look for new rows before its next draw.
    """

    def __init__(
        self,
        source: Any,
        limit: RateLimit,
        owner: str,
        *,
        batch_size: int,
        shard_index: int,
        shard_count: int,
        refresh: Callable[[], None],
    ) -> None:
        self.owner = owner
        self.limit = limit
        self.min_size = int(limit.min_size)
        self.r: float | None = limit.samples_per_insert
        self.timeout: float | None = limit.timeout
        self.batch = int(batch_size) * int(shard_count)
        self._process = (int(shard_index), int(shard_count))
        self._refresh = refresh
        self._source_name = str(getattr(source, "path", None) or repr(source))
        self._counts = StoreCounts(source)
        # Each poll of a store on object storage is a LIST a writer: spaced wider.
        self._polls = (
            (OBJECT_POLL_MIN_S, OBJECT_POLL_MAX_S)
            if isinstance(source, OnObjectStorage)
            else (_POLL_MIN_S, _POLL_MAX_S)
        )
        self.tolerance: float | None = None
        if self.r is not None:
            given = limit.tolerance
            self.tolerance = (
                default_tolerance(self.batch, self.r, self.min_size) if given is None else given
            )
        self._check(source)
        self.inserted = 0  # as last counted
        self.live = 0
        self._handed = 0  # batches handed out / drawn by this process
        self._drawn = 0
        self._ready = False  # min_size reached and one batch drawn: no more refresh requests
        # Publishing (from hold() or the first batch on, only with a ratio).
        self._publisher: ProgressPublisher | None = None
        directory = learners_folder(source)
        if self.r is not None and directory is not None:
            self._publisher = ProgressPublisher(
                directory, f"process-{shard_index}-of-{shard_count}.json", self.owner
            )
        self._waiting = False

    # -- refusals -------------------------------------------------------------------

    def _check(self, source: Any) -> None:
        """Refuses settings that cannot make progress, before any batch, naming the numbers."""
        if self.r is not None:
            assert self.tolerance is not None
            least = least_tolerance(self.batch, self.r)
            if self.tolerance < least:
                raise InvalidSamplingError(
                    f"{self.owner}(samples_per_insert={self.r:g}, tolerance={self.tolerance:g}) "
                    f"over {self._source_name}: a tolerance of {self.tolerance:g} rows cannot "
                    f"make progress with batches of {self.batch} rows (batch_size "
                    f"{self.batch // self._process[1]} x {self._process[1]} processes): the "
                    f"band of +-tolerance rows must hold one batch and one insert's "
                    f"{self.r:g} samples, so tolerance >= max(batch, (batch + "
                    f"samples_per_insert) / 2) = {least:g}. Fix: tolerance >= {least:g} (or "
                    "None: the default), or a smaller batch_size."
                )
        if not self.min_size:
            return
        caps = self._counts.capacities()
        if caps and all(c is not None for c in caps):
            total = sum(c for c in caps if c is not None)
            if total < self.min_size:
                raise InvalidSamplingError(
                    f"{self.owner}(min_size={self.min_size}) over {self._source_name}: its "
                    f"{len(caps)} writers keep at most {total} rows (capacities {caps}), so "
                    f"{self.min_size} rows are never live. Fix: min_size <= {total}, or "
                    "larger capacity= for the writers (build the loader after every writer "
                    "has started, if more will join)."
                )
        if not self._counts.parts and not self._counts.grows:
            n = len(source)
            if n < self.min_size:
                raise InvalidSamplingError(
                    f"{self.owner}(min_size={self.min_size}) over {self._source_name}: the "
                    f"source holds {n} rows and cannot grow (it has no refresh()). Fix: "
                    f"min_size <= {n}, or replay a store a ReplayWriter appends to."
                )

    # -- the learner's wait ---------------------------------------------------------------

    def _allows(self, step: int) -> bool:
        if self.live < self.min_size:
            return False
        if self.r is None:
            return True
        assert self.tolerance is not None
        return (step + 1) * self.batch <= self.r * (self.inserted - self.min_size) + self.tolerance

    def _count(self) -> None:
        self.inserted, self.live = self._counts.read()

    def wait_for(self, step: int, *, block: bool = True) -> bool:
        """Waits until batch ``step`` may be drawn; with ``block=False`` only says whether.

        Raises:
          RateLimitTimeoutError: the wait passed ``timeout``.
          InvalidSamplingError: another rate-limited learner samples this store (checked
            before this learner's first draw).
        """
        if self._publisher is not None and not self._publisher.started:
            self._publisher.check()
        if self._allows(step):
            self._ready_draw()
            return True
        self._count()
        if self._allows(step):
            self._ready_draw(looked=True)
            return True
        if not block:
            return False
        start = time.monotonic()
        told = start
        poll, most = self._polls
        self._set_waiting(True)
        try:
            while True:
                time.sleep(poll)
                poll = min(2 * poll, most)
                self._count()
                if self._allows(step):
                    self._ready_draw(looked=True)
                    return True
                now = time.monotonic()
                if self.timeout is not None and now - start > self.timeout:
                    raise RateLimitTimeoutError(self._message(step, now - start))
                if now - told >= LOG_EVERY_S:
                    told = now
                    logger.warning("%s", self._message(step, now - start))
        finally:
            self._set_waiting(False)

    def _ready_draw(self, *, looked: bool = False) -> None:
        # New rows counted here are seen by the sampler's next draw, not its next
        # scheduled look (it must draw from min_size rows at least).
        if looked or not self._ready:
            self._refresh()

    def _message(self, step: int, waited: float) -> str:
        head = (
            f"{self.owner} over {self._source_name}: the learner waited {waited:.1f} s to "
            f"draw batch {step}: inserted {self.inserted} rows ({self.live} live), handed out "
            f"{self._handed * self.batch} rows"
        )
        if self.live < self.min_size:
            return (
                f"{head}; min_size={self.min_size} rows must be live first. Fix: start the "
                "writers (and flush), or lower min_size; timeout= bounds this wait."
            )
        assert self.r is not None and self.tolerance is not None
        allowed = self.r * (self.inserted - self.min_size) + self.tolerance
        return (
            f"{head}; samples_per_insert={self.r:g} with min_size={self.min_size} and "
            f"tolerance={self.tolerance:g} allow {allowed:.0f} rows, batch {step} would take "
            f"{(step + 1) * self.batch}. Fix: insert faster (more writers, flush more often), "
            "lower samples_per_insert or raise tolerance; timeout= bounds this wait."
        )

    # -- counting and publishing -----------------------------------------------------------

    def drew(self, drawn: int) -> None:
        """``drawn`` batches are drawn (handed out or read ahead)."""
        self._drawn = drawn
        self._ready = True
        self._changed()

    def handed(self, handed: int) -> None:
        """``handed`` batches are handed out."""
        self._handed = handed
        self._changed()

    def _changed(self) -> None:
        if self._publisher is None:
            return
        if not self._publisher.started:
            self._publisher.start(self)
        self._publisher.changed()

    def _set_waiting(self, waiting: bool) -> None:
        self._waiting = waiting
        if self._publisher is not None and self._publisher.started:
            self.publish()

    def publish(self) -> None:
        """Writes this process's progress into the store now."""
        if self._publisher is None:
            return
        assert self.r is not None and self.tolerance is not None
        self._publisher.write(
            learners_lib.Progress(
                name=self._publisher.name,
                sampled=self._handed * self.batch,
                drawn=self._drawn * self.batch,
                batch=self.batch,
                samples_per_insert=self.r,
                tolerance=self.tolerance,
                min_size=self.min_size,
                heartbeat=time.time(),
                stale_after=learners_lib.STALE_AFTER_S,
                pid=os.getpid(),
                host=socket.gethostname(),
                waiting=self._waiting,
                token=self._publisher.token,
                learner=self._publisher.label,
                given_tolerance=self.limit.tolerance,
            )
        )

    def close(self) -> None:
        """Stops publishing and withdraws this process's file (writers stop waiting on it,
        unless the store declares a limit: then they hold at what this learner handed out).

        The counts are published first: the heartbeat thread coalesces hand-outs, and a
        file closed at an older count would hold the writers short of the rows this
        learner's last batches left room for (with no learner to release them).
        """
        if self._publisher is not None:
            if self._publisher.started:
                self.publish()
            self._publisher.close()

    def hold(self) -> None:
        """Publishes now (nothing handed out yet): the writers hold for this learner from
        here on, before its first batch. The loader's limiter does this when it is built.

        Raises:
          InvalidSamplingError: another rate-limited learner samples this store.
        """
        self._refresh = _no_refresh  # this limiter never draws: it holds the sampler not
        if self._publisher is not None and not self._publisher.started:
            self._publisher.start(self)

    def take_over(self, other: RateLimiter | None) -> None:
        """Takes ``other``'s published file (a loader's, see :meth:`hold`) when it samples
        by the same limit: the writers stay held, with no gap, by this iterator now."""
        if other is None or self._publisher is None or other._publisher is None:
            return
        if not other._publisher.started or (other.batch, other.tolerance) != (
            self.batch,
            self.tolerance,
        ):
            return
        if other._publisher.name != self._publisher.name:
            return
        self._publisher, other._publisher = other._publisher, None
        self._publisher.rebind(self)

    # -- checkpoints -----------------------------------------------------------------------

    def state(self, position: int) -> dict[str, Any]:
        """The counters at ``position`` batches handed out (global rows)."""
        return {
            "sampled": position * self.batch,
            "batch": self.batch,
            "inserted": self.inserted,
            "samples_per_insert": self.r,
            "tolerance": self.tolerance,
            "min_size": self.min_size,
        }

    def check_state(self, state: Any, position: int) -> None:
        try:
            sampled, batch = int(state["sampled"]), int(state["batch"])
        except (KeyError, TypeError, ValueError) as e:
            raise ReplayCheckpointError(
                f"The checkpoint's rate-limit counters are malformed ({type(e).__name__}: {e}). "
                "Fix: pass get_state() unchanged."
            ) from e
        if batch != self.batch or sampled != position * batch:
            raise ReplayCheckpointError(
                f"The checkpoint's rate limiter counted {sampled} rows handed out in batches "
                f"of {batch} at batch {position}; this loader hands out {self.batch}-row "
                "batches. Fix: restore with the same batch_size and processes, unchanged."
            )

    def restore(self, handed: int, drawn: int) -> None:
        """Counters after a restore: ``handed`` batches handed out, ``drawn`` drawn."""
        self._handed, self._drawn = handed, max(handed, drawn)
        self._ready = False
        if self._publisher is not None and self._publisher.started:
            self.publish()


def _no_refresh() -> None:
    pass


def make_limiter(stream: Any, *, take_over: RateLimiter | None = None) -> RateLimiter | None:
    """The rate limiter of a uniform or prioritized stream whose options, or whose store,
    ask for one; ``take_over``: the loader's limiter whose published file it takes."""
    sampler = getattr(stream, "sampler", None)
    source = getattr(sampler, "source", None)
    options = getattr(sampler, "options", None)
    if sampler is None or source is None or options is None:
        return None
    limit = sampling_limit(source, options)
    if limit is None:
        return None
    described: Mapping[str, Any] = stream.describe()
    shard_index, shard_count = described.get("shard", (0, 1))
    limiter = RateLimiter(
        source,
        limit,
        type(options).__name__,
        batch_size=int(described["batch_size"]),
        shard_index=int(shard_index),
        shard_count=int(shard_count),
        refresh=sampler.refresh,
    )
    limiter.take_over(take_over)
    return limiter
