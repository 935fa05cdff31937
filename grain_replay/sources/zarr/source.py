"""Zarr v3 data source: chunk-grouped batch reads, chunks fetched concurrently and cached."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import layout as layout_lib
from grain_replay import remote as remote_lib
from grain_replay import tree as tree_lib
from grain_replay.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidStoreError,
    StoreNotFoundError,
)
from grain_replay.formats import import_zarr, is_url, metadata_from_attrs
from grain_replay.remote import RetryOptions
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES, ChunkCache
from grain_replay.sources.reading.chunked import ChunkedLeafReader, mapped_reader
from grain_replay.sources.reading.readers import ArrayReader, Handle
from grain_replay.sources.reading.stitch import Stitched, headroom_for
from grain_replay.sources.zarr import checks as zarr_checks
from grain_replay.sources.zarr import decode as zarr_decode
from grain_replay.sources.zarr import remote as zarr_remote

__all__ = ["ZarrDataSource"]


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


def _open_local(path: str) -> Any:
    """The group at ``path``, or an array stored on its own (v2 or v3) as a group of one."""
    zarr = import_zarr()
    node = zarr.open(path, mode="r")
    return _BareArray(node) if isinstance(node, zarr.Array) else node


def _lookup(arrays: Mapping[str, Any], loc: str) -> Any:
    node = arrays[loc]
    if isinstance(node, BaseException):  # missing, or metadata zarr could not parse
        raise node
    return node


def _metadata_locations(group: Any, where: str) -> list[str]:
    """Array paths named by grain_replay's metadata (none for a foreign group)."""
    meta = metadata_from_attrs(group.attrs, where)
    return [] if meta is None else [layout_lib.disk_name(k) for k in meta.leaves]


class _ZarrHandle(Handle):
    def __init__(self, source: ZarrDataSource):
        self.remote = source._new_remote() if is_url(source.path) else None
        # Leaves of a remote store are read in parallel threads, so that the chunk
        # GETs of every leaf of a batch are in flight together.
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.cache = ChunkCache(source._cache_bytes)
        n = len(source)
        self.readers = {}
        if self.remote is not None:
            remote = self.remote
            opened = source._take_opened()
            if opened is None:
                self.group = zarr_remote.open_remote_group(
                    source.path, source._storage_options, remote, source._max_concurrency
                )
                locations = list(source._layout.locations.values())
                arrays = remote.call(
                    lambda: zarr_remote.fetch_arrays(self.group, locations), "the array metadata"
                )
            else:
                self.group, arrays = opened
            limiter = remote_lib.Limiter(source._max_concurrency)
            for key, loc in source._layout.locations.items():
                arr = _lookup(arrays, loc)
                spec = source._layout.spec[key]
                chunk_rows = int(arr.chunks[0])
                self.readers[key] = ChunkedLeafReader(
                    key, n, chunk_rows, spec.shape, spec.dtype,
                    zarr_remote.remote_block_reader(arr, chunk_rows, n, remote, limiter, key),
                    self.cache,
                )  # fmt: skip
            if len(self.readers) > 1:
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    min(len(self.readers), 16), thread_name_prefix="grain_replay_zarr"
                )
            return
        self.group = _open_local(source.path)
        self._n = n
        # A store written anew (gr.write(..., overwrite=True)) is a new directory:
        # its chunks are not the ones mapped, so it is reopened, never grown.
        self._root = os.stat(source.path).st_ino
        for key, loc in source._layout.locations.items():
            arr = self.group[loc]
            spec = source._layout.spec[key]
            chunk_rows = int(arr.chunks[0])
            files = _raw_chunk_files(arr, n, key, spec.dtype, source)
            if files is not None:
                used = n * spec.dtype.itemsize * math.prod(spec.shape)
                self.readers[key] = mapped_reader(
                    [(f, 0) for f in files], chunk_rows, spec.dtype, spec.shape, n,
                    headroom=headroom_for(used),
                )  # fmt: skip
                continue
            # Local chunks with plain codecs: read the files and decode on a pool.
            fast = zarr_decode.local_chunk_reader(arr, n, key, source.path, source._allow_external)
            self.readers[key] = ChunkedLeafReader(
                key, n, chunk_rows, spec.shape, spec.dtype,
                _block_reader(arr, chunk_rows, n, key) if fast is None else fast.read_blocks,
                self.cache, None if fast is None else fast.read_rows,
            )  # fmt: skip

    def grow(self, source: ZarrDataSource, layout: Layout) -> bool:
        """Maps the chunks a growing store added (or rewrote) in place; False: reopen.

        Committed rows never change, so the chunks wholly below the old length
        stay mapped; the one that held the old end (zarr rewrote it, as a new
        file) and those past it are mapped over their places.
        """
        if self.remote is not None or self.pool is not None:
            return False
        try:
            if os.stat(source.path).st_ino != self._root:
                return False
        except OSError:
            return False
        group = _open_local(source.path)
        n = layout.num_records
        plans = []
        for key, loc in layout.locations.items():
            reader = self.readers.get(key)
            stitched = getattr(reader, "mapping", None)
            if not isinstance(reader, ArrayReader) or not isinstance(stitched, Stitched):
                return False
            arr = group[loc]
            spec = layout.spec[key]
            first = self._n // int(arr.chunks[0])  # the chunk that held the old end
            files = _raw_chunk_files(arr, n, key, spec.dtype, source, first)
            if files is None or stitched.chunk_bytes != _chunk_bytes(arr, spec.dtype):
                return False
            plans.append((reader, stitched, files, first, spec))
        for reader, stitched, files, first, spec in plans:
            used = n * spec.dtype.itemsize * math.prod(spec.shape)
            if not stitched.map([(f, 0) for f in files], first, used):
                return False
            reader.grow(stitched.array(spec.dtype, spec.shape, n))
        self.group, self._n = group, n
        return True

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None


# Beyond this many chunk files, decoding through zarr beats holding the maps.
_MAX_MAPPED_CHUNKS = 4096


def _chunk_bytes(arr: Any, dtype: np.dtype) -> int:
    return dtype.itemsize * math.prod(int(c) for c in arr.chunks)


def _raw_chunk_files(
    arr: Any, n: int, key: str, want: np.dtype, source: ZarrDataSource, first: int = 0
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
    if dtype.itemsize > 1:
        # Zarr 3 keeps the byte order in the bytes codec, not in data_type.
        order = getattr(endian, "value", endian)
        if order not in ("little", "big"):
            return None
        dtype = dtype.newbyteorder("<" if order == "little" else ">")
    if dtype != want:  # e.g. '>f4' leaves stored little-endian: read through zarr
        return None
    if tuple(arr.chunks[1:]) != tuple(arr.shape[1:]) or arr.chunks[0] == 0:
        return None
    needed = -(-n // arr.chunks[0])
    if needed > _MAX_MAPPED_CHUNKS:
        return None
    root = os.path.join(str(arr.store.root), arr.path)
    files = [
        os.path.join(root, meta.chunk_key_encoding.encode_chunk_key((c,) + (0,) * (arr.ndim - 1)))
        for c in range(needed)
    ]
    chunk_bytes = _chunk_bytes(arr, dtype)
    store = source.path
    # Chunks before ``first`` were checked when they were mapped (a growing store).
    if not zarr_checks.check_chunk_files(
        files[first:], root, key, chunk_bytes, store, source._allow_external
    ):
        return None  # an unwritten chunk reads as the fill value
    return files


def _block_reader(arr: Any, chunk_rows: int, n: int, key: str) -> Any:
    from zarr.core.sync import sync

    async_arr = arr.async_array

    async def fetch(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        coros = [
            async_arr.getitem(slice(c * chunk_rows, min((c + 1) * chunk_rows, n)))
            for c in chunk_ids
        ]
        return [np.asarray(b) for b in await asyncio.gather(*coros)]

    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        try:
            return sync(fetch(chunk_ids))
        except (ValueError, RuntimeError, TypeError, OSError) as e:
            where = os.path.join(str(getattr(arr.store, "root", arr.store)), arr.path)
            raise InvalidStoreError(
                f"{where}: leaf {key!r} chunks {list(chunk_ids)} cannot be decoded "
                f"({type(e).__name__}: {e}). The store is corrupt; re-create it."
            ) from e

    return read_blocks


class ZarrDataSource(ReplaySource):
    """Random-access grain source over a Zarr v3 group (local path or fsspec URL).

    A batch read groups the requested rows by chunk, fetches the needed chunks
    concurrently, decodes each once and keeps decoded chunks in a bounded
    cache. For an URL, the chunks of every leaf of a batch are fetched
    together (at most ``max_concurrency`` requests in flight, one GET per
    chunk), and transient failures (5xx, connection reset, timeouts) are
    retried with exponential backoff.

    Args:
      path: the group's directory, or an URL such as ``s3://bucket/replay.zarr``.
      keys: leaves (or groups) to read; default all.
      storage_options: fsspec options for URLs, e.g. ``{"key": ..., "secret": ...,
        "client_kwargs": {"endpoint_url": ...}}`` for S3. They travel with the
        source when it is pickled (into grain's workers) but never appear in
        ``repr`` or in error messages.
      cache_bytes: bound of the decoded-chunk cache per process.
      retries: retries of a failed remote request (an int, or ``RetryOptions``
        for the backoff too); 0 fails at once.
      max_concurrency: remote requests in flight per process.
      allow_external: follow symlinks (array folders, chunk files) that lead
        out of a local store; refused by default, since a store from elsewhere
        could read any file on the machine this way.

    Raises:
      StoreNotFoundError: no group at ``path`` (for S3, says whether the bucket
        or the key is missing).
      InvalidStoreError: not a readable Zarr group, or one whose files lie
        (array metadata that disagrees with grain_replay's, chunk files of the
        wrong size, FIFOs, symlinks out of the store); for URLs also missing or
        refused credentials and an unreachable endpoint, naming the
        ``storage_options`` key to fix.

    Example:
      >>> src = gr.ZarrDataSource("replay.zarr")
      >>> len(src), src.spec["obs"].shape
      >>> s3 = gr.ZarrDataSource("s3://bucket/replay.zarr", storage_options={"anon": True})
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {**ReplaySource._PER_PROCESS, "_opened": None}

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        retries: int | RetryOptions = 3,
        max_concurrency: int = remote_lib.DEFAULT_CONCURRENCY,
        allow_external: bool = False,
    ):
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int):
            raise ArgumentTypeError(
                f"max_concurrency must be an int, got {type(max_concurrency).__name__}"
            )
        if max_concurrency < 1:
            raise InvalidArgumentError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._cache_bytes = cache_bytes
        self._retry = remote_lib.retry_options(retries)
        self._max_concurrency = max_concurrency
        # (pid, group, arrays) opened by _inspect, handed to the first handle of
        # that process so that it does not fetch the same metadata again.
        self._opened: tuple[int, Any, dict[str, Any]] | None = None
        super().__init__(path, keys, storage_options=storage_options, allow_external=allow_external)

    def _take_opened(self) -> tuple[Any, dict[str, Any]] | None:
        """The group and arrays ``_inspect`` opened in this process, once (saves their GETs)."""
        opened, self._opened = self._opened, None
        if opened is None or opened[0] != os.getpid():
            return None
        return opened[1], opened[2]

    def _new_remote(self) -> remote_lib.Remote:
        return remote_lib.Remote(self._path, self._storage_options, self._retry, kind="Zarr group")

    def _open(self) -> Handle:
        return _ZarrHandle(self)

    # -- reads: every leaf of a remote batch at once ---------------------------

    def read_flat(
        self, indices: Sequence[int] | np.ndarray, *, check: bool = True
    ) -> dict[str, np.ndarray]:
        """Like :meth:`read_batch` but returns ``{key: array}`` instead of the tree."""
        handle = self._get_handle()
        pool = getattr(handle, "pool", None)
        if pool is None:
            return super().read_flat(indices, check=check)
        idx = self._check_indices(indices) if check else np.asarray(indices)
        readers = handle.readers
        futures = [pool.submit(readers[k].take, idx) for k in self._keys]
        return {k: f.result() for k, f in zip(self._keys, futures)}

    def __getitem__(self, index: int) -> Any:
        """Record ``index`` (negative counts from the end) as a tree of numpy arrays."""
        if not is_url(self._path):
            return super().__getitem__(index)
        i = self._check_index(index)
        flat = self.read_flat(np.array([i], dtype=np.int64))
        return self._build({k: v[0] for k, v in flat.items()})

    # -- layout -----------------------------------------------------------------

    def _inspect(self) -> Layout:
        if is_url(self._path):
            remote = self._new_remote()
            group = zarr_remote.open_remote_group(
                self._path, self._storage_options, remote, self._max_concurrency
            )

            def layout() -> Layout:
                locations = _metadata_locations(group, remote.shown)
                arrays = zarr_remote.fetch_arrays(group, locations) if locations else {}
                full = self._layout_of(group, arrays)
                self._opened = (os.getpid(), group, arrays) if locations else None
                return full

            return remote.call(layout, "the Zarr metadata")
        if not os.path.isdir(self._path):
            raise StoreNotFoundError(
                f"No Zarr store at {self._path}. Fix: check the path, or write one with "
                "gr.write_zarr(path, tree)."
            )
        import_zarr()
        # A FIFO as zarr.json would block zarr's open forever.
        zarr_checks.check_node(self._path, self._path, None, self._allow_external)
        try:
            group = _open_local(self._path)
        except FileNotFoundError as e:
            raise StoreNotFoundError(f"No Zarr group at {self._path} ({e}).") from e
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise InvalidStoreError(
                f"{self._path}: zarr cannot open the group ({type(e).__name__}: {e}). Fix: pass "
                "the root of a Zarr v3 group."
            ) from e
        return self._layout_of(group)

    def _layout_of(self, group: Any, arrays: Mapping[str, Any] | None = None) -> Layout:
        zarr = import_zarr()
        meta = metadata_from_attrs(group.attrs, self._path)
        if meta is not None:
            locations = {k: layout_lib.disk_name(k) for k in meta.leaves}
            for key, loc in locations.items():
                where = self._array_metadata_file(loc)
                try:
                    if arrays is None:
                        folder = os.path.join(self._path, loc)
                        zarr_checks.check_node(self._path, folder, key, self._allow_external)
                    arr = group[loc] if arrays is None else _lookup(arrays, loc)
                except KeyError as e:
                    raise InvalidStoreError(
                        f"{self._path}: leaf {key!r} is listed in the metadata but array "
                        f"{loc!r} is missing. The store is corrupt; re-create it."
                    ) from e
                except (ValueError, TypeError, OSError) as e:
                    if isinstance(e, InvalidStoreError):
                        raise
                    raise InvalidStoreError(
                        f"{where}: the array metadata of leaf {key!r} cannot be read "
                        f"({type(e).__name__}: {e}). The store is corrupt; re-create it."
                    ) from e
                want = meta.leaves[key]
                if arr.shape[0] < meta.num_records or tuple(arr.shape[1:]) != want.shape:
                    raise InvalidStoreError(
                        f"{self._path}: leaf {key!r} has shape {arr.shape} but the metadata "
                        f"says ({meta.num_records}, ...{list(want.shape)}). Re-create the store."
                    )
                zarr_checks.check_array(arr, key, want.dtype, where, self._cache_bytes)
            return Layout(
                meta.num_records, dict(meta.leaves), meta.treedef, locations, meta.checksums
            )
        if not is_url(self._path):
            zarr_checks.check_foreign_tree(self._path, self._allow_external)
        try:
            found = {
                name: arr
                for name, arr in group.members(max_depth=None)
                if isinstance(arr, zarr.Array) and arr.ndim > 0
            }
        except (ValueError, TypeError, OSError) as e:
            if isinstance(e, InvalidStoreError):
                raise
            raise InvalidStoreError(
                f"{self._path}: the metadata (zarr.json) of a node below the group cannot be "
                f"read ({type(e).__name__}: {e}). The store is corrupt; re-create it."
            ) from e
        if not found:
            raise InvalidStoreError(
                f"{self._path}: the group holds no array with a records axis. Fix: write one "
                "with gr.write_zarr(path, tree)."
            )
        keys = layout_lib.foreign_keys(found, self._requested_keys)
        spec = {}
        for k in keys:
            dtype = layout_lib.check_dtype(np.dtype(found[k].dtype), k, self._path)
            where = self._array_metadata_file(k)
            zarr_checks.check_array(found[k], k, None, where, self._cache_bytes)
            spec[k] = layout_lib.LeafSpec(dtype, tuple(found[k].shape[1:]))
        n = layout_lib.common_length(self._path, {k: found[k].shape[0] for k in keys})
        return Layout(n, spec, tree_lib.treedef_from_keys(keys), {k: k for k in keys})

    def _array_metadata_file(self, loc: str) -> str:
        """The array's zarr.json, as errors name it."""
        if is_url(self._path):
            return f"{self._path.rstrip('/')}/{loc}/zarr.json"
        return os.path.join(self._path, loc, "zarr.json")
