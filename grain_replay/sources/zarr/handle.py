"""The per-process handle of a Zarr store: mapped chunk files, decoded chunks, remote reads."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import remote as remote_lib
from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError
from grain_replay.pipeline import shutdown
from grain_replay.sources.base import Layout
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.chunked import (
    ChunkedLeafReader,
    grow_stitched,
    mapped_reader,
    stitched_map,
)
from grain_replay.sources.reading.pool import run_grouped
from grain_replay.sources.reading.readers import Handle
from grain_replay.sources.reading.stitch import headroom_for
from grain_replay.sources.zarr import checks as zarr_checks
from grain_replay.sources.zarr import decode as zarr_decode
from grain_replay.sources.zarr import meta as zarr_meta
from grain_replay.sources.zarr import remote as zarr_remote
from grain_replay.store.optional import import_zarr

__all__ = ["ZarrHandle", "ZarrOpening", "lookup", "open_local"]


@dataclasses.dataclass(frozen=True)
class ZarrOpening:
    """What a :class:`ZarrHandle` needs of the ZarrDataSource that opens it, handed over
    by that source (source.py imports this module: the handle reads none of its state).

    Attributes:
      path: the store's path or URL.
      layout: the store's layout as the source inspected it.
      cache_bytes: bound of the decoded-chunk cache.
      allow_external: whether chunk files may lead out of the store.
      storage_options: fsspec options of a remote store.
      max_concurrency: chunk GETs in flight at most (a remote store).
      remote: the remote access of a URL (None: a local store).
      opened: the group and arrays the source's inspection opened in this process, for
        the first handle of a remote store (None: fetch them).
    """

    path: str
    layout: Layout
    cache_bytes: int
    allow_external: bool
    storage_options: Mapping[str, Any]
    max_concurrency: int
    remote: remote_lib.Remote | None = None
    opened: tuple[Any, dict[str, Any]] | None = None


class _BareArray:
    """A Zarr array stored on its own (``zarr.save_array``), seen as a group of one root leaf.

    Its records are the array's rows, as for a single ``.npy`` file.
    """

    def __init__(self, array: Any):
        self.array = array
        self.attrs: dict[str, Any] = {}

    def __getitem__(self, loc: str) -> Any:
        if loc != tree_lib.ROOT_KEY:
            raise KeyError(loc)
        return self.array

    def members(self, max_depth: int | None = None) -> list[tuple[str, Any]]:
        return [(tree_lib.ROOT_KEY, self.array)]


def open_local(path: str) -> Any:
    """The group at ``path``, or an array stored on its own (v2 or v3) as a group of one."""
    zarr = import_zarr()
    node = zarr.open(path, mode="r")
    return _BareArray(node) if isinstance(node, zarr.Array) else node


def lookup(arrays: Mapping[str, Any], loc: str) -> Any:
    node = arrays[loc]
    if isinstance(node, BaseException):  # missing, or metadata zarr could not parse
        raise node
    return node


class ZarrHandle(Handle):
    def __init__(self, opening: ZarrOpening):
        self.remote = opening.remote
        # Leaves of a remote store are read in parallel threads, so that the chunk
        # GETs of every leaf of a batch are in flight together.
        self.pool: concurrent.futures.Executor | None = None
        self.fetch_pool: concurrent.futures.Executor | None = None
        self.cache = ChunkCache(opening.cache_bytes)
        n = opening.layout.num_records
        # What grow() needs: the store's path and its rule for chunk files.
        self._path, self._allow_external = opening.path, opening.allow_external
        self.readers = {}
        if self.remote is not None:
            remote = self.remote
            opened = opening.opened
            if opened is None:
                self.group = zarr_remote.open_remote_group(
                    opening.path, opening.storage_options, remote, opening.max_concurrency
                )
                locations = list(opening.layout.locations.values())
                arrays = remote.call(
                    lambda: zarr_remote.fetch_arrays(self.group, locations), "the array metadata"
                )
            else:
                self.group, arrays = opened
            # One pool of chunk GETs for every leaf: at most max_concurrency in flight.
            self.fetch_pool = shutdown.thread_pool(opening.max_concurrency, "grain_replay_zarr_get")
            for key, loc in opening.layout.locations.items():
                arr = lookup(arrays, loc)
                spec = opening.layout.spec[key]
                chunk_rows = int(arr.chunks[0])
                self.readers[key] = ChunkedLeafReader(
                    key, n, chunk_rows, spec.shape, spec.dtype,
                    zarr_remote.remote_block_reader(
                        arr, chunk_rows, n, remote, self.fetch_pool, key
                    ),
                    self.cache,
                )  # fmt: skip
            if len(self.readers) > 1:
                self.pool = shutdown.thread_pool(min(len(self.readers), 16), "grain_replay_zarr")
            return
        self.group = open_local(opening.path)
        self._n = n
        # A store written anew (gr.write(..., overwrite=True)) is a new directory:
        # its chunks are not the ones mapped, so it is reopened, never grown.
        self._root = os.stat(opening.path).st_ino
        for key, loc in opening.layout.locations.items():
            arr = self.group[loc]
            spec = opening.layout.spec[key]
            chunk_rows = int(arr.chunks[0])
            root = os.path.join(str(arr.store.root), arr.path)
            files = zarr_meta.read_array_files(root)
            guard = zarr_checks.ChunkGuard(opening.path, root, key, opening.allow_external)
            mapped = _raw_chunk_files(
                arr, files, n, key, spec.dtype, self._path, self._allow_external
            )
            if mapped is not None:
                used = n * spec.dtype.itemsize * math.prod(spec.shape)
                self.readers[key] = mapped_reader(
                    [(f, 0) for f in mapped], chunk_rows, spec.dtype, spec.shape, n,
                    headroom=headroom_for(used),
                )  # fmt: skip
                continue
            # Local chunks with plain codecs: read the files and decode on a pool.
            fast = zarr_decode.local_chunk_reader(arr, files, n, guard)
            if fast is None:  # zarr decodes, after the same checks of every file it reads
                blocks, rows = _block_reader(arr, files, guard, chunk_rows, n), None
            else:
                blocks, rows = fast.read_blocks, fast.read_rows
            self.readers[key] = ChunkedLeafReader(
                key, n, chunk_rows, spec.shape, spec.dtype, blocks, self.cache, rows
            )

    def grow(self, source: Any, layout: Layout) -> bool:
        """Maps the chunks a growing store added (or rewrote) in place; False: reopen.

        Committed rows never change, so the chunks wholly below the old length
        stay mapped; the one that held the old end (zarr rewrote it, as a new
        file) and those past it are mapped over their places.
        """
        if self.remote is not None or self.pool is not None:
            return False
        try:
            if os.stat(self._path).st_ino != self._root:
                return False
        except OSError:
            return False
        group = open_local(self._path)
        n = layout.num_records
        plans = []
        for key, loc in layout.locations.items():
            reader = self.readers.get(key)
            stitched = stitched_map(reader)
            if stitched is None:
                return False
            arr = group[loc]
            spec = layout.spec[key]
            first = self._n // int(arr.chunks[0])  # the chunk that held the old end
            root = os.path.join(str(arr.store.root), arr.path)
            files = zarr_meta.read_array_files(root)
            mapped = _raw_chunk_files(
                arr, files, n, key, spec.dtype, self._path, self._allow_external, first
            )
            if mapped is None or stitched.chunk_bytes != _chunk_bytes(arr, spec.dtype):
                return False
            plans.append((reader, [(f, 0) for f in mapped], first, spec))
        if os.stat(self._path).st_ino != self._root:
            return False  # replaced while planned: its files may be another store's
        for reader, parts, first, spec in plans:
            if not grow_stitched(reader, parts, first, spec.dtype, spec.shape, n):
                return False
        self.group, self._n = group, n
        return True

    def close(self) -> None:
        for pool in (self.pool, self.fetch_pool):
            if pool is not None:
                pool.shutdown(wait=False)
        self.pool = self.fetch_pool = None


# Beyond this many chunk files, decoding through zarr beats holding the maps.
_MAX_MAPPED_CHUNKS = 4096


def _chunk_bytes(arr: Any, dtype: np.dtype) -> int:
    return dtype.itemsize * math.prod(int(c) for c in arr.chunks)


def _raw_chunk_files(
    arr: Any,
    files: zarr_meta.ArrayFiles | None,
    n: int,
    key: str,
    want: np.dtype,
    path: str,
    allow_external: bool,
    first: int = 0,
) -> list[str] | None:
    """Chunk files of a local, uncompressed, row-chunked array, or None.

    Such a chunk file is the rows' bytes, C order: it can be memory-mapped
    instead of decoded, as ``want`` (the leaf's dtype) when the bytes codec
    stores that byte order. Each file is checked once here (regular, inside
    the store, exactly one chunk's bytes), not at every read.

    Raises:
      InvalidStoreError: a chunk file that is not a regular file, leads out of
        the store, or is not the size of one chunk.
    """
    if n == 0 or files is None or files.zarr_format != 3 or files.grid is None or not files.plain:
        return None
    if len(files.codecs) != 1 or files.codecs[0]["name"] != "bytes":
        return None
    dtype = np.dtype(arr.dtype)
    if dtype.hasobject or dtype.kind == "V":
        return None
    if dtype.itemsize > 1:
        # Zarr 3 keeps the byte order in the bytes codec, not in data_type.
        order = files.codecs[0]["configuration"].get("endian")
        if order not in ("little", "big"):
            return None
        dtype = dtype.newbyteorder("<" if order == "little" else ">")
    if dtype != want:  # e.g. '>f4' leaves stored little-endian: read through zarr
        return None
    grid = files.grid
    if grid[1:] != files.shape[1:] or files.shape != tuple(arr.shape):
        return None
    needed = -(-n // grid[0])
    if needed > _MAX_MAPPED_CHUNKS:
        return None
    paths = [files.path((c,) + (0,) * (len(grid) - 1)) for c in range(needed)]
    chunk_bytes = dtype.itemsize * math.prod(grid)
    # Chunks before ``first`` were checked when they were mapped (a growing store).
    if not zarr_checks.check_chunk_files(
        paths[first:], files.folder, key, chunk_bytes, path, allow_external
    ):
        return None  # an unwritten chunk reads as the fill value
    return paths


def _block_reader(
    arr: Any,
    files: zarr_meta.ArrayFiles | None,
    guard: zarr_checks.ChunkGuard,
    chunk_rows: int,
    n: int,
) -> Any:
    """Reads whole row-chunks through zarr (sharded arrays, other codecs, Zarr v2).

    zarr reads the chunk files itself, so each file a block needs is checked
    first (regular, inside the store), as the other read paths do; a chunk
    zarr cannot decode is named by its file.
    """
    if files is None or files.grid is None:
        guard.check_tree()  # keys we cannot compute: every file below the array, once

    def paths(c: int) -> list[str]:
        if files is None or files.grid is None:
            return []
        return list(files.paths_of_rows(c * chunk_rows, min((c + 1) * chunk_rows, n)))

    def one(c: int) -> np.ndarray:
        present = [p for p in paths(c) if guard.check(p)]
        try:
            return np.asarray(arr[c * chunk_rows : min((c + 1) * chunk_rows, n)])
        except zarr_decode.DECODE_ERRORS as e:
            if isinstance(e, InvalidStoreError):
                raise
            where = (
                present[0]
                if len(present) == 1
                else f"one of {present}"
                if present
                else f"{guard.root} (chunk {c})"
            )
            raise InvalidStoreError(
                f"{where} (leaf {guard.key!r}): zarr cannot decode the chunk "
                f"({type(e).__name__}: {e}). The store is corrupt; re-create it."
            ) from e

    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        return run_grouped(list(chunk_ids), one)

    return read_blocks
