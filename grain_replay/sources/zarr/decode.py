"""Local Zarr v3 chunks read straight from their files and decoded on the decode pool.

The codecs are decoded by our own steps (numcodecs, zlib's gzip, google-crc32c:
the libraries zarr itself calls), driven by the array's ``zarr.json``
(:mod:`grain_replay.sources.zarr.meta`), so the path holds on every zarr 3.x.
"""

from __future__ import annotations

import gzip
import itertools
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.pool import run_grouped
from grain_replay.sources.zarr.checks import ChunkGuard
from grain_replay.sources.zarr.meta import ArrayFiles

__all__ = ["LocalChunkReader", "chunk_decoder", "local_chunk_reader"]

# What a corrupt chunk makes a decoder raise (gzip: BadGzipFile is an OSError).
DECODE_ERRORS = (ValueError, RuntimeError, TypeError, OSError, EOFError, zlib.error)

Decode = Callable[[bytes], np.ndarray]


def _bytes_step(name: str) -> Callable[[bytes], bytes] | None:
    """The decoder of one bytes-to-bytes codec, or None for one we do not decode."""
    if name == "gzip":
        return gzip.decompress
    if name == "zstd":
        import numcodecs

        return numcodecs.Zstd().decode
    if name == "blosc":
        import numcodecs

        return numcodecs.Blosc().decode
    if name == "crc32c":
        import google_crc32c

        def crc32c(raw: bytes) -> bytes:
            data = np.frombuffer(raw, np.uint8)
            if len(data) < 4:
                raise ValueError(f"{len(data)} bytes cannot hold a crc32c checksum")
            body, stored = data[:-4], data[-4:].tobytes()
            computed = int(google_crc32c.value(body)).to_bytes(4, "little")
            if computed != stored:
                raise ValueError(
                    f"crc32c checksum mismatch: stored {stored!r}, computed {computed!r}"
                )
            return body  # type: ignore[return-value]

        return crc32c
    return None


def chunk_decoder(files: ArrayFiles, dtype: np.dtype) -> Decode | None:
    """``raw chunk file bytes -> chunk array`` (the grid cell's shape), or None.

    Decodes what zarr's v3 codec pipelines of plain arrays hold: transposes,
    then the ``bytes`` codec (either byte order), then any of gzip, zstd,
    blosc and crc32c. Anything else (sharding, other codecs, storage
    transformers) returns None and is read through zarr.
    """
    if files.zarr_format != 3 or files.grid is None or not files.plain:
        return None
    codecs = list(files.codecs)
    shapes = [files.grid]  # the chunk's shape after each transpose
    orders: list[tuple[int, ...]] = []
    while codecs and codecs[0]["name"] == "transpose":
        order = codecs.pop(0)["configuration"].get("order")
        if not isinstance(order, list) or sorted(order) != list(range(len(files.grid))):
            return None
        orders.append(tuple(order))
        shapes.append(tuple(shapes[-1][o] for o in order))
    if not codecs or codecs[0]["name"] != "bytes":
        return None
    endian = codecs.pop(0)["configuration"].get("endian")
    stored = dtype
    if dtype.itemsize > 1 or dtype.kind == "U":
        if endian not in ("little", "big"):
            return None
        stored = dtype.newbyteorder("<" if endian == "little" else ">")
    steps = [_bytes_step(c["name"]) for c in reversed(codecs)]
    if any(s is None for s in steps):
        return None
    encoded_shape = shapes[-1]
    size = math.prod(encoded_shape) * stored.itemsize
    inverses = [tuple(int(i) for i in np.argsort(o)) for o in reversed(orders)]

    def decode(raw: bytes) -> np.ndarray:
        for step in steps:
            assert step is not None
            raw = step(raw)
        if len(raw) != size:
            raise ValueError(f"the chunk decodes to {len(raw)} bytes, expected {size}")
        chunk = np.frombuffer(raw, stored).reshape(encoded_shape)
        for inverse in inverses:
            chunk = chunk.transpose(inverse)
        return chunk

    return decode


def local_chunk_reader(
    arr: Any, files: ArrayFiles | None, n: int, guard: ChunkGuard
) -> LocalChunkReader | None:
    """A reader of ``arr``'s chunks that bypasses zarr, or None (zarr reads it then).

    Taken for local Zarr v3 arrays on a regular chunk grid whose codecs
    :func:`chunk_decoder` decodes.
    """
    if files is None or n == 0 or files.grid is None or files.shape != tuple(arr.shape):
        return None
    dtype = np.dtype(arr.dtype)
    if dtype.hasobject or dtype.kind == "V" or arr.ndim == 0:
        return None
    decode = chunk_decoder(files, dtype)
    if decode is None:
        return None
    fill = np.asarray(arr.fill_value).astype(dtype)
    return LocalChunkReader(files, n, guard, decode, dtype, fill)


class LocalChunkReader:
    """Decodes the chunks of one local Zarr v3 array with our own codec steps, in threads.

    A block is ``rows [c * chunk_rows, ...)`` of every column: the chunks along
    the record axes (zarr's automatic chunking splits them) are stitched.
    """

    def __init__(
        self,
        files: ArrayFiles,
        n: int,
        guard: ChunkGuard,
        decode: Decode,
        dtype: np.dtype,
        fill: np.ndarray,
    ):
        assert files.grid is not None
        self._files = files
        self._guard = guard
        self._decode_raw = decode
        self._key = guard.key
        self._n = n
        self._chunks = files.grid
        self.chunk_rows = self._chunks[0]
        self._shape = files.shape[1:]
        self._dtype = dtype
        self._fill = fill
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

    # -- one chunk ------------------------------------------------------------

    def _decode(self, coords: tuple[int, ...]) -> np.ndarray | None:
        """Chunk ``coords`` decoded to its full chunk shape, or None when unwritten."""
        path = self._files.path(coords)
        raw = self._guard.read(path)
        if raw is None:
            return None
        try:
            chunk = self._decode_raw(raw)
        except DECODE_ERRORS as e:
            raise InvalidStoreError(
                f"{path} (leaf {self._key!r}): the chunk cannot be decoded "
                f"({type(e).__name__}: {e}). The store is corrupt; re-create it."
            ) from e
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
