"""Local Zarr v3 chunks read straight from their files and decoded on the decode pool."""

from __future__ import annotations

import errno
import itertools
import os
import stat
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.files import check_inside
from grain_replay.sources.reading.pool import run_grouped

__all__ = ["LocalChunkReader", "local_chunk_reader"]


def local_chunk_reader(
    arr: Any, n: int, key: str, store_root: str, allow_external: bool
) -> LocalChunkReader | None:
    """A reader of ``arr``'s chunks that bypasses zarr's async machinery, or None.

    Taken for local Zarr v3 arrays whose codecs are a bytes-like array-to-bytes
    codec followed by bytes-to-bytes codecs (zstd, gzip, blosc, crc32c, ...),
    each with zarr's synchronous decoder. Anything else (sharding, transposes,
    Zarr v2, remote stores) returns None and is read through zarr.
    """
    try:
        from zarr.abc.codec import ArrayBytesCodec, BytesBytesCodec
        from zarr.codecs import ShardingCodec
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.chunk_grids import RegularChunkGrid
        from zarr.storage import LocalStore
    except ImportError:  # another zarr 3 layout: zarr's own path still works
        return None
    meta = arr.metadata
    if n == 0 or getattr(meta, "zarr_format", 2) != 3 or not isinstance(arr.store, LocalStore):
        return None
    if not isinstance(meta.chunk_grid, RegularChunkGrid) or 0 in tuple(arr.chunks):
        return None
    dtype = np.dtype(arr.dtype)
    if dtype.hasobject or dtype.kind == "V" or arr.ndim == 0:
        return None
    codecs = list(meta.codecs)
    a2b, b2b = codecs[0], codecs[1:]
    if not isinstance(a2b, ArrayBytesCodec) or isinstance(a2b, ShardingCodec):
        return None
    if not all(isinstance(c, BytesBytesCodec) for c in b2b):
        return None
    if not all(hasattr(c, "_decode_sync") for c in codecs):
        return None
    prototype = default_buffer_prototype()
    spec = meta.get_chunk_spec((0,) * arr.ndim, arr.async_array.config, prototype)
    return LocalChunkReader(
        arr, n, key, store_root, allow_external, a2b, b2b[::-1], spec, prototype, dtype
    )


class LocalChunkReader:
    """Decodes the chunks of one local Zarr v3 array with zarr's codec objects, in threads.

    A block is ``rows [c * chunk_rows, ...)`` of every column: the chunks along
    the record axes (zarr's automatic chunking splits them) are stitched.
    """

    def __init__(
        self,
        arr: Any,
        n: int,
        key: str,
        store_root: str,
        allow_external: bool,
        a2b: Any,
        b2b_reversed: Sequence[Any],
        spec: Any,
        prototype: Any,
        dtype: np.dtype,
    ):
        self._meta = arr.metadata
        self._root = os.path.join(str(arr.store.root), arr.path)
        self._store_root = store_root
        self._allow_external = allow_external
        self._key = key
        self._n = n
        self._chunks = tuple(int(c) for c in arr.chunks)
        self.chunk_rows = self._chunks[0]
        self._shape = tuple(int(s) for s in arr.shape[1:])
        self._a2b = a2b
        self._b2b = list(b2b_reversed)
        self._spec = spec
        self._prototype = prototype
        self._dtype = dtype
        self._fill = np.asarray(spec.fill_value).astype(dtype)
        # One (chunk coordinates, destination slices) per chunk along the record axes.
        grids = [range(-(-s // c)) for s, c in zip(self._shape, self._chunks[1:])]
        self._inner = [
            (
                coords,
                tuple(
                    slice(j * c, min((j + 1) * c, s))
                    for j, c, s in zip(coords, self._chunks[1:], self._shape)
                ),
            )
            for coords in itertools.product(*grids)
        ]
        self._checked_dirs: set[str] = set()

    # -- one chunk ------------------------------------------------------------

    def _path(self, coords: tuple[int, ...]) -> str:
        return os.path.join(self._root, self._meta.encode_chunk_key(coords))

    def _check_folder(self, folder: str) -> None:
        """Refuses a chunk folder that leads out of the store through a symlink.

        The array folder itself is checked once; below it, one ``lstat`` per
        folder not seen before (a full ``realpath`` only when one is a link).
        """
        if not self._checked_dirs:
            check_inside(self._store_root, self._root, self._key, self._allow_external)
            self._checked_dirs.add(self._root)
        rel = os.path.relpath(folder, self._root)
        prefix = self._root
        for part in rel.split(os.sep) if rel != os.curdir else ():
            prefix = os.path.join(prefix, part)
            if prefix in self._checked_dirs:
                continue
            try:
                mode = os.lstat(prefix).st_mode
            except FileNotFoundError:
                return  # no chunk below: read as unwritten, nothing to remember
            if stat.S_ISLNK(mode):
                check_inside(self._store_root, prefix, self._key, self._allow_external)
            self._checked_dirs.add(prefix)

    def _read_file(self, path: str) -> bytes | None:
        """The chunk file's bytes, None when it was never written (the fill value)."""
        folder = os.path.dirname(path)
        if folder not in self._checked_dirs:
            self._check_folder(folder)
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno != errno.ELOOP:  # ELOOP: the chunk file is a symlink
                raise
            check_inside(self._store_root, path, self._key, self._allow_external)
            try:
                fd = os.open(path, flags)
            except FileNotFoundError:  # a dangling link: zarr reads it as unwritten too
                return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidStoreError(
                    f"{path} (leaf {self._key!r}) is not a regular file (a FIFO, device or "
                    "socket). Fix: re-create the store with regular chunk files."
                )
            parts = []
            left = st.st_size
            while left > 0:
                part = os.read(fd, left)
                if not part:
                    break
                parts.append(part)
                left -= len(part)
            return b"".join(parts) if len(parts) != 1 else parts[0]
        finally:
            os.close(fd)

    def _decode(self, coords: tuple[int, ...]) -> np.ndarray | None:
        """Chunk ``coords`` decoded to its full chunk shape, or None when unwritten."""
        path = self._path(coords)
        raw = self._read_file(path)
        if raw is None:
            return None
        try:
            buf = self._prototype.buffer.from_bytes(raw)
            for codec in self._b2b:
                buf = codec._decode_sync(buf, self._spec)
            chunk = self._a2b._decode_sync(buf, self._spec).as_numpy_array()
        except (ValueError, RuntimeError, TypeError, OSError) as e:
            raise InvalidStoreError(
                f"{path} (leaf {self._key!r}): the chunk cannot be decoded "
                f"({type(e).__name__}: {e}). The store is corrupt; re-create it."
            ) from e
        if chunk.shape != self._chunks:
            raise InvalidStoreError(
                f"{path} (leaf {self._key!r}): the chunk decodes to shape {chunk.shape}, "
                f"expected {self._chunks}. The store is corrupt; re-create it."
            )
        return chunk

    # -- blocks of rows ----------------------------------------------------------

    def _rows_in(self, c: int) -> int:
        return min(self.chunk_rows, self._n - c * self.chunk_rows)

    def read_blocks(self, chunk_ids: Sequence[int]) -> list[np.ndarray]:
        """Rows ``[c * chunk_rows, (c + 1) * chunk_rows)`` (clipped at N) for each ``c``."""
        blocks = [np.empty((self._rows_in(c), *self._shape), self._dtype) for c in chunk_ids]

        def fill(task: tuple[int, tuple[int, ...], tuple[slice, ...]]) -> None:
            j, coords, where = task
            block = blocks[j]
            chunk = self._decode((chunk_ids[j], *coords))
            if chunk is None:
                block[(slice(None), *where)] = self._fill
                return
            local = tuple(slice(0, s.stop - s.start) for s in where)
            block[(slice(None), *where)] = chunk[(slice(0, len(block)), *local)]

        run_grouped(
            [(j, coords, where) for j in range(len(chunk_ids)) for coords, where in self._inner],
            fill,
        )
        return blocks

    def read_rows(self, chunk_ids: Sequence[int], rows: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Rows ``rows[j]`` (offsets inside the block) of block ``chunk_ids[j]``, for each ``j``.

        For blocks too big to keep: each chunk is decoded, the asked rows
        copied out, and the chunk dropped.
        """
        outs = [np.empty((len(r), *self._shape), self._dtype) for r in rows]

        def fill(task: tuple[int, tuple[int, ...], tuple[slice, ...]]) -> None:
            j, coords, where = task
            chunk = self._decode((chunk_ids[j], *coords))
            if chunk is None:
                outs[j][(slice(None), *where)] = self._fill
                return
            local: tuple[Any, ...] = (rows[j], *(slice(0, s.stop - s.start) for s in where))
            outs[j][(slice(None), *where)] = chunk[local]

        run_grouped(
            [(j, coords, where) for j in range(len(chunk_ids)) for coords, where in self._inner],
            fill,
        )
        return outs
