"""The HDF5 backend (its commit invariant: :mod:`grain_replay.writers.backends`)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from grain_replay.errors import InvalidArgumentError, InvalidStoreError
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import PAGE, import_h5py, metadata_from_attrs
from grain_replay.writers.atomic import atomic_path
from grain_replay.writers.backends.base import APPEND_CHUNK_BYTES, Backend, chunk_rows_within
from grain_replay.writers.backends.durable import commit_metadata, fixed_metadata, open_h5
from grain_replay.writers.layouts import chunk_rows_for

__all__ = ["HDF5Backend"]


class HDF5Backend(Backend):
    """Chunked, uncompressed datasets with chunks allocated ahead of the rows.

    Chunks are allocated when capacity grows (geometrically, rarely), so an
    append writes raw chunk bytes only and changes no HDF5 structure; the
    committed N is a fixed-size attribute rewritten in place. A store of at most
    ``max_rows`` rows (a writer part's segment) has chunks no larger and never
    grows past them (to the chunk holding its last row).
    """

    def __init__(self, path: str, meta: layout_lib.StoreMetadata):
        super().__init__(path, meta)

        self._file = open_h5(
            path, "r+", alignment_threshold=PAGE, alignment_interval=PAGE, locking=False
        )
        self._dsets = {k: self._file[layout_lib.disk_name(k)] for k in meta.leaves}
        attrs = self._file.attrs
        if layout_lib.METADATA_ATTR_NEXT in attrs:  # finish a commit that died growing it
            attrs.create(layout_lib.METADATA_ATTR, attrs[layout_lib.METADATA_ATTR_NEXT])
            self._file.flush()
            del attrs[layout_lib.METADATA_ATTR_NEXT]
        for key, d in self._dsets.items():
            if d.compression is not None or d.id.get_create_plist().get_nfilters():
                raise InvalidStoreError(
                    f"{path}: leaf {key!r} is compressed; appending to compressed HDF5 is not "
                    "crash-safe (rewritten chunks move on disk). Fix: convert to an "
                    "uncompressed store, or append to a Zarr store with compression."
                )
            if d.chunks is None or d.maxshape[0] is not None:
                raise InvalidStoreError(
                    f"{path}: leaf {key!r} is not resizable (written by gr.write, or by "
                    "another tool), so rows cannot be appended. Fix: convert it, e.g. "
                    "`grain-replay convert` into a new store, or append to a Zarr store."
                )

    @classmethod
    def create_open(cls, path, meta, chunk_rows, compression, *, sync=True, max_rows=None):  # type: ignore[no-untyped-def]
        # The file stays open across the swap into place (its handle follows the inode):
        # what was just made is neither reopened nor checked again (see __init__).
        h5py = import_h5py()
        if compression is not None:
            raise InvalidArgumentError(
                f"{path}: a growing HDF5 store must be uncompressed (compressed chunks move "
                "on disk when rewritten, which a crash could leave half done). Fix: drop "
                "compression, or use format='zarr' with compression."
            )
        f = None
        try:
            with atomic_path(path, overwrite=False, sync=sync) as partial:
                f = h5py.File(
                    partial, "w", alignment_threshold=PAGE, alignment_interval=PAGE, locking=False
                )
                for key, spec in meta.leaves.items():
                    rows = chunk_rows or chunk_rows_for(
                        (1, *spec.shape), spec.dtype.itemsize, APPEND_CHUNK_BYTES,
                        page_aligned=True,
                    )  # fmt: skip
                    rows = chunk_rows_within(rows, max_rows)
                    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                    f.create_dataset(
                        layout_lib.disk_name(key),
                        shape=(0, *spec.shape),
                        # A zero-size dim cannot hold a chunk of 1 unless it is unlimited.
                        maxshape=(None, *(None if d == 0 else d for d in spec.shape)),
                        chunks=(rows, *(max(1, d) for d in spec.shape)),
                        dtype=spec.dtype,
                        dcpl=dcpl,
                    )
                f.attrs.create(layout_lib.METADATA_ATTR, fixed_metadata(meta))
                f.flush()  # on disk (in the OS) before the swap and its fsync
        except BaseException:
            if f is not None:
                f.close()
            raise
        backend = cls.__new__(cls)
        Backend.__init__(backend, path, meta)
        backend.max_rows = max_rows
        backend._file = f
        backend._dsets = {k: f[layout_lib.disk_name(k)] for k in meta.leaves}
        return backend

    @classmethod
    def read_metadata(cls, path: str) -> layout_lib.StoreMetadata | None:
        with open_h5(path, "r", locking=False) as f:
            return metadata_from_attrs(f.attrs, path)  # a commit that died growing it: .next

    def write(self, arrays: dict[str, np.ndarray], start: int) -> None:
        stop = start + len(next(iter(arrays.values())))
        capacity = min(d.shape[0] for d in self._dsets.values())
        if stop > capacity:
            # Grow all leaves together, ahead of need: allocation is the only
            # structural change, so keep it rare (and never past max_rows).
            ahead = 2 * capacity if self.max_rows is None else min(2 * capacity, self.max_rows)
            new = max(stop, ahead)
            for d in self._dsets.values():
                rows = d.chunks[0]
                d.resize((-(-new // rows) * rows, *d.shape[1:]))
            self._file.flush()
        for key, arr in arrays.items():
            self._dsets[key][start:stop] = arr

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        return np.asarray(self._dsets[key][start:stop])

    def commit(self, n: int, checksums: dict[str, Any] | None) -> None:
        self._file.flush()
        os.fsync(self._file.id.get_vfd_handle())
        self.meta = self._meta_with(n, checksums)
        commit_metadata(self._file, self.meta)
        self._file.flush()
        os.fsync(self._file.id.get_vfd_handle())

    def stage_commit(self, n: int, checksums: dict[str, Any] | None) -> list[int]:
        # The rows first (the metadata is rewritten in place, after them); its own sync
        # is left to the caller's round, before the caller's commit point.
        self._file.flush()
        os.fsync(self._file.id.get_vfd_handle())
        self.meta = self._meta_with(n, checksums)
        commit_metadata(self._file, self.meta)
        self._file.flush()
        return [self._file.id.get_vfd_handle()]

    def close(self) -> None:
        self._file.close()
