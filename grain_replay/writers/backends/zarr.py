"""The Zarr backend (its commit invariant: :mod:`grain_replay.writers.backends`)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from grain_replay.errors import StoreExistsError
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import import_zarr, metadata_from_attrs
from grain_replay.writers.atomic import atomic_path
from grain_replay.writers.backends.base import APPEND_CHUNK_BYTES, Backend, chunk_rows_within
from grain_replay.writers.layouts import chunk_rows_for, create_zarr_leaf, zarr_compressors

__all__ = ["ZarrBackend"]


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
    def create_open(cls, path, meta, chunk_rows, compression, *, sync=True, max_rows=None):  # type: ignore[no-untyped-def]
        if sync:  # zarr's arrays name their path: the swap into place would orphan them
            with atomic_path(path, overwrite=False, sync=sync) as partial:
                cls._make(partial, meta, chunk_rows, compression, max_rows)
            backend = cls(path, meta)
            backend.max_rows = max_rows
            return backend
        # Not durable until a later commit point names it (a writer part's segment): made
        # in place, which a crash leaves unnamed, so that reopening removes it as it
        # removes an unswapped .partial; the arrays just made are kept, not re-read.
        if os.path.lexists(path):
            raise StoreExistsError(f"{path} already exists (a segment made twice).")
        group, arrays = cls._make(path, meta, chunk_rows, compression, max_rows)
        backend = cls.__new__(cls)
        Backend.__init__(backend, path, meta)
        backend.max_rows = max_rows
        backend._group, backend._arrays = group, arrays
        return backend

    @classmethod
    def _make(
        cls,
        path: str,
        meta: layout_lib.StoreMetadata,
        chunk_rows: int | None,
        compression: str | None,
        max_rows: int | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """An empty group at ``path`` (N = 0); returns it and its arrays. Chunks hold at
        most ``max_rows`` rows (a segment's: a chunk file is always whole)."""
        zarr = import_zarr()
        compressors = zarr_compressors(compression, path)
        group = zarr.open_group(path, mode="w", zarr_format=3)
        arrays = {}
        for key, spec in meta.leaves.items():
            shape = (1, *spec.shape)
            rows = chunk_rows or chunk_rows_for(
                shape, spec.dtype.itemsize, APPEND_CHUNK_BYTES, page_aligned=compression is None
            )
            rows = chunk_rows_within(rows, max_rows)
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
