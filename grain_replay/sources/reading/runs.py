"""Rows grouped by what holds them (chunk, segment, episode, file): one sort, cut into runs."""

from __future__ import annotations

import numpy as np

__all__ = ["group_runs", "runs"]


def group_runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positions of ``keys`` grouped by key.

    Args:
      keys: a 1-d integer array (e.g. the chunk, segment or episode of each row).

    Returns:
      ``(run_keys, order, bounds)``: the sorted distinct keys, the positions of
      ``keys`` sorted by key (equal keys keep their order), and ``bounds`` of
      length ``len(run_keys) + 1`` so that ``order[bounds[j]:bounds[j + 1]]``
      are the positions whose key is ``run_keys[j]``.
    """
    keys = np.asarray(keys)
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    n = len(keys)
    if n == 0:
        return ordered, order, np.zeros(1, dtype=np.intp)
    bounds = np.empty(n + 1, dtype=np.intp)
    cuts = np.flatnonzero(ordered[1:] != ordered[:-1])
    m = len(cuts)
    bounds[0] = 0
    bounds[1 : m + 1] = cuts + 1
    bounds[m + 1] = n
    bounds = bounds[: m + 2]
    return ordered[bounds[:-1]], order, bounds


def runs(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(key, positions)`` per distinct key of ``keys``, keys ascending, positions in input order.

    Examples:
      >>> runs(np.array([3, 1, 3, 1, 2]))
      [(1, array([1, 3])), (2, array([4])), (3, array([0, 2]))]
    """
    run_keys, order, bounds = group_runs(keys)
    b = bounds.tolist()
    return [(k, order[lo:hi]) for k, lo, hi in zip(run_keys.tolist(), b, b[1:])]
