"""Decoding compressed chunks outside the format libraries, in parallel.

h5py and zarr decode a chunk per call with a large fixed cost (and h5py under
its global lock). For the common codecs the raw chunk bytes can be fetched
cheaply and decompressed by zlib / numcodecs, which release the GIL, so the
chunks of a batch decode on every core at once.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["decode_pool", "hdf5_direct_block_reader"]

_H5Z_DEFLATE = 1
_H5Z_SHUFFLE = 2

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_pid: int | None = None
_pool_lock = threading.Lock()


def decode_pool() -> concurrent.futures.ThreadPoolExecutor:
    """One decoding pool per process (recreated after fork), sized to the cores."""
    global _pool, _pool_pid
    pid = os.getpid()
    if _pool is None or _pool_pid != pid:
        with _pool_lock:
            if _pool is None or _pool_pid != pid:
                workers = max(1, min(8, len(os.sched_getaffinity(0))))
                _pool = concurrent.futures.ThreadPoolExecutor(workers, "grain_replay-decode")
                _pool_pid = pid
    return _pool


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    """Inverse of HDF5's byte-shuffle filter."""
    if itemsize <= 1:
        return data
    raw = np.frombuffer(data, dtype=np.uint8)
    body = len(raw) // itemsize * itemsize  # a tail shorter than an item is stored as is
    out = raw[:body].reshape(itemsize, -1).T.tobytes()
    return out + bytes(raw[body:])


def hdf5_direct_block_reader(
    dset: Any, chunk_rows: int, n: int
) -> Callable[[Sequence[int]], list[np.ndarray]] | None:
    """Reads whole-row chunks of a deflate (optionally shuffled) dataset, or None.

    Raw chunks are fetched with ``read_direct_chunk`` (one short h5py call
    each) and inflated by zlib on the decode pool.
    """
    if dset.chunks is None or tuple(dset.chunks[1:]) != tuple(dset.shape[1:]):
        return None
    if dset.dtype.hasobject or dset.dtype.kind == "V" or 0 in dset.chunks:
        return None
    plist = dset.id.get_create_plist()
    codes = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    if codes not in ([_H5Z_DEFLATE], [_H5Z_SHUFFLE, _H5Z_DEFLATE]):
        return None
    shuffled = codes[0] == _H5Z_SHUFFLE
    dtype, row_shape = dset.dtype, tuple(dset.shape[1:])
    itemsize = dtype.itemsize
    zero = (0,) * (dset.ndim - 1)
    chunk_items = chunk_rows * int(np.prod(row_shape, dtype=np.int64))
    chunk_bytes = chunk_items * itemsize

    def decode(c: int, mask_raw: tuple[int, bytes]) -> np.ndarray:
        mask, raw = mask_raw
        rows = min(chunk_rows, n - c * chunk_rows)
        if mask:  # a filter was skipped for this chunk: let HDF5 decode it
            return dset[c * chunk_rows : c * chunk_rows + rows]
        # Bounded: a chunk that inflates past its declared size (a deflate bomb)
        # is refused instead of allocating whatever it asks for.
        inflater = zlib.decompressobj()
        data = inflater.decompress(raw, chunk_bytes + 1)
        if len(data) != chunk_bytes or inflater.unconsumed_tail:
            raise ValueError(
                f"chunk {c} inflates to {len(data):,}{'+' if inflater.unconsumed_tail else ''} "
                f"bytes, expected {chunk_bytes:,}"
            )
        if shuffled:
            data = _unshuffle(data, itemsize)
        flat = np.frombuffer(data, dtype=dtype, count=chunk_items)
        return flat.reshape((chunk_rows, *row_shape))[:rows]

    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        raws = [dset.id.read_direct_chunk((c * chunk_rows, *zero)) for c in chunk_ids]
        if len(chunk_ids) < 4:
            return [decode(c, r) for c, r in zip(chunk_ids, raws)]
        return list(decode_pool().map(decode, chunk_ids, raws))

    return read_blocks
