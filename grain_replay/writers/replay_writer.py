"""ReplayWriter: grows a store while training runs, never corrupting what was committed."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay import layout as layout_lib
from grain_replay.errors import (
    BackgroundWriteError,
    GrainReplayError,
    InvalidArgumentError,
    InvalidStoreError,
    InvalidTreeError,
    WriterBusyError,
)
from grain_replay.formats import FORMATS, detect_format, format_from_path
from grain_replay.integrity import Checksummer
from grain_replay.parts import is_parts_store
from grain_replay.watermark import Watermark
from grain_replay.writers import background
from grain_replay.writers.backends import BACKENDS, Backend, write_by_leaf
from grain_replay.writers.parts_writer import PartWriter
from grain_replay.writers.rate_wait import WriterGate, check_rate_limit_timeout

__all__ = ["ReplayWriter", "WriterBusyError"]

logger = logging.getLogger(__name__)


class ReplayWriter:
    """Appends blocks of rows to a replay store; readers see only committed rows.

    ``append(tree)`` writes rows straight to the store (memory stays bounded);
    ``flush()`` makes them durable and commits them: the metadata's record
    count, which every source reads, moves only after the rows are on disk.
    A crash loses at most the rows appended since the last flush. Reopening an
    existing store continues after its committed rows (uncommitted ones are
    dropped). One writer per store at a time (``flock`` on ``<path>.lock``, which stays).

    Args:
      path: the store; created on the first ``append`` if missing.
      format: ``"hdf5"``, ``"npy"`` or ``"zarr"``; default from the path as in
        :func:`grain_replay.write` (or from what is on disk).
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
        of :func:`grain_replay.read_watermark` (or a row count). Rows committed after
        it are dropped (at once, durably) before appending again, so a run restarted
        from one checkpoint never mixes in rows written after it. Reopen before the
        restored learner's first batch, while no reader holds the dropped rows.
      max_inflight_bytes: bytes of device appends (``jax.Array`` leaves) still being
        copied to host or written before ``append`` waits (default 256 MiB).
      rate_limit_timeout: seconds a ``flush()`` may wait for a rate-limited learner
        of this store (``samples_per_insert``, docs/rate_limits.md) before raising
        :class:`~grain_replay.RateLimitTimeoutError` (the rows stay pending); None
        waits as long as it takes, logging why every 30 s. ``close()`` never waits.

    Device arrays: ``append`` of a tree with ``jax.Array`` leaves (sharded or not, on
    any device, mixed with numpy leaves or not) checks the tree at once, starts each
    leaf's copy to host (``copy_to_host_async``) and returns; a background thread
    writes the trees in append order. ``flush()`` waits for them (the durability
    barrier). Host leaves of such a tree, and host trees appended while device ones
    are queued, are copied at ``append``. A failure in the background is raised by
    the next ``append``/``flush``/``close`` as :class:`~grain_replay.BackgroundWriteError`
    naming the leaf; the committed rows stay intact and the writer must be reopened.
    Host-only appends to an idle writer are written in the call, as always.

    Example:
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
    ):
        self._path = os.path.abspath(os.fspath(path))
        self._part: PartWriter | None = None
        timeout = check_rate_limit_timeout(rate_limit_timeout, self._path)
        parts = capacity is not None or writer_id is not None or segment_rows is not None
        self._rate_waited = 0.0
        who = self._path if writer_id is None else f"{self._path} (writer {writer_id!r})"
        self._gate = WriterGate(self._path, parts=parts, timeout=timeout, who=who)
        self._max_inflight = background.check_max_inflight_bytes(max_inflight_bytes, who)
        self._bg: background.BackgroundWriter | None = None
        if capacity is not None or writer_id is not None or segment_rows is not None:
            if resume_from is not None:
                # The hook: a part would be cut at mark.rows_for(writer_id), its manifest's
                # committed sequence number (segments past it dropped).
                raise InvalidArgumentError(
                    f"{self._path}: resume_from= of a many-writer store (writer_id="
                    f"{writer_id!r}) is not supported yet. Fix: resume a single-writer store, "
                    "or restart the writers without resume_from (rows written after the "
                    "checkpoint stay in the store)."
                )
            if flush_every is not None and flush_every <= 0:
                raise InvalidArgumentError(
                    f"flush_every must be positive or None, got {flush_every}"
                )
            self._flush_every = flush_every
            self._format = format or ""
            self._lock_fd: int | None = None
            self._backend: Backend | None = None
            self._summer: Checksummer | None = None
            self._pending = 0
            self._part = PartWriter(
                self._path,
                format,
                writer_id="default" if writer_id is None else writer_id,
                capacity=capacity,
                segment_rows=segment_rows,
                chunk_rows=chunk_rows,
                compression=compression,
            )
            self._format = self._part.format
            return
        if is_parts_store(self._path):
            raise InvalidStoreError(
                f"{self._path} is a many-writer store (made with capacity= or writer_id=). "
                "Fix: pass writer_id=... (and the capacity it was made with)."
            )
        if format is not None and format not in FORMATS:
            raise InvalidArgumentError(f"format must be one of {FORMATS} or None, got {format!r}.")
        if os.path.exists(self._path):
            on_disk = detect_format(self._path)
            if on_disk not in FORMATS:  # e.g. an RLDS dataset: read-only here
                raise InvalidStoreError(
                    f"{self._path} is a {on_disk} dataset, which grain_replay reads but does "
                    f"not append to (it writes {list(FORMATS)}). Fix: write to another path."
                )
            if format is not None and format != on_disk:
                raise InvalidStoreError(
                    f"{self._path} is a {on_disk} store but format={format!r} was given. "
                    f"Fix: pass format={on_disk!r} or another path."
                )
            format = on_disk
        self._format = format or format_from_path(self._path)
        self._chunk_rows = chunk_rows
        self._compression = compression
        if flush_every is not None and flush_every <= 0:
            raise InvalidArgumentError(f"flush_every must be positive or None, got {flush_every}")
        self._flush_every = flush_every
        self._lock_fd = self._acquire_lock()
        self._backend = None
        self._summer = None
        self._pending = 0
        try:
            resume = None if resume_from is None else self._resume_rows(resume_from)
            if os.path.exists(self._path):
                self._backend = self._open_existing()
            if resume is not None:
                self._truncate(resume)
        except BaseException:
            self._release_lock()
            raise

    # -- lifecycle -------------------------------------------------------------

    def _acquire_lock(self) -> int:
        lock = self._path + ".lock"
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(fd)
            raise WriterBusyError(
                f"{self._path} is being written by another ReplayWriter (lock {lock}). "
                "Fix: close the other writer first; readers need no lock."
            ) from e
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            # The lock file stays: deleting it would let a writer waiting on the
            # old inode and a new one on a fresh file both hold "the" lock.
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open_existing(self) -> Backend:
        cls = BACKENDS[self._format]
        meta = cls.read_metadata(self._path)
        if meta is None:
            raise InvalidStoreError(
                f"{self._path} has no grain_replay metadata (a foreign store), so rows cannot "
                "be appended safely. Fix: write a new store with gr.write or ReplayWriter."
            )
        backend = cls(self._path, meta)
        try:
            self._summer = Checksummer.resume(meta.leaves, meta.checksums, meta.num_records)
        except ValueError as e:
            logger.warning("%s: not recording checksums for appended rows (%s)", self._path, e)
            self._summer = None
        logger.info("appending to %s after %d committed rows", self._path, meta.num_records)
        return backend

    def _resume_rows(self, mark: Any) -> int:
        """The committed rows ``resume_from`` keeps."""
        if isinstance(mark, Watermark):
            if mark.writers is not None:
                raise InvalidArgumentError(
                    f"resume_from names the writers {sorted(mark.writers)} of a bounded "
                    f"many-writer store, but {self._path} is opened as a plain store. Fix: "
                    "reopen each writer with its writer_id= and the same resume_from."
                )
            if "://" not in mark.store and os.path.abspath(mark.store) != self._path:
                raise InvalidArgumentError(
                    f"resume_from is the watermark of {mark.store}, not of {self._path}. Fix: "
                    "reopen the store the checkpoint replayed, or pass resume_from="
                    "mark.rows_for() to cut this one at the same row count."
                )
            return mark.rows_for()
        if isinstance(mark, (bool, np.bool_)) or not isinstance(mark, (int, np.integer)):
            raise InvalidArgumentError(
                f"resume_from must be a gr.Watermark (gr.read_watermark(checkpoint)) or a row "
                f"count, got {mark!r}."
            )
        if mark < 0:
            raise InvalidArgumentError(f"resume_from must be >= 0 rows, got {mark}.")
        return int(mark)

    def _truncate(self, rows: int) -> None:
        """Drops the committed rows past ``rows`` (the checkpoint's watermark), durably."""
        committed = self.committed
        if rows > committed:
            raise InvalidStoreError(
                f"{self._path} holds {committed} committed rows, but the checkpoint to resume "
                f"from covers {rows}: rows it replayed are gone, or this is another store. Fix: "
                "resume from a checkpoint of this store (an older one), or restore the store."
            )
        if rows == committed:
            return
        assert self._backend is not None
        backend = self._backend
        meta = backend.meta
        checksums = None
        if meta.checksums is not None:
            try:
                self._summer = Checksummer.truncated(
                    meta.leaves, meta.checksums, rows, backend.read
                )
                checksums = self._summer.state()
            except ValueError as e:
                logger.warning("%s: not recording checksums for appended rows (%s)", self._path, e)
                self._summer = None
        backend.commit(rows, checksums)
        logger.warning(
            "%s: dropped rows [%d, %d), committed after the checkpoint resumed from",
            self._path,
            rows,
            committed,
        )

    def close(self) -> None:
        """Commits pending rows and releases the store.

        Raises:
          BackgroundWriteError: a device append failed and no call raised it yet (the
            store is released all the same, without the rows since the last flush).
        """
        bg = self._bg
        if bg is not None and bg.failed:
            self._abandon()
            bg.raise_pending()
            return
        if self._part is not None:
            try:
                if bg is not None and not self._part.closed:
                    bg.drain()
            except BackgroundWriteError:
                self._abandon()
                raise
            finally:
                if bg is not None:
                    bg.stop()
            self._part.close()
            return
        if self._lock_fd is None:
            return
        try:
            if self._backend is not None:
                if bg is not None:
                    bg.drain()
                self._commit(wait=False)
                self._backend.close()
        except BackgroundWriteError:
            self._abandon()
            raise
        finally:
            if bg is not None:
                bg.stop()
            self._backend = None
            self._release_lock()

    def _abandon(self) -> None:
        """Releases the store after a background failure, committing nothing more."""
        if self._bg is not None:
            self._bg.stop()
        if self._part is not None:
            if not self._part.closed:
                self._part.abandon()
            return
        if self._backend is not None:
            with contextlib.suppress(Exception):
                self._backend.close()
            self._backend = None
        self._release_lock()

    def __del__(self) -> None:
        # Like a file object: commit and unlock if the caller forgot to close.
        part = getattr(self, "_part", None)
        if part is not None and not part.closed:
            with contextlib.suppress(Exception):
                self.close()
        if getattr(self, "_lock_fd", None) is not None:
            with contextlib.suppress(Exception):
                self.close()

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
        """Rows readers can see (for a bounded writer: rows ever committed; see ``live``)."""
        if self._part is not None:
            return self._part.committed
        return 0 if self._backend is None else self._backend.meta.num_records

    def __len__(self) -> int:
        """Rows appended so far, committed or not (device appends being written included)."""
        queued = 0 if self._bg is None else self._bg.rows
        if self._part is not None:
            return self._part.committed + self._part.pending + queued
        return self.committed + self._pending + queued

    @property
    def rate_limit_wait_s(self) -> float:
        """Seconds this writer's ``flush()`` calls waited for rate-limited learners, in all."""
        return self._rate_waited

    @property
    def writer_id(self) -> str | None:
        """This writer's id in a many-writer store (None for a single-writer store)."""
        return None if self._part is None else self._part.manifest.writer_id

    @property
    def capacity(self) -> int | None:
        return None if self._part is None else self._part.manifest.capacity

    @property
    def live(self) -> int:
        """Committed rows readers see: the newest ``min(committed, capacity)``."""
        return self.committed if self._part is None else self._part.manifest.live

    def append(self, tree: Any) -> None:
        """Appends a block of rows (every leaf has a leading rows axis).

        With ``jax.Array`` leaves it returns once the copies to host are started
        (see the class docstring); ``flush()`` waits for them.

        Raises:
          InvalidTreeError: the tree's structure, dtypes or per-row shapes
            differ from the store's (every differing leaf is named).
          BackgroundWriteError: an earlier device append failed in the background.
        """
        if self._bg is not None:
            if self._bg.failed:
                self._raise_failed()
            if self._bg.submit_like_last(tree, len(self)):  # like the last device tree
                self._flush_if_due(self._bg)
                return
        is_device = background.device_leaf_test()  # None unless jax is loaded
        if self._part is not None:
            arrays, n = self._part.check(tree, keep=is_device)
            if self._queue_if_needed(arrays, n, is_device, tree):
                return
            self._part.write(arrays, n)
            if self._flush_every is not None and self._part.pending >= self._flush_every:
                self.flush()
            return
        if self._lock_fd is None:
            raise GrainReplayError(f"{self._path}: the ReplayWriter is closed.")
        arrays, treedef, n = layout_lib.check_leaves(tree, where=self._path, keep=is_device)
        if self._backend is None:
            leaves = {
                k: layout_lib.LeafSpec(a.dtype, tuple(a.shape[1:])) for k, a in arrays.items()
            }
            meta = layout_lib.StoreMetadata(0, leaves, treedef)
            BACKENDS[self._format].create(self._path, meta, self._chunk_rows, self._compression)
            self._backend = BACKENDS[self._format](self._path, meta)
            self._summer = Checksummer(leaves)
        self._check_matches(arrays, treedef)
        if n == 0:
            return
        if self._queue_if_needed(arrays, n, is_device, tree):
            return
        self._backend.write(arrays, self.committed + self._pending)
        if self._summer is not None:
            self._summer.update(arrays)
        self._pending += n
        if self._flush_every is not None and self._pending >= self._flush_every:
            self.flush()

    def _queue_if_needed(
        self, arrays: dict[str, Any], n: int, is_device: Callable[[Any], bool] | None, tree: Any
    ) -> bool:
        """Queues a checked tree for the background thread when it holds device arrays,
        or when device appends before it are still queued (rows keep append order)."""
        bg = self._bg
        if bg is None or not bg.busy:
            if is_device is None or not any(is_device(a) for a in arrays.values()):
                return False
        if n == 0:
            return True
        if bg is None:
            bg = self._bg = background.BackgroundWriter(
                self._path
                if self._part is None
                else f"{self._path} (writer {self._part.manifest.writer_id!r})",
                self._max_inflight,
                None if self._part is None else self._part.commit_filled,  # less for flush
            )
        write = self._write_queued if self._part is None else self._write_queued_part
        bg.submit(arrays, n, len(self), write, is_device or (lambda _: False), tree)
        self._flush_if_due(bg)
        return True

    def _flush_if_due(self, bg: background.BackgroundWriter) -> None:
        if self._flush_every is not None:
            pending = self._pending if self._part is None else self._part.pending
            if pending + bg.rows >= self._flush_every:
                self.flush()

    def _write_queued(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """The background thread's write of a queued tree (host arrays by now)."""
        assert self._backend is not None
        write_by_leaf(self._backend, arrays, self.committed + self._pending)
        if self._summer is not None:
            self._summer.update(arrays)
        self._pending += n

    def _write_queued_part(self, arrays: dict[str, np.ndarray], n: int) -> None:
        assert self._part is not None
        self._part.write(arrays, n, by_leaf=True)

    def _raise_failed(self) -> None:
        assert self._bg is not None
        self._bg.raise_pending()  # the first call after the failure raises it
        raise GrainReplayError(
            f"{self._path}: this ReplayWriter stopped after a failed device append (raised "
            "earlier as BackgroundWriteError). Fix: close() it and reopen the store with "
            "gr.ReplayWriter to append after its committed rows."
        )

    def _check_matches(self, arrays: dict[str, Any], treedef: dict[str, Any]) -> None:
        assert self._backend is not None
        want = self._backend.meta
        if treedef != want.treedef:
            raise InvalidTreeError(
                f"{self._path}: the appended tree has leaves {list(arrays)} but the store has "
                f"{list(want.leaves)} (or a different container structure). Fix: append trees "
                "with the store's structure."
            )
        bad = [
            f"leaf {k!r} is {a.dtype}{list(a.shape[1:])} per row, the store holds "
            f"{want.leaves[k].dtype}{list(want.leaves[k].shape)}"
            for k, a in arrays.items()
            if a.dtype != want.leaves[k].dtype or tuple(a.shape[1:]) != want.leaves[k].shape
        ]
        if bad:
            raise InvalidTreeError(
                f"{self._path}: {'; '.join(bad)}. Fix: cast with .astype(...) and reshape "
                "to the store's per-row shape."
            )

    def flush(self) -> int:
        """Makes every appended row durable and visible to readers; returns the committed N.

        First waits for device appends still being copied or written; then, with a
        live rate-limited learner reading this store, waits while committing would put
        the learner more than its tolerance behind (see ``rate_limit_timeout``).

        Raises:
          RateLimitTimeoutError: that wait passed ``rate_limit_timeout``.
          BackgroundWriteError: a device append failed in the background.
        """
        if self._bg is not None:
            if self._bg.failed:
                self._raise_failed()
            self._bg.drain()
        if self._part is not None:
            self._rate_waited += self._gate.wait(self._part.committed, self._part.pending)
            return self._part.flush()
        return self._commit(wait=True)

    def _commit(self, *, wait: bool) -> int:
        if wait and self._backend is not None:
            self._rate_waited += self._gate.wait(self.committed, self._pending)
        if self._backend is not None and self._pending:
            checksums = self._summer.state() if self._summer is not None else None
            self._backend.commit(self.committed + self._pending, checksums)
            self._pending = 0
        return self.committed

    def __repr__(self) -> str:
        if self._part is not None:
            m = self._part.manifest
            return (
                f"ReplayWriter(path={self._path!r}, format={self._format!r}, "
                f"writer_id={m.writer_id!r}, capacity={m.capacity}, committed={m.committed}, "
                f"pending={self._part.pending})"
            )
        return (
            f"ReplayWriter(path={self._path!r}, format={self._format!r}, "
            f"committed={self.committed}, pending={self._pending})"
        )
