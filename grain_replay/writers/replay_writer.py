"""ReplayWriter: grows a store while training runs, never corrupting what was committed."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from grain_replay.errors import BackgroundWriteError, InvalidArgumentError, WriterBusyError
from grain_replay.store.formats import is_url
from grain_replay.store.rate_limit import RateLimit
from grain_replay.store.watermark import Watermark
from grain_replay.writers.device import background
from grain_replay.writers.file_setup import FileSetup, open_file_store
from grain_replay.writers.finalizing import close_forgotten
from grain_replay.writers.object_parts import ObjectPartWriter
from grain_replay.writers.object_setup import (
    ObjectSetup,
    open_object_part,
    refuse_object_options,
    writer_path,
)
from grain_replay.writers.parts_writer import PartWriter
from grain_replay.writers.queued_writes import QueuedWrites
from grain_replay.writers.store_writer import StoreWriter

__all__ = ["ReplayWriter", "WriterBusyError"]

logger = logging.getLogger(__name__)

# The writers of a part of a many-writer store: on a file system, on object storage.
_PARTS = (PartWriter, ObjectPartWriter)


def _check_flush_every(flush_every: int | None) -> int | None:
    if flush_every is not None and flush_every <= 0:
        raise InvalidArgumentError(
            f"flush_every must be positive or None, got {flush_every}. Fix: flush_every="
            "None (commit only at flush()) or a row count >= 1."
        )
    return flush_every


class ReplayWriter:
    """Appends blocks of rows to a replay store; readers see only committed rows.

    ``append(tree)`` writes rows to the store (small appends gathered in ~1 MiB of
    buffers first, written a block a leaf: memory stays bounded);
    ``flush()`` makes them durable and commits them: the metadata's record
    count, which every source reads, moves only after the rows are on disk.
    ``flush(wait=False)`` commits in the background instead (the caller goes on).
    A crash loses at most the rows appended since the last completed commit. Reopening an
    existing store continues after its committed rows (uncommitted ones are
    dropped). One writer per store at a time (``flock`` on ``<path>.lock``, which stays),
    or one per ``writer_id`` of a many-writer store. The plain store's writer is
    :class:`~grain_replay.writers.store_writer.StoreWriter`, a writer part's
    :class:`~grain_replay.writers.parts_writer.PartWriter`; this class adds device
    appends, ``flush_every`` and the rate limit's wait.

    Args:
      path: the store; created on the first ``append`` if missing.
      format: ``"hdf5"``, ``"npy"`` or ``"zarr"``; default from the path as in
        :func:`grain_replay.write` (or from what is on disk). A many-writer store is a
        directory named ``path`` (``buf.h5``: HDF5 segments in the directory ``buf.h5``);
        a new one whose suffix names another format than ``format`` is refused.
      chunk_rows: rows per chunk of a new HDF5/Zarr store (default ~1 MiB).
      compression: Zarr codec of a new store (``"zstd"``, ``"gzip"``, ``"blosc"``).
      flush_every: commit automatically once this many rows are pending.
      capacity: keep only this writer's newest ``capacity`` committed rows
        (evicting older ones and giving their disk space back); None keeps all.
      writer_id: this writer's part of a many-writer store (a safe file name
        such as ``"actor-3"``); any number of writers with distinct ids append
        to one ``path`` at once. Default ``"default"`` when ``capacity`` is set.
        With ``capacity`` or ``writer_id`` the store is a directory of writer
        parts (see docs/replay_store.md); without both, today's single store.
      segment_rows: rows per segment file of a writer part (default
        ``ceil(capacity / 16)``, or 2**20 rows unbounded).
      resume_from: restart at a replay checkpoint: the :class:`~grain_replay.Watermark`
        of :func:`grain_replay.read_watermark` (or a row count; for a writer part, its
        committed sequence number). Rows this writer committed after it are dropped (at
        once, durably, their disk space given back) before appending again, so a run
        restarted from one checkpoint never mixes in rows written after it; a writer
        part the watermark does not name keeps none. Reopen before the restored
        learner's first batch, while no reader holds the dropped rows. See
        docs/checkpointing.md; on ``s3://`` the rows evicted since the checkpoint must
        still be on the bucket (``evict_grace_s``; docs/replay_store.md#on-object-storage).
      max_inflight_bytes: bytes of device appends (``jax.Array`` leaves) still being
        copied to host or written before ``append`` waits (default 256 MiB).
      rate_limit: a :class:`~grain_replay.RateLimit` to declare in the store before the
        first row (docs/rate_limits.md): from then on every writer of the store holds in
        ``flush()`` while it would run ahead of the learner, counting the rows handed out
        as 0 while no learner exists, so the writers stop near ``min_size + tolerance /
        samples_per_insert`` rows until a learner samples. The first declaration stays;
        another limit is refused (naming both), from a writer or from a live learner.
        Writers given none follow the store's limit all the same.
      rate_limit_timeout: seconds a ``flush()`` may wait for a rate-limited learner
        of this store (``samples_per_insert``, docs/rate_limits.md) before raising
        :class:`~grain_replay.RateLimitTimeoutError` (the rows stay pending); None
        waits as long as it takes, logging why every 30 s. ``close()`` never waits.
        Default: ``rate_limit.timeout``; both given must agree.
      storage_options: fsspec options of an ``s3://`` URL: ``path`` may be one for a
        many-writer store (``writer_id=``), of npy pieces on object storage
        (docs/replay_store.md#on-object-storage); POSIX paths take none.
      lease_s: on object storage, seconds the lease on ``writer_id`` lasts unrenewed (a
        heartbeat thread renews it every ``lease_s / 4``): the id of a writer that died
        is taken over that long after its last renewal (default 30).
      evict_grace_s: on object storage, seconds evicted pieces and superseded manifest
        versions are kept, so that a reader whose snapshot is younger reads all its
        rows (default 300).

    Device arrays: ``append`` of a tree with ``jax.Array`` leaves (sharded or not, on
    any device, mixed with numpy leaves or not) checks the tree at once, queues it and
    returns; a background thread copies the trees to host (on an accelerator, runs of
    like trees stacked on the device: one transfer a leaf for up to 64 appends) and
    writes them in append order. ``flush()`` waits for them (the durability
    barrier). Host leaves of such a tree, and host trees appended while device ones
    are queued, are copied at ``append``. A failure in the background is raised by
    the next ``append``/``flush``/``close`` as :class:`~grain_replay.BackgroundWriteError`
    naming the leaf; the committed rows stay intact and the writer must be reopened.
    Host-only appends to an idle writer are checked and copied in the call (small ones
    gathered and written together, at the latest by the next ``flush()``).
    ``flush(wait=False)`` queues a commit behind the trees appended so far: the thread
    writes them, then commits while the caller steps on (docs/device_writes.md).

    Examples:
      >>> with gr.ReplayWriter("replay.zarr") as w:
      ...     for episode in episodes:
      ...         w.append({"obs": ep_obs, "action": ep_act, "reward": ep_rew})
      ...         w.flush()
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        format: str | None = None,
        *,
        chunk_rows: int | None = None,
        compression: str | None = None,
        flush_every: int | None = None,
        capacity: int | None = None,
        writer_id: str | None = None,
        segment_rows: int | None = None,
        resume_from: int | Watermark | None = None,
        max_inflight_bytes: int = background.DEFAULT_MAX_INFLIGHT_BYTES,
        rate_limit_timeout: float | None = None,
        rate_limit: RateLimit | None = None,
        storage_options: dict[str, Any] | None = None,
        lease_s: float | None = None,
        evict_grace_s: float | None = None,
    ):
        self._store: PartWriter | StoreWriter | ObjectPartWriter | None = None
        parts = capacity is not None or writer_id is not None or segment_rows is not None
        if parts and writer_id is None:
            writer_id = "default"
        self._path = writer_path(path, writer_id)
        refuse_object_options(self._path, storage_options, lease_s, evict_grace_s, writer_id)
        self._flush_every = _check_flush_every(flush_every)
        if is_url(self._path):
            assert writer_id is not None
            opened: ObjectSetup | FileSetup = open_object_part(
                self._path, format, writer_id, capacity, storage_options, lease_s,
                evict_grace_s, segment_rows=segment_rows, resume_from=resume_from,
                rate_limit=rate_limit, rate_limit_timeout=rate_limit_timeout,
                max_inflight_bytes=max_inflight_bytes,
            )  # fmt: skip
        else:
            opened = open_file_store(
                self._path, format, parts=parts, writer_id=writer_id, capacity=capacity,
                segment_rows=segment_rows, chunk_rows=chunk_rows, compression=compression,
                resume_from=resume_from, rate_limit=rate_limit,
                rate_limit_timeout=rate_limit_timeout, max_inflight_bytes=max_inflight_bytes,
            )  # fmt: skip
        self._store, self._gate, self._format = opened.store, opened.gate, opened.store.format
        # The device appends' and flush(wait=False)'s thread, started on the first of them.
        self._queued = QueuedWrites(opened.store, opened.who, opened.max_inflight, self._path)
        # Counted here, not from the store's counters, which the background thread moves.
        self._appended = self._committed = self._flushed = opened.store.committed

    # -- lifecycle -------------------------------------------------------------

    def close(self) -> None:
        """Commits pending rows and releases the store.

        Raises:
          BackgroundWriteError: a device append failed and no call raised it yet (the
            store is released all the same, without the rows since the last flush).
        """
        bg, store = self._thread(), self._store
        if bg is not None and bg.failed:
            self._abandon()
            bg.raise_pending()
            return
        if store is None or store.closed:
            if bg is not None:
                bg.stop()
            return
        try:
            if bg is not None:
                bg.drain()
        except BackgroundWriteError:
            self._abandon()
            raise
        finally:
            if bg is not None:
                bg.stop()
        store.close()  # commits without waiting for rate-limited learners
        self._committed = self._appended  # every row: the store's count may be gone with it

    def _thread(self) -> background.BackgroundWriter | None:
        """The background thread, if started."""
        return self._queued.thread

    def _abandon(self) -> None:
        """Releases the store after a background failure, committing nothing more."""
        bg = self._thread()
        if bg is not None:
            bg.stop()
        if self._store is not None and not self._store.closed:
            self._store.abandon()

    def __del__(self) -> None:
        # Like a file object: commit and unlock if the caller forgot to close (on a thread
        # of its own when the garbage collector runs this: finalizing.py says why).
        store = getattr(self, "_store", None)
        if store is None or store.closed:
            return
        close_forgotten(self.close, "grain_replay-writer-close")

    def __enter__(self) -> ReplayWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- appending ---------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._path

    @property
    def committed(self) -> int:
        """Rows readers can see (for a bounded writer: rows ever committed; see ``live``):
        those of the last completed commit, a ``flush(wait=False)`` in the background's
        included once it completes."""
        return self._committed

    def __len__(self) -> int:
        """Rows appended so far, committed or not (device appends being written included)."""
        return self._appended

    @property
    def rate_limit_wait_s(self) -> float:
        """Seconds this writer's ``flush()`` calls waited for rate-limited learners, in all
        (flushes that timed out with :class:`~grain_replay.RateLimitTimeoutError` included)."""
        return self._gate.waited_s

    @property
    def writer_id(self) -> str | None:
        """This writer's id in a many-writer store (None for a single-writer store)."""
        return self._store.manifest.writer_id if isinstance(self._store, _PARTS) else None

    @property
    def capacity(self) -> int | None:
        return self._store.manifest.capacity if isinstance(self._store, _PARTS) else None

    @property
    def live(self) -> int:
        """Committed rows readers see: the newest ``min(committed, capacity)``."""
        if isinstance(self._store, _PARTS):
            return self._store.manifest.live
        return self.committed

    def append(self, tree: Any) -> None:
        """Appends a block of rows (every leaf has a leading rows axis).

        With ``jax.Array`` leaves it returns once the copies to host are started
        (see the class docstring); ``flush()`` waits for them.

        Raises:
          InvalidTreeError: the tree's structure, dtypes or per-row shapes
            differ from the store's (every differing leaf is named).
          BackgroundWriteError: an earlier device append failed in the background.
        """
        bg = self._queued.thread
        if bg is not None:
            # A tree like the last device tree (0: another tree, or the thread failed).
            rows = bg.submit_like_last(tree, self._appended)
            if rows:
                appended = self._appended = self._appended + rows
                every = self._flush_every
                if every is not None and appended - self._flushed >= every:
                    self.flush()
                return
            if bg.failed:
                self._raise_failed()
        store = self._store
        assert store is not None
        is_device = background.device_leaf_test()  # None unless jax is loaded
        arrays, n = store.check(tree, keep=is_device)
        if n == 0:
            return
        if self._queue_if_needed(arrays, n, is_device, tree):
            return
        store.write(arrays, n)
        self._appended += n
        if self._flush_every is not None and store.pending >= self._flush_every:
            self.flush()

    def _queue_if_needed(
        self, arrays: dict[str, Any], n: int, is_device: Callable[[Any], bool] | None, tree: Any
    ) -> bool:
        """Queues a checked tree for the background thread when it holds device arrays,
        or when device appends before it are still queued (rows keep append order)."""
        queued = self._queued
        if not queued.wants(arrays, is_device):
            return False
        queued.queue(arrays, n, self._appended, is_device, tree)
        self._appended += n
        if self._flush_every is not None and self._appended - self._flushed >= self._flush_every:
            self.flush()
        return True

    def _raise_failed(self) -> None:
        self._queued.raise_failed()

    def flush(self, wait: bool = True) -> int:
        """Makes every appended row durable and visible to readers; returns the committed N.

        First waits for device appends still being copied or written; then, with a
        live rate-limited learner reading this store, waits while committing would put
        the learner more than its tolerance behind (see ``rate_limit_timeout``).

        Args:
          wait: False commits in the background instead (see docs/device_writes.md):
            the rows appended so far are written and committed by the writer's thread
            while the caller goes on appending, and become visible and durable when
            that commit completes (``committed`` then moves); returns the N it will
            commit. A SIGKILL before it completes loses the rows since the last
            completed commit. A failure is raised by the next ``append``/``flush``/
            ``close``; a later ``flush()`` or ``close()`` waits for it. The rate
            limit's wait (above) stays in the call.

        Raises:
          RateLimitTimeoutError: that wait passed ``rate_limit_timeout`` (with
            ``wait=False``: nothing is queued, the rows stay pending).
          BackgroundWriteError: a device append or background commit failed.
        """
        bg = self._thread()
        if bg is not None and bg.failed:
            self._raise_failed()
        store = self._store
        assert store is not None
        if not wait:
            return self._flush_in_background(store)
        if store.closed:
            return self._committed
        if bg is not None:
            bg.drain()
        self._gate.wait(store.committed, store.pending)
        committed = self._committed = store.flush()
        self._flushed = self._appended
        if bg is not None and isinstance(store, PartWriter) and store.defer_evictions:
            bg.request_sync()  # removes the segments this flush evicted
        return committed

    def _flush_in_background(self, store: PartWriter | StoreWriter | ObjectPartWriter) -> int:
        """``flush(wait=False)``: queues a commit of every row appended so far behind them."""
        upto = self._appended
        if store.closed:
            return self._committed
        if upto == self._flushed:  # nothing appended since the last flush's snapshot
            return upto
        committed = self._committed  # a commit queued before may still be under way
        self._gate.wait(committed, upto - committed)
        self._queued.queue_commit(upto, self._commit_done, lambda: self._committed)
        self._flushed = upto
        return upto

    def _commit_done(self, committed: int) -> None:
        """The background thread's commit completed (every row queued before it written)."""
        self._committed = committed

    def __repr__(self) -> str:
        pending = 0 if self._store is None else self._store.pending
        if isinstance(self._store, _PARTS):
            m = self._store.manifest
            return (
                f"ReplayWriter(path={self._path!r}, format={self._format!r}, "
                f"writer_id={m.writer_id!r}, capacity={m.capacity}, committed={m.committed}, "
                f"pending={pending})"
            )
        return (
            f"ReplayWriter(path={self._path!r}, format={self._format!r}, "
            f"committed={self.committed}, pending={pending})"
        )
