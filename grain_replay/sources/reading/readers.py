"""Leaf readers: the rows of one leaf, and the per-process handle that holds them."""

from __future__ import annotations

import abc
import mmap
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from grain_replay.sources.reading import readahead
from grain_replay.sources.reading.files import MappedFile

__all__ = ["ArrayReader", "Handle", "LeafReader", "advise_random"]


class LeafReader(abc.ABC):
    """Reads rows of one leaf. Implementations must be thread-safe."""

    @abc.abstractmethod
    def take(self, indices: np.ndarray) -> np.ndarray:
        """Rows ``indices`` (int64, in range, any order, duplicates allowed), as a new array."""

    def take_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Writes rows ``indices`` into ``out`` (``len(indices)`` rows of this leaf's shape)."""
        out[...] = self.take(indices)

    def row(self, index: int) -> np.ndarray:
        """Row ``index`` as a new array (not a view of a file mapping)."""
        return self.take(np.array([index], dtype=np.int64))[0]


class Handle(abc.ABC):
    """An open store: one per process, shared by the threads of that process."""

    readers: dict[str, LeafReader]
    # Leaf key -> files its reader maps; checked for truncation before each read.
    mapped_files: dict[str, list[MappedFile]]

    def check_mapped(self, keys: Iterable[str]) -> None:
        """Raises InvalidStoreError if a file mapped for one of ``keys`` shrank under the map."""
        mapped = getattr(self, "mapped_files", None)
        if mapped:
            for key in keys:
                for file in mapped.get(key, ()):
                    file.check(key)

    def close_mapped(self) -> None:
        """Lets go of the descriptors kept for :meth:`check_mapped` (the maps stay valid).

        Each closes once nothing holds it any more (a check running in another
        thread finishes on its own descriptor first).
        """
        self.mapped_files = {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases OS resources; the default holds none."""

    def grow(self, source: Any, layout: Any) -> bool:
        """Extends this open handle in place to ``layout`` of ``source`` (the same
        leaves, more rows; a ``sources.base.Layout``).

        False (the default, and whenever the store cannot grow in place): the
        source closes the handle and its next read reopens the store.
        """
        return False


def advise_random(array: np.ndarray) -> None:
    """Tells the kernel a memory map is read at random: no read-ahead on page faults.

    With the default read-ahead, each cold page fault of a random gather reads
    megabytes around it (measured: 1.5 s for a cold batch of images, 0.15 s
    with this advice).
    """
    mapping = getattr(array, "_mmap", None)
    if mapping is not None and hasattr(mmap, "MADV_RANDOM"):
        try:
            mapping.madvise(mmap.MADV_RANDOM)
        except (OSError, ValueError):
            pass


class ArrayReader(LeafReader):
    """Rows of an in-process array, typically a read-only memory map of the file."""

    def __init__(self, array: np.ndarray, *, mapping: object = None):
        # What maps the rows, when they can grow in place (a stitch.Stitched).
        self.mapping = mapping
        advise_random(array)
        # A plain ndarray view: results of indexing are ndarrays, not np.memmap.
        self._array = array.view(np.ndarray)
        # Reads rows of a file mapping ahead while they are not page-cached.
        self._ahead = readahead.for_array(array)

    def take(self, indices: np.ndarray) -> np.ndarray:
        ahead = self._ahead
        # take along axis 0 is about 2x faster than fancy indexing for rows of
        # many bytes; the method skips np.take's wrapper (~0.6 us a call).
        if ahead is None or (ahead.cold and not ahead.start(indices)):
            return self._array.take(indices, axis=0)
        t0 = time.perf_counter()
        out = self._array.take(indices, axis=0)
        ahead.finish(len(indices), time.perf_counter() - t0)
        return out

    def grow(self, array: np.ndarray) -> None:
        """Reads ``array`` from now on: the same rows and more, over the same memory.

        The read-ahead state (warm or cold) carries over when the rows start at
        the same address; a concurrent ``take`` reads the old or the new array,
        both valid.
        """
        ahead = self._ahead
        if ahead is None or not ahead.same_rows(array):
            ahead = readahead.for_array(array)
        self._array = array.view(np.ndarray)
        self._ahead = ahead

    def take_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        if out.dtype != self._array.dtype:  # another byte order: numpy converts on copy
            out[...] = self.take(indices)
            return
        # The indices are checked: mode="clip" lets np.take write straight into
        # ``out`` (mode="raise" with out= gathers into a buffer first).
        ahead = self._ahead
        if ahead is None or (ahead.cold and not ahead.start(indices)):
            self._array.take(indices, axis=0, out=out, mode="clip")
            return
        t0 = time.perf_counter()
        self._array.take(indices, axis=0, out=out, mode="clip")
        ahead.finish(len(indices), time.perf_counter() - t0)

    def row(self, index: int) -> np.ndarray:
        if self._ahead is not None and self._ahead.cold:
            self._ahead.read_ahead(np.array([index], dtype=np.int64))
        r = self._array[index]
        return r.copy() if isinstance(r, np.ndarray) else r
