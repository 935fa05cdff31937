"""Cold reads from memory maps: notice rows that are not in the page cache and read them ahead.

A random gather from a memory map that is not in the page cache faults one
page at a time, each fault a synchronous disk read (``MADV_RANDOM`` keeps each
fault to one page; without it every fault reads a large window around it).
Asking the kernel for every row of the batch first (``madvise(MADV_WILLNEED)``
per run of pages) puts all of the batch's reads in flight at once; the gather
then waits for them instead of issuing them one by one.

Measured on a virtio disk, page cache dropped, 256 random rows (median of 5):

============================  ============  =================  ==================
rows                          gather alone  pread, sorted      read-ahead + gather
============================  ============  =================  ==================
uint8[84,84,4] (28 KiB)       250-300 ms    45-115 ms          17-21 ms
float32[64] (256 B)           45-60 ms      35-45 ms           6-9 ms
============================  ============  =================  ==================

Sixteen threads each issuing ``os.preadv`` per row come out the same as
read-ahead (19-20 ms and 7 ms) but need file descriptors, offsets and a pool per
process, so read-ahead is used for every row size. It costs a system call per
row, too much for page-cached reads (a cached gather of 256 small rows takes
tens of microseconds), so a reader only reads ahead while it sees cold rows:

- *warm*: plain gather, timed. A gather slower than ``WARM_SLACK_S`` plus, per
  row, ``WARM_ROW_S`` and the row's bytes at ``WARM_BYTES_PER_S`` did not come
  from the page cache: switch to *cold*. (A cached gather is 5-50 times faster
  than that bound; an uncached one hundreds of times slower.)
- *cold* (also the state after opening): ``mincore`` on ``SAMPLE_ROWS`` rows of
  the batch. All resident: switch to *warm* and gather. Else read ahead, gather.

A wrong guess only costs time, never changes what is read.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np

from grain_replay.store.formats import PAGE

__all__ = ["RowReadAhead", "available", "for_array", "is_file_mapping"]

_MADV_WILLNEED = 3

# A gather slower than this bound did not come from the page cache (see module doc).
WARM_SLACK_S = 1e-3
WARM_ROW_S = 2e-6
WARM_BYTES_PER_S = 1e9
# Rows of a batch whose pages mincore checks while cold.
SAMPLE_ROWS = 8


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


def available() -> bool:
    """True where read-ahead works (Linux with ``madvise`` and ``mincore``)."""
    return _LIBC is not None


def is_file_mapping(array: np.ndarray) -> bool:
    """True if ``array``'s memory is a file mapping (``np.memmap``, or a stitched mapping)."""
    obj: object = array
    for _ in range(64):  # views of views: the chain ends at the buffer's owner
        if isinstance(obj, mmap.mmap) or getattr(obj, "file_mapping", False):
            return True
        base = getattr(obj, "base", None)
        if base is None:
            return False
        obj = base
    return False


def for_array(array: np.ndarray) -> RowReadAhead | None:
    """Read-ahead for a file-mapped array with contiguous rows, else None (no need or no way)."""
    if (
        _LIBC is None
        or array.ndim == 0
        or array.size == 0
        or not array.flags.c_contiguous
        or not is_file_mapping(array)
    ):
        return None
    return RowReadAhead(array)


class RowReadAhead:
    """Warm/cold state and read-ahead of one memory-mapped, C-ordered row array.

    Thread-safe: the state is a hint that concurrent batches may flip; a stale
    value costs a slower batch, never a wrong row.

    Args:
      array: the ``(N, ...)`` array over a file mapping, rows contiguous.
    """

    def __init__(self, array: np.ndarray):
        self._base = int(array.ctypes.data)
        self._stride = int(array.strides[0])
        self._row_bytes = int(array.itemsize * np.prod(array.shape[1:], dtype=np.int64))
        self._row_s = WARM_ROW_S + self._row_bytes / WARM_BYTES_PER_S
        self.cold = True  # unknown after opening: the first batch checks

    def same_rows(self, array: np.ndarray) -> bool:
        """Whether ``array``'s rows lie where this read-ahead's do (a grown map)."""
        return (
            int(array.ctypes.data) == self._base
            and int(array.strides[0]) == self._stride
            and int(array.itemsize * np.prod(array.shape[1:], dtype=np.int64)) == self._row_bytes
        )

    def start(self, indices: np.ndarray) -> bool:
        """Reads rows ``indices`` ahead if they look cold; True if the gather is to be timed."""
        if not self.cold:
            return True
        if self.resident(indices):
            self.cold = False
            return True
        self.read_ahead(indices)
        return False

    def finish(self, count: int, seconds: float) -> None:
        """Records that a timed gather of ``count`` rows took ``seconds``."""
        if seconds > WARM_SLACK_S + count * self._row_s:
            self.cold = True

    def _pages(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Page-aligned ``(start, end)`` addresses of ``rows``."""
        first = self._base + rows * self._stride
        lo = first & ~(PAGE - 1)
        hi = (first + self._row_bytes + PAGE - 1) & ~(PAGE - 1)
        return lo, hi

    def resident(self, indices: np.ndarray) -> bool:
        """True if every page of up to ``SAMPLE_ROWS`` rows spread over ``indices`` is cached."""
        if _LIBC is None or not len(indices):
            return True
        step = max(1, len(indices) // SAMPLE_ROWS)
        lo, hi = self._pages(np.asarray(indices[::step][:SAMPLE_ROWS], dtype=np.int64))
        pages = int((hi - lo).max()) // PAGE
        vec = (ctypes.c_ubyte * pages)()
        for a, b in zip(lo.tolist(), hi.tolist()):
            if _LIBC.mincore(a, b - a, vec) != 0:
                return True  # cannot tell: keep the plain gather
            if not all(v & 1 for v in vec[: (b - a) // PAGE]):
                return False
        return True

    def read_ahead(self, indices: np.ndarray) -> None:
        """Asks the kernel to read the pages of rows ``indices``, adjacent ones as one range."""
        if _LIBC is None or not len(indices):
            return
        lo, hi = self._pages(np.unique(indices))
        # Rows are sorted and equally long, so ``hi`` grows: a run starts where
        # a row's pages begin after the previous row's end.
        starts = np.flatnonzero(np.r_[True, lo[1:] > hi[:-1]])
        ends = np.r_[starts[1:], len(lo)] - 1
        for a, b in zip(lo[starts].tolist(), hi[ends].tolist()):
            _LIBC.madvise(a, b - a, _MADV_WILLNEED)  # failure: the gather faults instead
