"""HDF5 codecs decoded outside h5py, in parallel on the shared decode pool.

h5py decodes a chunk per call with a large fixed cost, under its global lock.
For deflate and lzf (optionally shuffled) the raw chunk bytes can be fetched
cheaply and decompressed by zlib / liblzf, which release the GIL, so the
chunks of a batch decode on every core at once.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_replay.sources.reading.pool import run_grouped

__all__ = ["hdf5_direct_block_reader"]

_H5Z_DEFLATE = 1
_H5Z_SHUFFLE = 2
_H5Z_LZF = 32000  # h5py's own filter


def _chunk_index(dset: Any, rows: int, n: int) -> dict[int, tuple[int, int, int]] | None:
    """``{chunk: (file offset, stored size, filter mask)}`` below row ``n``, or None.

    One pass over HDF5's chunk index (``chunk_iter``, HDF5 >= 1.14); None where
    that is missing. Unwritten chunks are absent.
    """
    if not hasattr(dset.id, "chunk_iter"):
        return None
    needed = -(-n // rows)
    table: dict[int, tuple[int, int, int]] = {}

    def add(info: Any) -> None:
        c = info.chunk_offset[0] // rows
        if c < needed and info.byte_offset is not None:
            table[c] = (int(info.byte_offset), int(info.size), int(info.filter_mask))

    dset.id.chunk_iter(add)
    return table


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    """Inverse of HDF5's byte-shuffle filter."""
    if itemsize <= 1:
        return data
    raw = np.frombuffer(data, dtype=np.uint8)
    body = len(raw) // itemsize * itemsize  # a tail shorter than an item is stored as is
    out = raw[:body].reshape(itemsize, -1).T.tobytes()
    return out + bytes(raw[body:])


_libdeflate: Any = None


def _libdeflate_decompress() -> Any:
    """libdeflate's ``zlib_decompress`` (the optional ``deflate`` package), or None.

    It inflates about twice as fast as zlib (measured on the benchmark's gzip
    chunks: 208 vs 410 us per 64 KiB chunk, 14 vs 48 us per image chunk) and
    drops the GIL too.
    """
    global _libdeflate
    if _libdeflate is None:
        try:
            import deflate

            _libdeflate = deflate.zlib_decompress
        except (ImportError, AttributeError):
            _libdeflate = False
    return _libdeflate or None


def _inflate(raw: bytes, size: int) -> bytes:
    """Inflates a deflate (zlib) chunk that must be exactly ``size`` bytes.

    Bounded: a chunk that inflates past its declared size (a deflate bomb) is
    refused instead of allocating whatever it asks for.
    """
    fast = _libdeflate_decompress()
    if fast is not None:
        try:
            data = fast(raw, size)  # never writes past ``size``
        except Exception as e:  # deflate.DeflateError: corrupt, or longer than ``size``
            raise ValueError(f"does not inflate to {size:,} bytes ({e})") from e
        if len(data) != size:
            raise ValueError(f"inflates to {len(data):,} bytes, expected {size:,}")
        return data
    inflater = zlib.decompressobj()
    data = inflater.decompress(raw, size + 1)
    if len(data) != size or inflater.unconsumed_tail:
        more = "+" if inflater.unconsumed_tail else ""
        raise ValueError(f"inflates to {len(data):,}{more} bytes, expected {size:,}")
    return data


_lzf: Any = None
_lzf_lock = threading.Lock()


def _lzf_function() -> Any:
    """h5py's own ``lzf_decompress`` (exported by ``h5py.h5z``) via ctypes, or None.

    ctypes drops the GIL for the call, so chunks decode on every core; liblzf
    checks both buffers' bounds.
    """
    global _lzf
    with _lzf_lock:
        if _lzf is None:
            try:
                import ctypes

                import h5py.h5z

                fn = ctypes.CDLL(h5py.h5z.__file__).lzf_decompress
                fn.restype = ctypes.c_uint
                fn.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
                _lzf = fn
            except (ImportError, OSError, AttributeError):
                _lzf = False
        return _lzf or None


def _unlzf(raw: bytes, size: int) -> np.ndarray:
    """Decompresses an lzf chunk that must be exactly ``size`` bytes."""
    out = np.empty(size, dtype=np.uint8)
    got = _lzf_function()(raw, len(raw), out.ctypes.data, size) if raw else 0
    if got != size:
        what = f"{got:,} bytes" if got else "nothing (corrupt, or longer than the chunk)"
        raise ValueError(f"lzf-decodes to {what}, expected {size:,}")
    return out


def hdf5_direct_block_reader(
    dset: Any, chunk_rows: int, n: int
) -> Callable[[Sequence[int]], list[np.ndarray]] | None:
    """Reads whole-row chunks of a deflate or lzf (optionally shuffled) dataset, or None.

    Raw chunks are fetched with ``read_direct_chunk`` (one short h5py call
    each) and decoded by zlib / h5py's liblzf on the decode pool, outside
    h5py's global lock.
    """
    if dset.chunks is None or tuple(dset.chunks[1:]) != tuple(dset.shape[1:]):
        return None
    if dset.dtype.hasobject or dset.dtype.kind == "V" or 0 in dset.chunks:
        return None
    plist = dset.id.get_create_plist()
    codes = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    shuffled = codes[:1] == [_H5Z_SHUFFLE]
    rest = codes[1:] if shuffled else codes
    if rest == [_H5Z_DEFLATE]:
        unpack: Callable[[bytes, int], Any] = _inflate
    elif rest == [_H5Z_LZF] and _lzf_function() is not None:
        unpack = _unlzf
    else:
        return None
    codec_bit = 2 if shuffled else 1  # bit i of a chunk's filter mask: filter i skipped
    known_bits = codec_bit | (1 if shuffled else 0)
    dtype, row_shape = dset.dtype, tuple(dset.shape[1:])
    itemsize = dtype.itemsize
    zero = (0,) * (dset.ndim - 1)
    chunk_items = chunk_rows * int(np.prod(row_shape, dtype=np.int64))
    chunk_bytes = chunk_items * itemsize

    def decode(c: int, mask_raw: tuple[int, bytes] | None) -> np.ndarray:
        rows = min(chunk_rows, n - c * chunk_rows)
        # None: never written (the fill value), which HDF5 itself reads.
        if mask_raw is None or mask_raw[0] & ~known_bits:
            return dset[c * chunk_rows : c * chunk_rows + rows]
        mask, raw = mask_raw
        # A set mask bit: that (optional) filter was skipped for this chunk, as
        # lzf is when a chunk does not compress.
        try:
            data = raw if mask & codec_bit else unpack(raw, chunk_bytes)
            if len(data) != chunk_bytes:
                raise ValueError(f"holds {len(data):,} bytes, expected {chunk_bytes:,}")
        except ValueError as e:
            raise ValueError(f"chunk {c} {e}") from e
        if shuffled and not mask & 1:
            data = _unshuffle(data, itemsize)
        flat = np.frombuffer(data, dtype=dtype, count=chunk_items)
        return flat.reshape((chunk_rows, *row_shape))[:rows]

    def fetch(c: int) -> tuple[int, bytes] | None:
        try:
            return dset.id.read_direct_chunk((c * chunk_rows, *zero))
        except (RuntimeError, OSError, KeyError, ValueError):
            return None  # unallocated (or unreadable: h5py's own read says which)

    # The chunk index, listed on the first read (not at open: grain workers
    # that never read would pay for it), lets the raw chunks be read with
    # os.pread in the pool threads too, without one h5py call per chunk.
    index: list[dict[int, tuple[int, int, int]] | None] = []
    index_lock = threading.Lock()
    path = dset.file.filename
    max_stored = 2 * chunk_bytes + 4096  # deflate's worst case is a little over raw

    def chunk_index() -> dict[int, tuple[int, int, int]] | None:
        with index_lock:
            if not index:
                index.append(_chunk_index(dset, chunk_rows, n))
            return index[0]

    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        table = chunk_index()
        if table is None:
            raws = [fetch(c) for c in chunk_ids]
            return run_grouped(list(zip(chunk_ids, raws)), lambda cr: decode(*cr))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

        def load(c: int) -> np.ndarray:
            entry = table.get(c)
            if entry is None:
                return decode(c, None)
            offset, size, mask = entry
            if size > max_stored:
                raise ValueError(
                    f"chunk {c} is stored in {size:,} bytes; its {chunk_bytes:,} raw bytes "
                    f"never need more than {max_stored:,}"
                )
            return decode(c, (mask, os.pread(fd, size, offset)))

        try:
            return run_grouped(list(chunk_ids), load)
        finally:
            os.close(fd)

    return read_blocks
