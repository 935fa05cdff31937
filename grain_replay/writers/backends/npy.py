"""The ``.npy`` backends of a growing store: a directory of ``.npy`` files grown in place,
and the segments of a many-writer store (see :mod:`grain_replay.writers.backends`)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from grain_replay.errors import InvalidArgumentError, StoreExistsError
from grain_replay.store import layout as layout_lib
from grain_replay.store.filesync import (
    StagedText,
    atomic_replace,
    publish_text,
    replace_text,
    stage_text,
)
from grain_replay.store.formats import (
    SEGMENT_NPY_HEADER,
    read_npy_header,
    read_npy_metadata,
)
from grain_replay.store.integrity import as_bytes
from grain_replay.writers.atomic import atomic_path, remove_path
from grain_replay.writers.backends.base import Backend
from grain_replay.writers.backends.durable import (
    NPY_HEADER,
    fsync_all,
    npy_header,
    row_bytes,
)

__all__ = ["NpyBackend", "NpySegmentBackend"]


# -- .npy directory -------------------------------------------------------------


class NpyBackend(Backend):
    """A directory of ``.npy`` files grown in place; headers and metadata follow the data."""

    HEADER = NPY_HEADER  # bytes before the rows: fixed, so it is rewritten in place

    def __init__(self, path: str, meta: layout_lib.StoreMetadata):
        self._setup(path, meta)
        n = meta.num_records
        for key, file in self._files.items():
            spec = meta.leaves[key]
            if read_npy_header(file, key, check_size=False)[3] != self.HEADER:
                self._rewrite_with_fixed_header(file, spec, n)
            fd = os.open(file, os.O_RDWR)
            header = npy_header(spec.dtype, (n, *spec.shape), self.HEADER)
            size = self.HEADER + n * row_bytes(spec)
            # A file that is exactly this header and n rows (e.g. a segment just made
            # empty) needs neither; else header first: a crash between the two steps
            # leaves a header of n rows over a file of at least n rows, which every
            # reader accepts.
            if os.fstat(fd).st_size != size or os.pread(fd, self.HEADER, 0) != header:
                os.pwrite(fd, header, 0)
                os.fsync(fd)
                os.truncate(fd, size)  # drop uncommitted rows
            self._fds[key] = fd

    def _setup(self, path: str, meta: layout_lib.StoreMetadata) -> None:
        super().__init__(path, meta)
        self._files = {k: os.path.join(path, layout_lib.disk_name(k) + ".npy") for k in meta.leaves}
        self._fds: dict[str, int] = {}
        self.row_bytes = {k: row_bytes(spec) for k, spec in meta.leaves.items()}
        self._staged: StagedText | None = None  # metadata written, not yet in place

    @classmethod
    def _rewrite_with_fixed_header(cls, file: str, spec: layout_lib.LeafSpec, n: int) -> None:
        """One-time copy of a file written by np.save into the growable layout."""
        data = np.load(file, mmap_mode="r", allow_pickle=False)[:n]
        with atomic_replace(file) as f:
            f.write(npy_header(spec.dtype, (n, *spec.shape), cls.HEADER))
            f.write(np.ascontiguousarray(data).tobytes())

    @classmethod
    def create_open(cls, path, meta, chunk_rows, compression, *, sync=True, max_rows=None):  # type: ignore[no-untyped-def]
        # Files grow with the rows written (nothing allocated ahead): max_rows changes nothing.
        # The leaf files stay open across the swap into place, and they hold exactly an
        # empty header: nothing to re-read or repair (see __init__).
        fds = cls._create(path, meta, chunk_rows, compression, sync)
        backend = cls.__new__(cls)
        backend._setup(path, meta)
        backend._fds = fds
        return backend

    @classmethod
    def _create(
        cls,
        path: str,
        meta: layout_lib.StoreMetadata,
        chunk_rows: int | None,
        compression: str | None,
        sync: bool,
    ) -> dict[str, int]:
        """Creates the store (N = 0, as :meth:`create_open`); returns its leaf files, open."""
        if chunk_rows is not None or compression is not None:
            raise InvalidArgumentError(
                f"{path}: .npy stores cannot be chunked or compressed. Fix: drop "
                "chunk_rows/compression, or use format='zarr'."
            )
        assert meta.num_records == 0
        fds: dict[str, int] = {}
        try:
            if sync:
                with atomic_path(path, overwrite=False, sync=sync) as partial:
                    os.mkdir(partial)
                    cls._make(partial, meta, fds)
            else:
                # Not durable until a later commit point names it (a writer part's
                # segment): made in place, as a zarr segment is, which a crash leaves
                # unnamed, so that reopening removes it as it removes an unswapped
                # .partial. mkdir is the existence check: no stat, no rename.
                try:
                    os.mkdir(path)
                except FileExistsError:
                    made_twice = f"{path} already exists (a segment made twice)."
                    raise StoreExistsError(made_twice) from None
                except FileNotFoundError:  # no parent folder (yet, or removed): made
                    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                    os.mkdir(path)
                try:
                    cls._make(path, meta, fds)
                except BaseException:
                    remove_path(path)  # half made: removed as the .partial would be
                    raise
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds

    @classmethod
    def _make(cls, folder: str, meta: layout_lib.StoreMetadata, fds: dict[str, int]) -> None:
        """The empty leaf files (left open in ``fds``) and the metadata, in ``folder``."""
        for key, spec in meta.leaves.items():
            name = layout_lib.disk_name(key) + ".npy"
            if "/" in name:
                os.makedirs(os.path.join(folder, os.path.dirname(name)), exist_ok=True)
            fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_CREAT | os.O_EXCL)
            fds[key] = fd
            os.write(fd, npy_header(spec.dtype, (0, *spec.shape), cls.HEADER))
        with open(os.path.join(folder, layout_lib.METADATA_FILE), "w") as f:
            f.write(meta.to_json())

    @classmethod
    def read_metadata(cls, path: str) -> layout_lib.StoreMetadata | None:
        return read_npy_metadata(path)

    def write(self, arrays: dict[str, np.ndarray], start: int) -> None:
        for key, arr in arrays.items():
            offset = self.HEADER + start * self.row_bytes[key]
            view = as_bytes(arr)
            while view:
                written = os.pwrite(self._fds[key], view, offset)
                view, offset = view[written:], offset + written

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        spec = self.meta.leaves[key]
        size = row_bytes(spec)
        raw = os.pread(self._fds[key], (stop - start) * size, self.HEADER + start * size)
        return np.frombuffer(raw, dtype=spec.dtype).reshape(stop - start, *spec.shape)

    def commit(self, n: int, checksums: dict[str, Any] | None) -> None:
        fsync_all(list(self._fds.values()))
        for key, fd in self._fds.items():
            spec = self.meta.leaves[key]
            os.pwrite(fd, npy_header(spec.dtype, (n, *spec.shape), self.HEADER), 0)
        fsync_all(list(self._fds.values()))
        self.meta = self._meta_with(n, checksums)
        replace_text(os.path.join(self.path, layout_lib.METADATA_FILE), self.meta.to_json())

    def stage_commit(self, n: int, checksums: dict[str, Any] | None) -> list[int]:
        # Data and headers are synced in one round with the caller's commit point staged
        # beside them: a crash before that point leaves headers (and metadata) at most
        # ahead of the commit point over rows not all on disk, which readers never read
        # (they read the rows the commit point names) and reopening cuts back.
        if self._staged is not None:  # the last one failed before finishing: redone
            self._staged.discard()
            self._staged = None
        for key, fd in self._fds.items():
            spec = self.meta.leaves[key]
            os.pwrite(fd, npy_header(spec.dtype, (n, *spec.shape), self.HEADER), 0)
        self.meta = self._meta_with(n, checksums)
        staged = stage_text(os.path.join(self.path, layout_lib.METADATA_FILE), self.meta.to_json())
        self._staged = staged
        return [*self._fds.values(), staged.fd]

    def finish_commit(self) -> str | None:
        assert self._staged is not None, "stage_commit() was not called"
        staged, self._staged = self._staged, None
        publish_text(staged, sync_dir=False)  # the caller syncs the folder returned
        return self.path

    def close(self) -> None:
        if self._staged is not None:  # a commit that did not finish: as after a crash
            self._staged.discard()
            self._staged = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


class NpySegmentBackend(NpyBackend):
    """A segment of a many-writer ``.npy`` store: rows start at a page boundary, so a
    reader maps the segments of a writer back to back into one array per leaf."""

    HEADER = SEGMENT_NPY_HEADER
