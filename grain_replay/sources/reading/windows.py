"""Windows of consecutive rows with their fix-ups, copied by one compiled loop.

A batch of sequences reads, per anchor, a window of ``k`` consecutive rows
from ``start``; the few anchors whose offsets reach past their episode then
take, at each position ``j`` of their window, the row ``start + at[i, j]``
instead (``at`` holds the clipped steps, inside the window). In numpy that is
a gather of the windows (one copy per window, see ``ArrayReader``) and a
fancy-indexed fix-up (``values[near] = values[near[:, None], at]``), whose
index preparation costs about as much as the copy itself at B = 256.

With numba installed (the ``fast`` extra), :func:`windows_fixed` does both in
one compiled pass over the rows, in words of 8, 4, 2 or 1 bytes; without
numba (or with ``GRAIN_REPLAY_NO_NUMBA=1``) it runs the numpy route. Both give
the same results.

Importing numba and loading the compiled copy from its cache takes a second or
more (several on a loaded machine): a reader does not wait for it. Its first
window read starts loading the copy in a daemon thread (:func:`loaded`), once
per process, and reads in numpy until it is there, so a loader worker's first
batches are not held up.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.sources.reading.kernel_load import BackgroundLoad

__all__ = [
    "WindowCopier",
    "compiled",
    "copier",
    "loaded",
    "fix_windows",
    "windows_fixed",
    "window_view",
    "windows_fixed_numpy",
]

logger = logging.getLogger(__name__)


def _copy_windows(
    src: np.ndarray,
    width: int,
    starts: np.ndarray,
    k: int,
    near: np.ndarray,
    at: np.ndarray,
    out: np.ndarray,
) -> None:
    # src: the leaf's rows as flat words, ``width`` words a row; out: (B * k * width,).
    # Unsigned indices: no wrap-around test per word, so the inner loops vectorize.
    w = np.uint64(width)
    span = np.uint64(k) * w
    # First one load at each window's ends: independent loads, whose cache (and TLB)
    # misses overlap, where the copy below would meet them one window after the other.
    touched = np.uint64(0)
    last = span - np.uint64(1)
    for b in range(starts.shape[0]):
        s = np.uint64(starts[b]) * w
        touched ^= src[s] ^ src[s + last]
    for b in range(starts.shape[0]):
        s = np.uint64(starts[b]) * w
        o = np.uint64(b) * span
        for x in range(span):
            out[o + x] = src[s + x]  # type: ignore[index, unused-ignore]  # uint64 under numba
    for i in range(near.shape[0]):
        b = near[i]
        for j in range(k):
            s = np.uint64(starts[b] + at[i, j]) * w
            o = (np.uint64(b) * np.uint64(k) + np.uint64(j)) * w
            for x in range(w):
                out[o + x] = src[s + x]  # type: ignore[index, unused-ignore]  # uint64 under numba
    if touched == np.uint64(0x5EED5EED5EED5EED) and out.shape[0] == 0:
        out[0] = touched  # never runs: keeps the loads above from being optimized away


@functools.cache
def compiled() -> Callable[..., None] | None:
    """The numba-compiled copy, or None without numba (or with GRAIN_REPLAY_NO_NUMBA=1)."""
    if os.environ.get("GRAIN_REPLAY_NO_NUMBA"):
        return None
    try:
        import numba
    except ImportError:
        logger.info("numba is not installed: windows are copied in numpy (pip install numba)")
        return None
    return numba.njit(cache=True, nogil=True)(_copy_windows)


_NO_NEAR = np.zeros(0, np.int64)
_NO_AT = np.zeros((0, 1), np.intp)
_ONE = np.zeros(1, np.int64)


def _warm(kernel: Callable[..., None]) -> None:
    for word in (np.uint64, np.uint32):
        src = np.zeros(4, word)
        for writeable in (False, True):
            src.flags.writeable = writeable
            kernel(src, 1, _ONE, 2, _NO_NEAR, _NO_AT, np.zeros(4, word))


_LOADER = BackgroundLoad(compiled, _warm, "the compiled window copy")


def loaded(wait: bool = False) -> Callable[..., None] | None:
    """:func:`compiled` once this process has loaded it, else None (the numpy route).

    The first call starts loading it in a daemon thread (importing numba, loading
    the copy from numba's cache and dispatching it once on the usual argument
    types); ``wait=True`` loads it here instead.
    """
    return _LOADER.loaded(wait)


def fix_windows(values: np.ndarray, near: np.ndarray | None, at: np.ndarray | None) -> None:
    """Applies the fix-up in place: ``values[near[i], j] = values[near[i], at[i, j]]``."""
    if near is not None and at is not None and near.size:
        values[near] = values[near[:, None], at]


def window_view(array: np.ndarray, length: int) -> np.ndarray | None:
    """``array``'s windows of ``length`` rows as items of one 1-d view; None if it has none."""
    n = array.shape[0] if array.ndim else 0
    row_bytes = array.strides[0] if array.ndim else 0
    if (
        not array.flags.c_contiguous
        or array.dtype.hasobject
        or length < 1
        or n < length
        or row_bytes <= 0
        or row_bytes != array.itemsize * (array.size // max(n, 1))
    ):
        return None
    item = np.dtype((np.void, row_bytes * length))
    return np.ndarray((n - length + 1,), dtype=item, buffer=array, strides=(row_bytes,))


def windows_fixed_numpy(
    array: np.ndarray,
    starts: np.ndarray,
    k: int,
    near: np.ndarray | None = None,
    at: np.ndarray | None = None,
    view: np.ndarray | None = None,
) -> np.ndarray:
    """:func:`windows_fixed` in numpy: the windows gathered whole (through ``view``, the
    array's windows of ``k`` rows as items, when given and possible), then fixed up."""
    if view is None:
        view = window_view(array, k)
    if view is None:
        rows = np.repeat(starts, k) + np.tile(np.arange(k, dtype=np.int64), len(starts))
        got = array.take(rows, axis=0).reshape(len(starts), k, *array.shape[1:])
    else:
        got = view[starts].view(np.dtype((array.dtype, (k, *array.shape[1:]))))
    fix_windows(got, near, at)
    return got


def _word(address: int, row_bytes: int) -> np.dtype[Any]:
    """The widest unsigned word that divides a row and the array's address."""
    for size in (8, 4, 2):
        if row_bytes % size == 0 and address % size == 0:
            return np.dtype(f"u{size}")
    return np.dtype(np.uint8)


class WindowCopier:
    """One leaf's rows, prepared for compiled window copies (see :func:`windows_fixed`).

    ``copier(starts, k, near, at)`` is ``windows_fixed(array, starts, k, near, at)``
    without the per-call preparation (a reader keeps one per array). Needs numba
    and a C-contiguous array of at least one row of plain data: :func:`copier` says.
    """

    def __init__(self, array: np.ndarray, copy: Callable[..., None]):
        self.array = array
        self._copy = copy
        n = array.shape[0]
        row_bytes = array.itemsize * (array.size // n)
        word = _word(array.__array_interface__["data"][0], row_bytes)
        self._word = word
        self._width = row_bytes // word.itemsize
        self._words = array.reshape(-1).view(word)
        self._row_shape = array.shape[1:]

    def __call__(
        self,
        starts: np.ndarray,
        k: int,
        near: np.ndarray | None = None,
        at: np.ndarray | None = None,
    ) -> np.ndarray:
        out = np.empty((len(starts), k, *self._row_shape), self.array.dtype)
        if near is None or at is None or not near.size:
            near, at = _NO_NEAR, _NO_AT
        self._copy(self._words, self._width, starts, k, near, at, out.reshape(-1).view(self._word))
        return out


def copier(array: np.ndarray, wait: bool = False) -> WindowCopier | None:
    """A :class:`WindowCopier` of ``array``, or None where only numpy copies it (no numba,
    not C-contiguous, objects, no rows) or, unless ``wait``, the compiled copy is still
    loading (see :func:`loaded`)."""
    copy = loaded(wait)
    if (
        copy is None
        or array.ndim == 0
        or array.size == 0
        or not array.flags.c_contiguous
        or array.dtype.hasobject
    ):
        return None
    return WindowCopier(array, copy)


def windows_fixed(
    array: np.ndarray,
    starts: np.ndarray,
    k: int,
    near: np.ndarray | None = None,
    at: np.ndarray | None = None,
) -> np.ndarray:
    """``k`` consecutive rows of ``array`` from each of ``starts``, fixed up at ``near``.

    Args:
      array: the leaf's rows (a memory map or an in-memory array).
      starts: int64, ``0 <= start <= len(array) - k`` (not checked).
      k: rows per window, at least 1.
      near: positions in ``starts`` (int64) whose windows are fixed up, or None.
      at: ``(len(near), k)`` intp, the row of the window each position of those
        takes (``0 <= at < k``; not checked), or None.

    Returns:
      A new ``(len(starts), k, *array.shape[1:])`` array of ``array.dtype``:
      window ``b`` holds ``array[starts[b] + j]`` at ``j``, except that window
      ``near[i]`` holds ``array[starts[near[i]] + at[i, j]]``.
    """
    copy = copier(array, wait=True) if array.ndim and array.shape[0] >= k else None
    if copy is None:
        return windows_fixed_numpy(array, starts, k, near, at)
    return copy(np.asarray(starts, np.int64), k, near, at)
