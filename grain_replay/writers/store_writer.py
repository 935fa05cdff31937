"""The writer of a plain (single-writer) growing store: one lock, one backend, commits.

:class:`~grain_replay.writers.replay_writer.ReplayWriter` appends through it when
neither ``capacity`` nor ``writer_id`` is given; the same surface as
:class:`~grain_replay.writers.parts_writer.PartWriter`, the writer of one part of a
many-writer store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.errors import (
    InvalidArgumentError,
    InvalidStoreError,
    InvalidTreeError,
    WriterBusyError,
)
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import FORMATS, detect_format, format_from_path
from grain_replay.store.integrity import Checksummer
from grain_replay.writers.backends import BACKENDS, Backend, write_by_leaf
from grain_replay.writers.layouts import choice_fix
from grain_replay.writers.lifecycle import LockedWriter
from grain_replay.writers.row_stage import HostSignature, RowStage

__all__ = ["StoreWriter", "check_tree_matches"]

logger = logging.getLogger(__name__)


def check_tree_matches(
    where: str, arrays: dict[str, Any], treedef: dict[str, Any], want: layout_lib.StoreMetadata
) -> None:
    """Refuses an appended tree whose structure, dtypes or per-row shapes differ from the
    store's, naming every differing leaf."""
    if treedef != want.treedef:
        raise InvalidTreeError(
            f"{where}: the appended tree has leaves {list(arrays)} but the store has "
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
            f"{where}: {'; '.join(bad)}. Fix: cast with .astype(...) and reshape to the "
            "store's per-row shape."
        )


class StoreWriter(LockedWriter):
    """Appends to a plain store held with ``flock`` on ``<path>.lock`` (which stays).

    Args:
      path: the store (absolute); created on the first append if missing.
      format: ``"hdf5"``, ``"npy"``, ``"zarr"`` or None (from what is on disk, or the path).
      chunk_rows, compression: of a new HDF5/Zarr store.
      resume: the committed rows to keep (a checkpoint's watermark), or None: rows
        committed past it are dropped, durably, before anything else.
    """

    def __init__(
        self,
        path: str,
        format: str | None,
        *,
        chunk_rows: int | None,
        compression: str | None,
        resume: int | None = None,
    ) -> None:
        self._path = path
        if format is not None and format not in FORMATS:
            raise InvalidArgumentError(
                f"format must be one of {FORMATS} or None, got {format!r}. "
                f"{choice_fix('format', format, FORMATS)}"
            )
        if os.path.exists(path):
            on_disk = detect_format(path)
            if on_disk not in FORMATS:  # e.g. an RLDS dataset: read-only here
                raise InvalidStoreError(
                    f"{path} is a {on_disk} dataset, which grain_replay reads but does "
                    f"not append to (it writes {list(FORMATS)}). Fix: write to another path."
                )
            if format is not None and format != on_disk:
                raise InvalidStoreError(
                    f"{path} is a {on_disk} store but format={format!r} was given. "
                    f"Fix: pass format={on_disk!r} or another path."
                )
            format = on_disk
        self._format = format or format_from_path(path)
        self._chunk_rows = chunk_rows
        self._compression = compression
        self._lock_fd: int | None = self._acquire_lock()
        self._backend: Backend | None = None
        self._summer: Checksummer | None = None
        self._pending = 0  # rows written, not committed (the stage's not counted)
        self._stage: RowStage | None = None  # small appends, gathered (row_stage.py)
        self._host: HostSignature | None = None  # the last numpy tree checked
        try:
            if os.path.exists(path):
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

    def _open_existing(self) -> Backend:
        cls = BACKENDS[self._format]
        meta = cls.read_metadata(self._path)
        if meta is None:
            raise InvalidStoreError(
                f"{self._path} has no grain_replay metadata (a foreign store), so rows cannot "
                "be appended safely. Fix: write a new store with gr.write or ReplayWriter."
            )
        backend = cls(self._path, meta)
        if meta.store_id is None:  # made before stores had ids: one from its next commit on
            backend.meta = dataclasses.replace(meta, store_id=layout_lib.new_store_id())
        try:
            self._summer = Checksummer.resume(meta.leaves, meta.checksums, meta.num_records)
        except ValueError as e:
            logger.warning("%s: not recording checksums for appended rows (%s)", self._path, e)
            self._summer = None
        logger.info("appending to %s after %d committed rows", self._path, meta.num_records)
        return backend

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

    def _finish(self) -> None:
        if self._backend is not None:
            self.flush()
            self._backend.close()

    def _let_go(self) -> None:
        self._backend = None

    def abandon(self) -> None:
        """Releases the store without committing (the rows since the last flush are lost)."""
        self._stage = None
        if self._backend is not None:
            with contextlib.suppress(Exception):
                self._backend.close()
            self._backend = None
        self._release_lock()

    # -- state -------------------------------------------------------------------

    @property
    def format(self) -> str:
        return self._format

    @property
    def committed(self) -> int:
        return 0 if self._backend is None else self._backend.meta.num_records

    @property
    def pending(self) -> int:
        """Rows appended, not committed (gathered ones included)."""
        return self._pending + (0 if self._stage is None else self._stage.rows)

    # -- appending ---------------------------------------------------------------

    def check(
        self, tree: Any, keep: Callable[[Any], bool] | None = None
    ) -> tuple[dict[str, Any], int]:
        """The tree's leaves and rows, checked against the store's (creating the store on
        the first append); leaves ``keep`` accepts (device arrays) are checked without a copy.

        Raises:
          InvalidTreeError: the tree's structure, dtypes or per-row shapes differ.
        """
        self._check_open(self._path)
        if self._host is not None and (taken := self._host.take(tree)) is not None:
            return taken  # a numpy tree like the last: it passes the same checks
        arrays, treedef, n = layout_lib.check_leaves(tree, where=self._path, keep=keep)
        if self._backend is None:
            leaves = {
                k: layout_lib.LeafSpec(a.dtype, tuple(a.shape[1:])) for k, a in arrays.items()
            }
            meta = layout_lib.StoreMetadata(0, leaves, treedef, store_id=layout_lib.new_store_id())
            self._backend = BACKENDS[self._format].create_open(
                self._path, meta, self._chunk_rows, self._compression
            )
            self._summer = Checksummer(leaves)
        check_tree_matches(self._path, arrays, treedef, self._backend.meta)
        self._host = HostSignature.of(tree, arrays)
        return arrays, n

    def write(self, arrays: dict[str, np.ndarray], n: int, *, by_leaf: bool = False) -> None:
        """Writes checked host rows (not yet committed): small blocks are gathered and
        written together (:class:`RowStage`), at the latest by the next ``flush``.
        ``by_leaf`` (the device writer's thread, whose blocks are batches already): written
        now, one write per leaf, a failure raised as :class:`LeafWriteError` naming it."""
        if n == 0:
            return
        assert self._backend is not None
        if self._stage is None:
            self._stage = RowStage(self._backend.meta.leaves)
        self._stage.write(arrays, n, by_leaf, self._write_block)

    def _write_block(self, arrays: dict[str, np.ndarray], n: int, *, by_leaf: bool) -> None:
        assert self._backend is not None
        if by_leaf:
            write_by_leaf(self._backend, arrays, self.committed + self._pending)
        else:
            self._backend.write(arrays, self.committed + self._pending)
        if self._summer is not None:
            self._summer.update(arrays)
        self._pending += n

    def flush(self) -> int:
        """Commits the pending rows; returns the committed N."""
        if self._stage is not None:
            self._stage.drain(self._write_block)
        if self._backend is not None and self._pending:
            checksums = self._summer.state() if self._summer is not None else None
            self._backend.commit(self.committed + self._pending, checksums)
            self._pending = 0
        return self.committed
