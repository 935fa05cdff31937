"""Per-format storage of a growing store: rows beyond the committed N are invisible.

Each backend keeps the same invariant: rows ``[0, N)`` of every leaf are on
disk before the metadata says ``N``, and nothing a later append does touches
them. A crash therefore leaves the committed rows intact, and reopening drops
whatever was written after the last commit. The commit primitives (fsync of
many files, in-place headers and metadata) are in :mod:`grain_replay.writers.durable`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from grain_replay import layout as layout_lib
from grain_replay.errors import InvalidArgumentError, InvalidStoreError, StoreExistsError
from grain_replay.formats import (
    PAGE,
    import_h5py,
    import_zarr,
    metadata_from_attrs,
)
from grain_replay.writers.atomic import atomic_path
from grain_replay.writers.backend_base import APPEND_CHUNK_BYTES, Backend, write_by_leaf
from grain_replay.writers.durable import (
    commit_metadata,
    fixed_metadata,
    open_h5,
)
from grain_replay.writers.npy_backend import NpyBackend, NpySegmentBackend
from grain_replay.writers.oneshot import chunk_rows_for, create_zarr_leaf, zarr_compressors

__all__ = [
    "Backend",
    "NpyBackend",
    "NpySegmentBackend",
    "ZarrBackend",
    "HDF5Backend",
    "BACKENDS",
    "write_by_leaf",
]

# -- Zarr -----------------------------------------------------------------------


class ZarrBackend(Backend):
    """Zarr v3 group: chunk and metadata files are each replaced atomically by zarr."""

    def __init__(self, path: str, meta: layout_lib.StoreMetadata):
        super().__init__(path, meta)
        # Its members are arrays by construction.
        group: Any = import_zarr().open_group(path, mode="r+")
        self._group = group
        # Every chunk on disk, even all-zero ones, so readers can map them.
        self._arrays: dict[str, Any] = {
            k: group[layout_lib.disk_name(k)].with_config({"write_empty_chunks": True})
            for k in meta.leaves
        }
        n = meta.num_records
        for arr in self._arrays.values():
            if arr.shape[0] != n:  # rows written after the last commit
                arr.resize((n, *arr.shape[1:]))

    @classmethod
    def create_open(cls, path, meta, chunk_rows, compression, *, sync=True):  # type: ignore[no-untyped-def]
        if sync:  # zarr's arrays name their path: the swap into place would orphan them
            with atomic_path(path, overwrite=False, sync=sync) as partial:
                cls._make(partial, meta, chunk_rows, compression)
            return cls(path, meta)
        # Not durable until a later commit point names it (a writer part's segment): made
        # in place, which a crash leaves unnamed, so that reopening removes it as it
        # removes an unswapped .partial; the arrays just made are kept, not re-read.
        if os.path.lexists(path):
            raise StoreExistsError(f"{path} already exists (a segment made twice).")
        group, arrays = cls._make(path, meta, chunk_rows, compression)
        backend = cls.__new__(cls)
        Backend.__init__(backend, path, meta)
        backend._group, backend._arrays = group, arrays
        return backend

    @classmethod
    def _make(
        cls,
        path: str,
        meta: layout_lib.StoreMetadata,
        chunk_rows: int | None,
        compression: str | None,
    ) -> tuple[Any, dict[str, Any]]:
        """An empty group at ``path`` (N = 0); returns it and its arrays."""
        zarr = import_zarr()
        compressors = zarr_compressors(compression, path)
        group = zarr.open_group(path, mode="w", zarr_format=3)
        arrays = {}
        for key, spec in meta.leaves.items():
            shape = (1, *spec.shape)
            rows = chunk_rows or chunk_rows_for(
                shape, spec.dtype.itemsize, APPEND_CHUNK_BYTES, page_aligned=compression is None
            )
            arrays[key] = create_zarr_leaf(group, key, spec, 0, rows, compressors)
        group.attrs[layout_lib.METADATA_ATTR] = meta.to_json()
        return group, arrays

    @classmethod
    def read_metadata(cls, path: str) -> layout_lib.StoreMetadata | None:
        return metadata_from_attrs(import_zarr().open_group(path, mode="r").attrs, path)

    def write(self, arrays: dict[str, np.ndarray], start: int) -> None:
        stop = start + len(next(iter(arrays.values())))
        for key, arr in arrays.items():
            z = self._arrays[key]
            if z.shape[0] < stop:
                z.resize((stop, *z.shape[1:]))
            z[start:stop] = arr

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        return np.asarray(self._arrays[key][start:stop])

    def commit(self, n: int, checksums: dict[str, Any] | None) -> None:
        self.meta = self._meta_with(n, checksums)
        self._group.attrs[layout_lib.METADATA_ATTR] = self.meta.to_json()


# -- HDF5 -----------------------------------------------------------------------


class HDF5Backend(Backend):
    """Chunked, uncompressed datasets with chunks allocated ahead of the rows.

    Chunks are allocated when capacity grows (geometrically, rarely), so an
    append writes raw chunk bytes only and changes no HDF5 structure; the
    committed N is a fixed-size attribute rewritten in place.
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
    def create_open(cls, path, meta, chunk_rows, compression, *, sync=True):  # type: ignore[no-untyped-def]
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
            # structural change, so keep it rare.
            new = max(stop, 2 * capacity)
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


BACKENDS: dict[str, type[Backend]] = {"npy": NpyBackend, "zarr": ZarrBackend, "hdf5": HDF5Backend}
