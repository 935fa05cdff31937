"""Leaf readers: the rows of one leaf, and the per-process handle that holds them."""

from __future__ import annotations

import abc
import mmap
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from grain_replay.sources.reading import readahead, windows
from grain_replay.sources.reading.files import MappedFile
from grain_replay.sources.reading.windows import WindowCopier, fix_windows, window_view

_Groups = list[list[tuple[str, MappedFile]]]
# One check of a key set's files: (what answers the group's size, the most its maps need).
_SizeChecks = list[tuple[Callable[[], int], int]]
# A leaf whose rows are one plain take: (the array, the dtype that views the gathered rows
# as the leaf's or None, the read-ahead of a file mapping or None).
GatherPlan = tuple[np.ndarray, "np.dtype[Any] | None", "readahead.RowReadAhead | None"]

__all__ = [
    "ArrayReader",
    "Handle",
    "LeafReader",
    "advise_random",
    "read_windows_as_rows",
    "window_rows",
]


def window_rows(starts: np.ndarray, length: int) -> np.ndarray:
    """The rows of windows ``starts[i] .. starts[i] + length - 1``, window after window, flat."""
    return np.repeat(starts, length) + np.tile(np.arange(length, dtype=np.int64), len(starts))


def read_windows_as_rows(
    read_leaf: Callable[[str, np.ndarray], np.ndarray], key: str, starts: Any, length: int
) -> np.ndarray:
    """``read_windows`` of a source whose windows are not consecutive stored rows: each
    window's records read with ``read_leaf(key, rows)``, ``(len(starts), length, ...)``."""
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    got = read_leaf(key, window_rows(starts, int(length)))
    return got.reshape(len(starts), int(length), *got.shape[1:])


class LeafReader(abc.ABC):
    """Reads rows of one leaf. Implementations must be thread-safe."""

    # Set by readers whose warm rows are one ``array.take`` (see :meth:`Handle.take_flat`).
    plan: GatherPlan | None = None

    @abc.abstractmethod
    def take(self, indices: np.ndarray) -> np.ndarray:
        """Rows ``indices`` (int64, in range, any order, duplicates allowed), as a new array."""

    def take_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Writes rows ``indices`` into ``out`` (``len(indices)`` rows of this leaf's shape)."""
        out[...] = self.take(indices)

    def take_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``length`` consecutive rows from each of ``starts``, ``(len(starts), length, ...)``.

        ``starts`` are int64 with ``0 <= start <= rows - length``. The default
        takes the ``len(starts) * length`` rows at once.
        """
        got = self.take(window_rows(starts, length))
        return got.reshape(len(starts), length, *got.shape[1:])

    def take_windows_fixed(
        self, starts: np.ndarray, length: int, near: np.ndarray | None, at: np.ndarray | None
    ) -> np.ndarray:
        """:meth:`take_windows`, then window ``near[i]`` takes at its position ``j`` the row
        ``starts[near[i]] + at[i, j]`` (``0 <= at < length``); None: no fix-up.

        The default fixes the windows up in numpy, after the read.
        """
        got = self.take_windows(starts, length)
        fix_windows(got, near, at)
        return got

    def row(self, index: int) -> np.ndarray:
        """Row ``index`` as a new array (not a view of a file mapping)."""
        return self.take(np.array([index], dtype=np.int64))[0]


class Handle(abc.ABC):
    """An open store: one per process, shared by the threads of that process."""

    readers: dict[str, LeafReader]
    # Leaf key -> files its reader maps; checked for truncation before each read.
    mapped_files: dict[str, list[MappedFile]]
    # (the mapped_files they group, key set -> groups of files sharing one fstat)
    _check_plans: (
        tuple[dict[str, list[MappedFile]], dict[tuple[str, ...], tuple[_Groups, _SizeChecks]]]
        | None
    ) = None
    # (keys, readers, [(key, reader)]) of the last take_flat; batches counted for its timing.
    _flat_pairs: tuple[Sequence[str], dict[str, LeafReader], list[tuple[str, LeafReader]]] | None
    _flat_pairs = None
    # (keys, mapped_files, plan) of the last check_mapped: its fast path.
    _last_check: (
        tuple[Iterable[str], dict[str, list[MappedFile]], tuple[_Groups, _SizeChecks]] | None
    ) = None
    _tick = 0

    def check_mapped(self, keys: Iterable[str]) -> None:
        """Raises InvalidStoreError if a file mapped for one of ``keys`` shrank under the map.

        One ``fstat`` (or ``lseek``) per mapped file per call, however many leaves
        share it: the files of ``keys`` are grouped once per key set (the groups
        are kept while ``mapped_files`` is the same dictionary), and a batch only
        compares each group's size with the most its maps need; the error naming
        the leaf is built when one falls short. The plan of the last key set
        (the same object, as a source passes its own list) is found with two
        identity checks, and each size is asked with a builtin call.
        """
        mapped = getattr(self, "mapped_files", None)
        if not mapped:
            return
        last = self._last_check
        if last is not None and last[0] is keys and last[1] is mapped:
            plan = last[2]
        else:
            plan = self._check_plan(mapped, keys)
        for size, needed in plan[1]:
            if size() < needed:
                break
        else:
            return
        for group in plan[0]:
            now = group[0][1].size()
            for key, file in group:
                file.check_size(key, now)

    def _check_plan(
        self, mapped: dict[str, list[MappedFile]], keys: Iterable[str]
    ) -> tuple[_Groups, _SizeChecks]:
        """The file groups of ``keys`` and each group's (size, most needed), kept per key set."""
        names = keys if isinstance(keys, tuple) else tuple(keys)
        plans = self._check_plans
        if plans is None or plans[0] is not mapped:
            plans = (mapped, {})
            self._check_plans = plans
        plan = plans[1].get(names)
        if plan is None:
            groups = _group_files(mapped, names)
            checks = [(g[0][1].size_call(), max(f.needed for _, f in g)) for g in groups]
            plan = (groups, checks)
            if len(plans[1]) < 64:  # a few key sets per source; a stream of new ones is not kept
                plans[1][names] = plan
        self._last_check = (keys, mapped, plan)  # one tuple: a racing thread sees old or new
        return plan

    def take_flat(
        self, keys: Sequence[str], indices: np.ndarray, *, wrap_at: int | None = None
    ) -> dict[str, np.ndarray]:
        """Rows ``indices`` of every leaf of ``keys``: ``{key: rows}`` in the order of ``keys``.

        Leaves with a :attr:`LeafReader.plan` whose rows are warm (or in memory)
        are one ``take`` each, straight from the array, with no per-leaf call;
        one gather in ``TIME_EVERY`` is timed per handle, to notice evicted rows
        as the readers do. Other leaves (cold rows, chunked readers) go through
        their reader's ``take``.

        Args:
          keys: the leaves, a list kept by the caller (the pairing of keys and
            readers is cached while it is the same object).
          indices: int64 rows; with ``wrap_at``, the rows of a ring of ``wrap_at``
            rows (every leaf's length), negative ones counted from its end, as
            Python counts them (a torchrl buffer's oldest-first order: records
            minus the rows from the oldest to the end). The plain takes resolve
            them; numpy's ``mode="wrap"`` would branch on every row (measured
            slower on random rows that miss the cache).
        """
        pairs = self._flat_pairs
        if pairs is None or pairs[0] is not keys or pairs[1] is not self.readers:
            readers = self.readers
            pairs = self._flat_pairs = (keys, readers, [(k, readers[k]) for k in keys])
        self._tick = tick = self._tick + 1
        timed = tick % TIME_EVERY == 0
        in_range: np.ndarray | None = None
        out = {}
        for key, reader in pairs[2]:
            plan = reader.plan
            if plan is not None:
                array, view, ahead = plan
                if ahead is None or not (ahead.cold or timed):
                    got = array.take(indices, axis=0)
                    out[key] = got if view is None else got.view(view)
                    continue
                if not ahead.cold:
                    t0 = time.perf_counter()
                    got = array.take(indices, axis=0)
                    ahead.finish(len(indices), time.perf_counter() - t0)
                    out[key] = got if view is None else got.view(view)
                    continue
            if in_range is None:
                in_range = indices if wrap_at is None else np.remainder(indices, max(wrap_at, 1))
            out[key] = reader.take(in_range)
        return out

    def close_mapped(self) -> None:
        """Lets go of the descriptors kept for :meth:`check_mapped` (the maps stay valid).

        Each closes once nothing holds it any more (a check running in another
        thread finishes on its own descriptor first).
        """
        self.mapped_files = {}
        self._check_plans = None
        self._last_check = None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases OS resources; the default holds none."""

    def grow(self, source: Any, layout: Any) -> bool:
        """Extends this open handle in place to ``layout`` of ``source`` (the same
        leaves, more rows; a ``sources.base.Layout``).

        False (the default, and whenever the store cannot grow in place): the
        source closes the handle and its next read reopens the store.
        """
        return False


def _group_files(mapped: dict[str, list[MappedFile]], keys: tuple[str, ...]) -> _Groups:
    """The files of ``keys``, grouped by what answers their size (one fstat a group)."""
    groups: dict[int, list[tuple[str, MappedFile]]] = {}
    for key in keys:
        for file in mapped.get(key, ()):
            groups.setdefault(file.resource(), []).append((key, file))
    return list(groups.values())


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


# Warm gathers are timed one in this many (to notice rows evicted from the page cache):
# timing each costs two clock reads and a call, per leaf and batch (~0.6 us of a ~1.5 us
# gather of 256 small rows).
TIME_EVERY = 8


class ArrayReader(LeafReader):
    """Rows of an in-process array, typically a read-only memory map of the file."""

    _tick = 0

    def __init__(self, array: np.ndarray, *, mapping: object = None):
        # What maps the rows, when they can grow in place (a stitch.Stitched).
        self.mapping = mapping
        advise_random(array)
        # A plain ndarray view: results of indexing are ndarrays, not np.memmap.
        self._array = array.view(np.ndarray)
        # Reads rows of a file mapping ahead while they are not page-cached.
        self._ahead = readahead.for_array(array)
        self.plan = (self._array, None, self._ahead)
        # Window length -> (the array it views, its windows as one item each or None, and
        # the dtype that views a gathered item as the window's rows).
        self._windows: dict[int, tuple[np.ndarray, np.ndarray | None, np.dtype[Any]]] = {}
        # (the array, its compiled window copier or None where numpy copies): None until used.
        self._copier: tuple[np.ndarray, WindowCopier | None] | None = None

    def _untimed(self, ahead: readahead.RowReadAhead | None, indices: np.ndarray) -> bool:
        """Whether this gather goes untimed: no read-ahead, cold rows just read ahead, or a
        warm gather between two timed ones (a race on the tick only shifts which)."""
        if ahead is None:
            return True
        if ahead.cold:
            return not ahead.start(indices)
        self._tick = tick = self._tick + 1
        return tick % TIME_EVERY != 0

    def take(self, indices: np.ndarray) -> np.ndarray:
        ahead = self._ahead
        # take along axis 0 is about 2x faster than fancy indexing for rows of
        # many bytes; the method skips np.take's wrapper (~0.6 us a call).
        if self._untimed(ahead, indices):
            return self._array.take(indices, axis=0)
        assert ahead is not None
        t0 = time.perf_counter()
        out = self._array.take(indices, axis=0)
        ahead.finish(len(indices), time.perf_counter() - t0)
        return out

    def take_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Each window copied whole: one fancy index over a view whose items are windows.

        On a C-contiguous array, ``length`` rows from a start are one block of
        bytes, so the view ``(rows - length + 1,)`` of ``length * row_bytes``-byte
        items, one row apart, gathers each window as one copy (256 windows of
        16 rows of 56 B: about 0.6x the time of taking the 4,096 rows). While
        the rows are not page-cached, the rows are taken (and read ahead) instead.
        """
        ahead = self._ahead
        if ahead is not None and ahead.cold:
            return super().take_windows(starts, length)
        array = self._array
        cached = self._windows.get(length)
        if cached is None or cached[0] is not array:
            rows = np.dtype((array.dtype, (length, *array.shape[1:])))
            cached = (array, window_view(array, length), rows)
            self._windows[length] = cached  # a race only recomputes it
        view = cached[1]
        if view is None:
            return super().take_windows(starts, length)
        if ahead is None:
            got = view[starts]
        else:
            t0 = time.perf_counter()
            got = view[starts]
            ahead.finish(len(starts) * length, time.perf_counter() - t0)
        # (B,) items of a subarray dtype: a (B, length, ...) array of the leaf's dtype.
        return got.view(cached[2])

    def take_windows_fixed(
        self, starts: np.ndarray, length: int, near: np.ndarray | None, at: np.ndarray | None
    ) -> np.ndarray:
        """The windows and their fix-up in one compiled copy (``windows.windows_fixed``),
        while the rows are page-cached and numba is there; else as :meth:`take_windows`
        and the fix-up in numpy."""
        ahead = self._ahead
        if ahead is not None and ahead.cold:
            return super().take_windows_fixed(starts, length, near, at)
        array = self._array
        cached = self._copier
        if cached is None or cached[0] is not array:
            if windows.loaded() is None:  # no numba, or it is still loading: numpy meanwhile
                return super().take_windows_fixed(starts, length, near, at)
            cached = self._copier = (array, windows.copier(array))  # a race only recomputes it
        copy = cached[1]
        if copy is None or len(array) < length:
            return super().take_windows_fixed(starts, length, near, at)
        if ahead is None:
            return copy(starts, length, near, at)
        t0 = time.perf_counter()
        got = copy(starts, length, near, at)
        ahead.finish(len(starts) * length, time.perf_counter() - t0)
        return got

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
        self.plan = (self._array, None, ahead)

    def take_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        if out.dtype != self._array.dtype:  # another byte order: numpy converts on copy
            out[...] = self.take(indices)
            return
        # The indices are checked: mode="clip" lets np.take write straight into
        # ``out`` (mode="raise" with out= gathers into a buffer first).
        ahead = self._ahead
        if self._untimed(ahead, indices):
            self._array.take(indices, axis=0, out=out, mode="clip")
            return
        assert ahead is not None
        t0 = time.perf_counter()
        self._array.take(indices, axis=0, out=out, mode="clip")
        ahead.finish(len(indices), time.perf_counter() - t0)

    def row(self, index: int) -> np.ndarray:
        if self._ahead is not None and self._ahead.cold:
            self._ahead.read_ahead(np.array([index], dtype=np.int64))
        r = self._array[index]
        return r.copy() if isinstance(r, np.ndarray) else r
