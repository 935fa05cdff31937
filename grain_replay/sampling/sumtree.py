"""A vectorized sum tree (with minima) over a growing prefix of nonnegative values, in numpy.

The classic array layout: node ``i`` has children ``2i`` and ``2i + 1``, the root
is node 1, the ``capacity`` (a power of two) values are nodes
``[capacity, 2 * capacity)``. A batch of ``B`` updates or prefix-sum searches
walks the ``log2(capacity)`` levels with a few numpy calls on ``B``-sized arrays
each: O(B log N) work and no Python loop per row. (A 16-ary tree has fewer
levels but gathers ``B x 16`` per level; measured slower for B = 256.)

With numba installed (the ``fast`` extra), the same walks run compiled, one row
after the other: at B = 256 the numpy walk costs ~10 numpy calls per level, each
mostly call overhead, while the compiled walk is ~20x faster. Both give the same
results (a repeated index: the last one wins in both). A prioritized batch's
stratified draw (:meth:`SumTree.find_stratified`) makes its targets, walks and
reads the drawn values in one compiled call.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["SumTree", "compiled"]

logger = logging.getLogger(__name__)


def _set_walk(
    sums: np.ndarray,
    mins: np.ndarray,
    cap: int,
    depth: int,
    index: np.ndarray,
    values: np.ndarray,
    minima: np.ndarray,
) -> None:
    for i in range(index.shape[0]):
        node = index[i] + cap
        sums[node] = values[i]
        mins[node] = minima[i]
        for _ in range(depth):
            node >>= 1
            left = node << 1
            sums[node] = sums[left] + sums[left + 1]
            a, b = mins[left], mins[left + 1]
            mins[node] = a if a < b else b


def _find_walk(sums: np.ndarray, depth: int, targets: np.ndarray, out: np.ndarray) -> None:
    # Level by level across the batch: the rows' loads at one level do not depend
    # on each other, so their cache misses overlap (row by row: ~1.3x slower at 1M).
    u = targets.copy()
    for i in range(targets.shape[0]):
        out[i] = 1
    for _ in range(depth):
        for i in range(targets.shape[0]):
            node = out[i] << 1
            left = sums[node]
            if u[i] >= left and sums[node + 1] > 0:
                u[i] -= left
                node += 1
            out[i] = node


def _stratified_walk(
    sums: np.ndarray,
    depth: int,
    cap: int,
    unit: np.ndarray,
    scale: float,
    limit: float,
    out: np.ndarray,
    found: np.ndarray,
) -> None:
    # The targets (unit[i] + i) * scale, capped at limit, made here (the same float64
    # operations as numpy's), then _find_walk's descent, then the leaves' values.
    n = unit.shape[0]
    u = np.empty(n)
    for i in range(n):
        x = (unit[i] + i) * scale
        u[i] = x if x < limit else limit
        out[i] = 1
    for _ in range(depth):
        for i in range(n):
            node = out[i] << 1
            left = sums[node]
            if u[i] >= left and sums[node + 1] > 0:
                u[i] -= left
                node += 1
            out[i] = node
    for i in range(n):
        found[i] = sums[out[i]]
        out[i] -= cap


@functools.lru_cache(maxsize=8)
def _strata(count: int) -> np.ndarray:
    strata = np.arange(count, dtype=np.float64)
    strata.flags.writeable = False
    return strata


@functools.cache
def compiled() -> tuple[Callable[..., None], Callable[..., None], Callable[..., None]] | None:
    """The numba-compiled walks (set, find, stratified find), or None without numba (or
    with GRAIN_REPLAY_NO_NUMBA=1)."""
    if os.environ.get("GRAIN_REPLAY_NO_NUMBA"):
        return None
    try:
        import numba
    except ImportError:
        logger.info("numba is not installed: the sum tree walks in numpy (pip install numba)")
        return None
    jit = numba.njit(cache=True, nogil=True)
    return jit(_set_walk), jit(_find_walk), jit(_stratified_walk)


class SumTree:
    """Sums and minima of ``values[:n]``; ``n`` grows, values change in batches.

    Args:
      skip_zeros: the minimum is over the nonzero values only (``inf`` when none is):
        a tree whose zeros are empty slots (rows evicted or not yet written).
    """

    def __init__(self, *, skip_zeros: bool = False) -> None:
        self._n = 0
        self._skip_zeros = skip_zeros
        self._walks: Any = compiled()
        self._alloc(np.zeros(0))

    @classmethod
    def from_values(cls, values: np.ndarray, *, skip_zeros: bool = False) -> SumTree:
        """A tree over ``values`` (built bottom-up in O(N))."""
        tree = cls(skip_zeros=skip_zeros)
        tree._n = len(values)
        tree._alloc(np.asarray(values, dtype=np.float64))
        return tree

    def _alloc(self, values: np.ndarray) -> None:
        cap = 1
        while cap < len(values):
            cap *= 2
        self._cap = cap
        self._depth = cap.bit_length() - 1
        self._sums = np.zeros(2 * cap)
        self._mins = np.full(2 * cap, np.inf)
        self._sums[cap : cap + len(values)] = values
        self._mins[cap : cap + len(values)] = self._minima(values)
        self._rebuild(cap, 2 * cap)

    def _minima(self, values: Any) -> Any:
        """What the minima see of ``values``: zeros as ``inf`` with ``skip_zeros``."""
        if not self._skip_zeros:
            return values
        values = np.asarray(values, dtype=np.float64)
        if values.size and values.min() > 0:
            return values
        return np.where(values > 0, values, np.inf)

    def _rebuild(self, lo: int, hi: int) -> None:
        """Recomputes the ancestors of nodes ``[lo, hi)`` (one level), level by level."""
        while lo > 1:
            lo, hi = lo // 2, (hi + 1) // 2
            kids = slice(2 * lo, 2 * hi)
            self._sums[lo:hi] = self._sums[kids][0::2] + self._sums[kids][1::2]
            self._mins[lo:hi] = np.minimum(self._mins[kids][0::2], self._mins[kids][1::2])

    def __len__(self) -> int:
        return self._n

    @property
    def total(self) -> float:
        """The sum of all values."""
        return float(self._sums[1])

    @property
    def min(self) -> float:
        """The smallest of the ``n`` values (``inf`` when empty)."""
        return float(self._mins[1])

    @property
    def values(self) -> np.ndarray:
        """A read-only view of the ``n`` values."""
        view = self._sums[self._cap : self._cap + self._n]
        view.flags.writeable = False
        return view

    def get(self, index: np.ndarray) -> np.ndarray:
        """The values at ``index``."""
        return self._sums[self._cap + np.asarray(index, dtype=np.int64)]

    def extend(self, n: int, value: float) -> None:
        """Grows to ``n`` values; the new ones are ``value``."""
        old = self._n
        if n <= old:
            return
        if n > self._cap:
            grown = np.empty(n)
            grown[:old] = self.values
            grown[old:] = value
            self._n = n
            self._alloc(grown)
            return
        self._sums[self._cap + old : self._cap + n] = value
        self._mins[self._cap + old : self._cap + n] = self._minima(value)
        self._n = n
        self._rebuild(self._cap + old, self._cap + n)

    def set(self, index: np.ndarray, values: np.ndarray) -> None:
        """Sets ``values[index]``; with duplicate indices the last one wins. O(B log N)."""
        if self._walks is not None:
            index = np.ascontiguousarray(index, dtype=np.int64)
            values = np.broadcast_to(np.asarray(values, dtype=np.float64), index.shape)
            minima = self._minima(values) if self._skip_zeros else values
            self._walks[0](self._sums, self._mins, self._cap, self._depth, index, values, minima)
            return
        node = np.asarray(index, dtype=np.int64) + self._cap
        self._sums[node] = values
        self._mins[node] = self._minima(values)
        sums, mins = self._sums, self._mins
        for _ in range(self._depth):  # duplicates write the same sums
            node >>= 1
            left = node << 1
            sums[node] = sums[left] + sums[left + 1]
            mins[node] = np.minimum(mins[left], mins[left + 1])

    def find(self, targets: np.ndarray) -> np.ndarray:
        """For each target in ``[0, total)``, the ``i`` with ``cumsum[i-1] <= t < cumsum[i]``.

        A target at or past ``total`` (float rounding) lands on the last nonzero value;
        a zero value is never returned.
        """
        u = np.minimum(np.asarray(targets, dtype=np.float64), np.nextafter(self.total, 0.0))
        if self._walks is not None:
            out = np.empty(len(u), dtype=np.int64)
            self._walks[1](self._sums, self._depth, u, out)
            return out - self._cap
        node = np.ones(len(u), dtype=np.int64)
        sums = self._sums
        for _ in range(self._depth):
            node <<= 1
            left = sums[node]
            right = u >= left
            # Rounding can leave u >= left with an empty right child: stay left then.
            right &= sums[node + 1] > 0
            u -= left * right
            node += right
        return node - self._cap

    def find_stratified(self, unit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One draw in each of ``B = len(unit)`` equal slices of the total: the ``i`` of
        :meth:`find` for the targets ``(unit + arange(B)) * total / B`` and their values.

        ``unit`` holds numbers in ``[0, 1)`` (read only). Compiled, the targets, the
        walk and the values are one call; either way the results are those of
        ``find`` and ``get`` on the same float64 targets.
        """
        count = len(unit)
        scale = self.total / count
        if self._walks is not None:
            out = np.empty(count, dtype=np.int64)
            found = np.empty(count)
            limit = float(np.nextafter(self.total, 0.0))
            self._walks[2](self._sums, self._depth, self._cap, unit, scale, limit, out, found)
            return out, found
        u = unit + _strata(count)
        u *= scale
        index = self.find(u)
        return index, self.get(index)
