"""Zarr v3 data source: chunk-grouped batch reads, chunks fetched concurrently and cached."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import layout as layout_lib
from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError, MissingDependencyError, StoreNotFoundError
from grain_replay.sources.base import Handle, Layout, ReplaySource, is_url
from grain_replay.sources.chunked import (
    DEFAULT_CACHE_BYTES,
    ChunkCache,
    ChunkedLeafReader,
    mapped_reader,
)

__all__ = ["ZarrDataSource", "import_zarr"]


def import_zarr() -> Any:
    try:
        import zarr
    except ImportError as e:
        raise MissingDependencyError(
            "Zarr stores need the zarr package (>=3). Fix: pip install 'grain-replay[zarr]'."
        ) from e
    return zarr


def _open_group(path: str, storage_options: Mapping[str, Any]) -> Any:
    zarr = import_zarr()
    kwargs: dict[str, Any] = {"mode": "r"}
    if is_url(path):
        kwargs["storage_options"] = dict(storage_options)
    return zarr.open_group(path, **kwargs)


class _ZarrHandle(Handle):
    def __init__(self, source: ZarrDataSource):
        self.group = _open_group(source.path, source._storage_options)
        self.cache = ChunkCache(source._cache_bytes)
        n = len(source)
        self.readers = {}
        for key, loc in source._layout.locations.items():
            arr = self.group[loc]
            spec = source._layout.spec[key]
            chunk_rows = int(arr.chunks[0])
            files = _raw_chunk_files(arr, n)
            if files is not None:
                self.readers[key] = mapped_reader(
                    [(f, 0) for f in files], chunk_rows, spec.dtype, spec.shape, n
                )
                continue
            self.readers[key] = ChunkedLeafReader(
                key, n, chunk_rows, spec.shape, spec.dtype,
                _block_reader(arr, chunk_rows, n), self.cache,
            )  # fmt: skip


# Beyond this many chunk files, decoding through zarr beats holding the maps.
_MAX_MAPPED_CHUNKS = 4096


def _raw_chunk_files(arr: Any, n: int) -> list[str] | None:
    """Chunk files of a local, uncompressed, row-chunked array, or None.

    Such a chunk file is the rows' bytes, C order: it can be memory-mapped
    instead of decoded.
    """
    from zarr.codecs import BytesCodec
    from zarr.storage import LocalStore

    meta = arr.metadata
    if n == 0 or getattr(meta, "zarr_format", 2) != 3 or not isinstance(arr.store, LocalStore):
        return None
    codecs = meta.codecs
    if len(codecs) != 1 or not isinstance(codecs[0], BytesCodec):
        return None
    dtype = np.dtype(arr.dtype)
    if dtype.hasobject or dtype.kind == "V":
        return None
    endian = getattr(codecs[0], "endian", None)
    if dtype.itemsize > 1 and getattr(endian, "value", endian) != sys.byteorder:
        return None
    if tuple(arr.chunks[1:]) != tuple(arr.shape[1:]) or arr.chunks[0] == 0:
        return None
    needed = -(-n // arr.chunks[0])
    if needed > _MAX_MAPPED_CHUNKS:
        return None
    root = os.path.join(str(arr.store.root), arr.path)
    files = []
    for c in range(needed):
        key = meta.chunk_key_encoding.encode_chunk_key((c,) + (0,) * (arr.ndim - 1))
        f = os.path.join(root, key)
        if not os.path.isfile(f):  # an unwritten chunk reads as the fill value
            return None
        files.append(f)
    return files


def _block_reader(arr: Any, chunk_rows: int, n: int) -> Any:
    from zarr.core.sync import sync

    async_arr = arr._async_array

    async def fetch(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        coros = [
            async_arr.getitem(slice(c * chunk_rows, min((c + 1) * chunk_rows, n)))
            for c in chunk_ids
        ]
        return [np.asarray(b) for b in await asyncio.gather(*coros)]

    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        return sync(fetch(chunk_ids))

    return read_blocks


class ZarrDataSource(ReplaySource):
    """Random-access grain source over a Zarr v3 group (local path or fsspec URL).

    A batch read groups the requested rows by chunk, fetches the needed chunks
    concurrently, decodes each once and keeps decoded chunks in a bounded
    cache.

    Args:
      path: the group's directory, or an URL such as ``s3://bucket/replay.zarr``.
      keys: leaves (or groups) to read; default all.
      storage_options: fsspec options for URLs.
      cache_bytes: bound of the decoded-chunk cache per process.

    Example:
      >>> src = gr.ZarrDataSource("replay.zarr")
      >>> len(src), src.spec["obs"].shape
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        self._cache_bytes = cache_bytes
        super().__init__(path, keys, storage_options=storage_options)

    def _open(self) -> Handle:
        return _ZarrHandle(self)

    def _inspect(self) -> Layout:
        if not is_url(self._path) and not os.path.isdir(self._path):
            raise StoreNotFoundError(
                f"No Zarr store at {self._path}. Fix: check the path, or write one with "
                "gr.write_zarr(path, tree)."
            )
        zarr = import_zarr()
        try:
            group = _open_group(self._path, self._storage_options)
        except FileNotFoundError as e:
            raise StoreNotFoundError(f"No Zarr group at {self._path} ({e}).") from e
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise InvalidStoreError(
                f"{self._path}: zarr cannot open the group ({type(e).__name__}: {e}). Fix: pass "
                "the root of a Zarr v3 group."
            ) from e
        raw = group.attrs.get(layout_lib.METADATA_ATTR)
        if raw is not None:
            text = raw if isinstance(raw, str) else json.dumps(raw)
            meta = layout_lib.StoreMetadata.from_json(text, where=self._path)
            locations = {k: layout_lib.disk_name(k) for k in meta.leaves}
            for key, loc in locations.items():
                try:
                    arr = group[loc]
                except KeyError as e:
                    raise InvalidStoreError(
                        f"{self._path}: leaf {key!r} is listed in the metadata but array "
                        f"{loc!r} is missing. The store is corrupt; re-create it."
                    ) from e
                want = meta.leaves[key]
                if arr.shape[0] < meta.num_records or tuple(arr.shape[1:]) != want.shape:
                    raise InvalidStoreError(
                        f"{self._path}: leaf {key!r} has shape {arr.shape} but the metadata "
                        f"says ({meta.num_records}, ...{list(want.shape)}). Re-create the store."
                    )
            return Layout(
                meta.num_records, dict(meta.leaves), meta.treedef, locations, meta.checksums
            )
        found = {
            name: arr
            for name, arr in group.members(max_depth=None)
            if isinstance(arr, zarr.Array) and arr.ndim > 0
        }
        if not found:
            raise InvalidStoreError(
                f"{self._path}: the group holds no array with a records axis. Fix: write one "
                "with gr.write_zarr(path, tree)."
            )
        keys = layout_lib.foreign_keys(found, self._requested_keys)
        spec = {}
        for k in keys:
            dtype = layout_lib.check_dtype(np.dtype(found[k].dtype), k, self._path)
            spec[k] = layout_lib.LeafSpec(dtype, tuple(found[k].shape[1:]))
        n = layout_lib.common_length(self._path, {k: found[k].shape[0] for k in keys})
        return Layout(n, spec, tree_lib.treedef_from_keys(keys), {k: k for k in keys})
