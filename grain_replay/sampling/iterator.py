"""The consumer-side iterator of mixture and replay loaders: draws here, reads anywhere."""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import numpy as np

from grain_replay.errors import InvalidSamplingError
from grain_replay.pipeline.state import LoaderIdentity
from grain_replay.pipeline.workers import TASK_NOT_READY, WorkerLoaderIterator
from grain_replay.sampling.iterator_state import (
    decode_state,
    drawn_arrays,
    encode_state,
    parse_drawn,
)
from grain_replay.sampling.priority import PrioritySampler
from grain_replay.sampling.rate.limit import RateLimiter, make_limiter
from grain_replay.sampling.replayed import (
    check_watermarks,
    mixture_watermarks,
    priority_sampler,
    refresh_stream,
    stream_watermark,
)
from grain_replay.sampling.streams import Stream
from grain_replay.sources.capabilities import BindsMaps

__all__ = ["ENDLESS", "SamplingIterator"]

# The name it logged under when this lived in loader.py (users filter on it).
logger = logging.getLogger("grain_replay.sampling.loader")

ENDLESS = sys.maxsize // 4  # the length an endless stream reports to grain
# Draws kept after their batch is handed out: a consumer reading ahead (such as
# sharded_device_put) checkpoints a position up to its read-ahead behind ours.
_KEEP_DRAWN = 64


class _Maps:
    """Reads a task and applies the loader's ``grain.transforms.Map`` operations."""

    def __init__(self, reader: Callable[[Any], Any], maps: Sequence[Any]) -> None:
        self.reader = reader
        self.maps = tuple(maps)

    def __call__(self, task: Any) -> Any:
        data = self.reader(task)
        for op in self.maps:
            data = op.map(data)
        return data


class SamplingIterator:
    """The iterator of a mixture or replay loader: draws here, reads here or in workers.

    Each sampling mode is a *stream*: ``draw(step)`` returns what batch ``step`` is made
    of (per-source record ids, or row indices and importance weights), in step order,
    in the consuming process. The rows are read where the batch is built: in this
    process (``worker_count=0``) or in grain_replay's worker processes, which receive
    the step's ids as a task and only read (shared-memory slots, see
    ``pipeline/workers.py``). Draws run ahead of the batch handed out by at most
    ``worker_count * worker_buffer_size`` steps; a draw is kept until its batch is
    handed out, so a seek or a restarted worker reads the same rows.

    ``get_state()`` returns JSON bytes that hold the whole replay state: the
    position, the sampler's state before the next batch, the commit watermark of
    the store (the rows the sampler draws from; see :mod:`grain_replay.store.watermark`)
    and, with prioritized replay, the priorities as they were before the next batch's
    draw, whatever was drawn ahead (numpy arrays as base64, ~11 bytes a row of this
    process; the draws ahead too when one of them looked at the store). The rows
    themselves are never copied. :meth:`priority_state` still returns the priorities
    alone.
    """

    def __init__(
        self,
        stream: Stream,
        *,
        maps: Sequence[Any] = (),
        worker_count: int = 0,
        worker_buffer_size: int = 2,
        read_threads: int = 0,
        take_over: RateLimiter | None = None,
    ) -> None:
        self._stream = stream
        reader, maps = stream.reader, tuple(maps)
        if isinstance(stream, BindsMaps):  # its reader returns more than the data maps see
            reader, maps = stream.bind_maps(maps), ()
        self._read = _Maps(reader, maps)
        self._lock = threading.RLock()
        self._position = 0  # batches handed out
        self._next_draw = 0
        self._drawn: dict[int, tuple[Any, Any, dict[str, Any]]] = {}
        self._warned = False
        # samples_per_insert / min_size: draws wait here, in the consuming process.
        # take_over: the loader's limiter, whose published file this one goes on with.
        self._limiter = make_limiter(stream, take_over=take_over)
        self._prefetching = False
        self._inner: WorkerLoaderIterator | None = None
        if worker_count > 0:
            # The workers read what they are sent; the identity only names the stream
            # (this iterator keeps its own state).
            identity = LoaderIdentity(
                worker_count=worker_count,
                sampler="_EndlessSampler()",
                data_source=f"{stream.kind}({json.dumps(stream.describe())})",
                shard_index=0,
                shard_count=1,
            )
            # The workers get the reader and the operations, not _Maps: unpickling them
            # must not import this module (grain, through the consumer's iterators).
            self._inner = WorkerLoaderIterator(
                identity,
                reader,
                length=ENDLESS,
                maps=maps,
                buffer_size=worker_buffer_size,
                read_threads=read_threads,
                task=self._task,
            )

    @property
    def position(self) -> int:
        """Batches handed out so far (the next batch's step)."""
        return self._position

    def __iter__(self) -> Self:
        return self

    def _entry(self, step: int, *, block: bool = True) -> tuple[Any, Any, dict[str, Any]] | None:
        if self._limiter is not None:
            with self._lock:
                entry = self._drawn.get(step)
                if entry is not None:
                    return entry
            # Outside the lock: a checkpoint may be taken while the draw waits.
            if not self._limiter.wait_for(step, block=block):
                return None
        with self._lock:
            entry = self._drawn.get(step)
            if entry is not None:
                return entry
            if step != self._next_draw:
                raise InvalidSamplingError(
                    f"The loader is at batch {step}, but the restored priority state was "
                    f"saved when batch {self._next_draw} was to be drawn next. Fix: restore "
                    "get_state() and priority_state() taken at the same checkpoint."
                )
            before = self._stream.state()
            task, extra = self._stream.draw(step)
            entry = self._drawn[step] = (task, extra, before)
            self._next_draw = step + 1
            if self._limiter is not None:
                self._limiter.drew(self._next_draw)
            return entry

    def _task(self, step: int) -> Any:
        # Only the batch handed out next waits for the rate limit; one read ahead for
        # the workers is drawn when it may be, else later (never past the ceiling).
        block = step <= self._position and not self._prefetching
        entry = self._entry(step, block=block)
        return TASK_NOT_READY if entry is None else entry[0]

    def __next__(self) -> Any:
        step = self._position
        if self._inner is not None:
            data = next(self._inner)
            entry = self._entry(step)
            assert entry is not None
            _, extra, _ = entry
        else:
            entry = self._entry(step)
            assert entry is not None
            task, extra, _ = entry
            data = self._read(task)
        with self._lock:
            self._drawn.pop(step - _KEEP_DRAWN, None)
            if self._stream.kind == "prioritized":
                self._priority().forget(step - _KEEP_DRAWN)
            self._position = step + 1
        if self._limiter is not None:
            self._limiter.handed(step + 1)
        return self._stream.finish(data, extra)

    def start_prefetch(self) -> None:
        """Starts the workers (and their first draws); no-op with ``worker_count=0``."""
        if self._inner is not None:
            self._prefetching = True  # no wait for a rate limit here
            try:
                self._inner.start_prefetch()
            finally:
                self._prefetching = False

    # -- checkpoints ----------------------------------------------------------

    def _describe(self) -> dict[str, Any]:
        return {"kind": self._stream.kind, **self._stream.describe()}

    def get_state(self) -> bytes:
        """JSON bytes: resume at the identical next batch (schedule and priorities included)."""
        return self.get_state_at(self._position)

    def get_state_at(self, position: int) -> bytes:
        """:meth:`get_state` as it was when ``position`` batches had been handed out.

        A consumer that reads ahead (``sharded_device_put``) asks for the state of the
        last batch it handed on, only when a checkpoint is taken: the priorities are
        encoded then, not after every batch.

        Raises:
          InvalidSamplingError: ``position`` is ahead of this iterator, or so far behind
            that its draw is no longer kept.
        """
        with self._lock:
            if position > self._position or (
                position < self._position and position not in self._drawn
            ):
                raise InvalidSamplingError(
                    f"No state at batch {position}: this iterator has handed out "
                    f"{self._position} batches and keeps the draws of the last {_KEEP_DRAWN}. "
                    f"Fix: read ahead by fewer than {_KEEP_DRAWN} batches."
                )
            entry = self._drawn.get(position)
            priorities = None
            if self._stream.kind == "prioritized":
                priorities = self._priority_state_locked(position, copy=False)
            return encode_state(
                sampling=self._describe(),
                position=position,
                sampler=entry[2] if entry is not None else self._stream.state(),
                watermark=stream_watermark(self._stream),
                rate_limit=None if self._limiter is None else self._limiter.state(position),
                priorities=priorities,
                watermarks=mixture_watermarks(self._stream),
            )

    def set_state(self, state: bytes) -> None:
        """Resumes right after the batch at which ``state`` was taken, priorities included.

        A state of an older version (without priorities) resumes the position only,
        with the priorities in memory, as before: restore :meth:`set_priority_state`
        too, then.

        Raises:
          ReplayCheckpointError: (a ``CheckpointMismatchError`` and an
            ``InvalidSamplingError``) ``state`` is from another mode, store, batch
            size, seed or priority settings, or the store holds fewer rows than the
            checkpoint's watermark; nothing changes.
        """
        decoded = decode_state(state, self._describe())
        position, priorities = decoded.position, decoded.priorities
        check_watermarks(self._stream, decoded.watermark, decoded.watermarks)
        if self._limiter is not None and decoded.rate_limit is not None:
            self._limiter.check_state(decoded.rate_limit, position)
        if priorities is not None:
            self._priority().check_state(priorities)
        with self._lock:
            if self._stream.kind != "prioritized" and priorities is None:
                self._stream.set_state(decoded.sampler)  # may refuse it: before any change
            if priorities is not None:
                self._set_priority_state_locked(priorities)
            self._position = position
            if priorities is not None:
                self._drawn = {s: e for s, e in self._drawn.items() if s >= position}
            elif self._stream.kind == "prioritized":
                if position not in self._drawn and position != self._next_draw:
                    self._drawn.clear()
                    self._next_draw = position
                    if not self._warned:
                        self._warned = True
                        logger.warning(
                            "Resuming prioritized replay at batch %s with the priorities in "
                            "memory; restore priority_state() too for an identical resume.",
                            position,
                        )
                self._drawn = {s: e for s, e in self._drawn.items() if s >= position}
            else:
                self._drawn.clear()
                self._next_draw = position
            if self._limiter is not None:
                self._limiter.restore(position, self._next_draw)
        if self._inner is not None:
            self._inner.seek(position)

    # -- replay ---------------------------------------------------------------

    def _priority(self) -> PrioritySampler:  # raises unless the stream has priorities
        return priority_sampler(self._stream)

    def update_priorities(
        self, index: Any, priorities: Any, *, handed_out: int | None = None
    ) -> None:
        """Gives rows new priorities (e.g. ``abs(td_error)``); checked now, used from a later draw.

        The update reaches the draws of batches from ``handed_out + L`` on, where
        ``L = worker_count * worker_buffer_size - 1`` (0 without workers): batches
        up to then were drawn ahead. Draws depend only on the seed and the sequence
        of updates, not on timing.

        Args:
          index: the rows (a batch's ``.index``; numpy or array-like, any shape).
          priorities: one nonnegative finite priority per row; for a repeated row the
            last wins.
          handed_out: the loader position the update follows; default: the batches this
            iterator handed out. A wrapper that reads ahead (``sharded_device_put``)
            passes its own count plus its read-ahead.

        Raises:
          InvalidPriorityError: lengths differ, or a priority is negative, NaN or infinite.
          PriorityIndexError: a row this iterator never handed out (another process's
            row, or one not yet drawn).
          InvalidSamplingError: the loader does not sample with priorities.
        """
        sampler = self._priority()
        stamp = self._position if handed_out is None else int(handed_out)
        sampler.update(np.asarray(index), np.asarray(priorities), stamp)

    def priority_state(self) -> dict[str, np.ndarray]:
        """The priorities and the draws ahead, as numpy arrays (~11 bytes a row).

        :meth:`get_state` holds them too (so one Orbax item restores everything);
        this is for saving them apart, as before (``np.savez``, or an Orbax
        ``StandardSave`` item); restore with :meth:`set_priority_state` after
        ``set_state``.
        """
        sampler = self._priority()
        with self._lock:
            # All the draws kept, those behind the position too: a wrapper that reads
            # ahead (sharded_device_put) restores its own get_state() with these.
            state = sampler.state()
            state.update(drawn_arrays(self._drawn, self._next_draw))
            return state

    def _priority_state_locked(self, position: int, *, copy: bool = True) -> dict[str, np.ndarray]:
        """The priorities at ``position`` batches handed out: a function of the seed, the
        updates and ``position``, not of how far the draws ran ahead (they are undone),
        unless a draw ahead looked at the store: then the state is the sampler's now,
        with the draws from ``position`` on, which a restore repeats.

        copy=False: encoded at once, under this iterator's lock (no draw changes the tree).
        """
        sampler = self._priority()
        state = sampler.state_at(position, self._next_draw, copy=copy)
        if state is not None:
            state.update(drawn_arrays({}, position))
            return state
        state = sampler.state(copy=copy)
        ahead = {s: e for s, e in self._drawn.items() if s >= position}
        state.update(drawn_arrays(ahead, self._next_draw))
        return state

    def set_priority_state(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`priority_state` (call after ``set_state``, before ``next``).

        Raises:
          InvalidSamplingError: ``state`` is from another process, settings or store
            (a :class:`~grain_replay.errors.ReplayCheckpointError`).
        """
        self._priority().check_state(state)
        with self._lock:
            self._set_priority_state_locked(state)
        if self._inner is not None:
            self._inner.seek(self._position)

    def _set_priority_state_locked(self, state: Mapping[str, Any]) -> None:
        next_draw, drawn = parse_drawn(state)
        self._priority().set_state(state)
        self._drawn = drawn
        self._next_draw = next_draw
        if self._limiter is not None:
            self._limiter.restore(self._position, next_draw)

    def refresh(self) -> None:
        """Looks for newly committed rows before the next draw (replay modes)."""
        refresh_stream(self._stream)

    def close(self) -> None:
        """Stops the workers (and a rate limit's publishing); the position is kept."""
        if self._inner is not None:
            self._inner.close()
        if self._limiter is not None:
            self._limiter.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
