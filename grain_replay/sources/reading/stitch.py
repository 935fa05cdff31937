"""One contiguous read-only array over row-chunks stored in several places.

Chunk files of a Zarr array, or the chunks of an HDF5 dataset, are mapped back
to back into one reserved range of address space (``mmap`` with ``MAP_FIXED``),
so a random batch is one numpy gather, as for a single ``.npy`` file, instead of
one gather per chunk. Needs page-aligned file offsets and chunk sizes that are
whole pages (the writers pick such chunks); callers fall back otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Sequence

import numpy as np

from grain_replay.store.formats import PAGE

__all__ = ["Stitched", "can_stitch", "headroom_for", "place", "reserve", "stitch"]

logger = logging.getLogger(__name__)

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED = 0x01, 0x02, 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc()


class _Reservation:
    """Owns the address range; numpy arrays over it keep it alive via ``base``."""

    # Tells readahead.is_file_mapping that the memory is mapped files.
    file_mapping = True

    def __init__(self, addr: int, size: int, used: int, owner: _Reservation | None = None):
        self.addr, self.size = addr, size
        self._owner = owner  # a window keeps the whole range alive; only the owner unmaps
        self.__array_interface__ = {
            "data": (addr, True),
            "shape": (used,),
            "typestr": "|u1",
            "version": 3,
        }

    def window(self, used: int) -> _Reservation:
        """The first ``used`` bytes, as a buffer that keeps this range mapped."""
        return _Reservation(self.addr, self.size, used, owner=self)

    def __del__(self) -> None:
        if _LIBC is not None and self.addr and self._owner is None:
            _LIBC.munmap(self.addr, self.size)
            self.addr = 0


def can_stitch(offsets: Sequence[int], chunk_bytes: int) -> bool:
    """True if chunks at ``offsets`` of ``chunk_bytes`` each can be mapped back to back.

    Chunks of whole pages; or one chunk of any size (a writer part's segment is one chunk
    of its rows): a second chunk the store adds later does not map, and the source
    reopens instead (:meth:`Stitched.map` returns False).
    """
    return (
        _LIBC is not None
        and chunk_bytes > 0
        and (chunk_bytes % PAGE == 0 or len(offsets) == 1)
        and all(o % PAGE == 0 for o in offsets)
    )


# Address space a stitched leaf reserves for chunks a growing store adds: as much
# as it maps, within these bounds (no memory; it counts against a ulimit -v).
_GROW_MIN, _GROW_MAX = 64 << 20, 1 << 30


def headroom_for(used: int) -> int:
    """Bytes to reserve past ``used`` mapped bytes of a store that may grow."""
    return min(max(used, _GROW_MIN), _GROW_MAX)


def reserve(size: int) -> _Reservation | None:
    """``size`` bytes of address space (no memory, no access), or None if refused."""
    if _LIBC is None:
        return None
    addr = _LIBC.mmap(None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    return None if addr in (None, _MAP_FAILED) else _Reservation(int(addr), size, 0)


def place(addr: int, length: int, fd: int, offset: int) -> bool:
    """Maps ``length`` bytes of ``fd`` at ``offset`` read-only at ``addr`` (inside a reservation,
    replacing what was there), advised for random reads; False if refused."""
    got = _LIBC.mmap(addr, length, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, offset)  # type: ignore[union-attr]
    if got != addr:
        return False
    # Random access: no read-ahead on page faults (see readers.advise_random).
    _LIBC.madvise(addr, length, getattr(mmap, "MADV_RANDOM", 1))  # type: ignore[union-attr]
    return True


class Stitched:
    """Chunks mapped back to back into a reserved range, which more chunks can join.

    Args:
      chunk_bytes: bytes of one chunk (whole pages).
      cap: bytes of address space to reserve (at least the chunks mapped now).
    """

    def __init__(self, chunk_bytes: int, cap: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.parts: list[tuple[str, int]] = []  # (file, offset) of each chunk mapped
        self._reservation = reserve(cap)

    def map(self, parts: Sequence[tuple[str, int]], first: int, used: int) -> bool:
        """Maps ``parts[first:]`` at their places (replacing what was there); False on failure.

        ``used`` is the bytes the rows take: a chunk past it is mapped only up to it.
        """
        reservation = self._reservation
        if reservation is None or len(parts) * self.chunk_bytes > reservation.size:
            return False
        size = self.chunk_bytes
        for i in range(first, len(parts)):
            path, offset = parts[i]
            length = min(size, used - i * size)
            if length <= 0:
                break
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # removed since it was listed (its store evicted, replaced)
                return False
            try:
                if os.fstat(fd).st_size < offset + length:
                    logger.warning(
                        "%s: chunk shorter than expected; reading it through the codec", path
                    )
                    return False
                if not place(reservation.addr + i * size, length, fd, offset):
                    return False
            finally:
                os.close(fd)
        self.parts = list(parts)
        return True

    def array(self, dtype: np.dtype, row_shape: tuple[int, ...], num_rows: int) -> np.ndarray:
        """The first ``num_rows`` rows, read-only (the array keeps the mapping alive)."""
        assert self._reservation is not None
        row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        window = _Reservation.window(self._reservation, num_rows * row_bytes)
        array = np.asarray(window).view(dtype).reshape((num_rows, *row_shape))
        array.flags.writeable = False
        return array


def stitch(
    parts: Sequence[tuple[str, int]],
    chunk_bytes: int,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    num_rows: int,
    *,
    headroom: int = 0,
) -> tuple[np.ndarray, Stitched] | None:
    """Maps ``parts`` (``(file, offset)`` per chunk, in row order) into one array.

    Args:
      headroom: bytes of address space to reserve past the chunks, for chunks a
        growing store adds later (:meth:`Stitched.map`).

    Returns:
      A read-only ``(num_rows, *row_shape)`` array and its :class:`Stitched`, or
      None if the mapping failed (the caller then reads chunk by chunk).
    """
    row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    used = num_rows * row_bytes
    if _LIBC is None or used == 0 or not can_stitch([o for _, o in parts], chunk_bytes):
        return None
    extra = -(-headroom // chunk_bytes) * chunk_bytes
    stitched = Stitched(chunk_bytes, len(parts) * chunk_bytes + extra)
    if not stitched.map(parts, 0, used):
        return None
    return stitched.array(dtype, row_shape, num_rows), stitched
