"""Tests for the vectorized sum tree (grain_replay.sampling.sumtree)."""

from __future__ import annotations

import numpy as np
import pytest

from grain_replay.sampling import sumtree
from grain_replay.sampling.sumtree import SumTree


@pytest.fixture(autouse=True, params=["numpy", "numba"])
def walks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both walks: numpy's and (when installed) numba's."""
    if request.param == "numpy":
        monkeypatch.setattr(sumtree, "compiled", lambda: None)
    elif sumtree.compiled() is None:
        pytest.skip("numba is not installed")
    return str(request.param)


def _tree(values: np.ndarray) -> SumTree:
    tree = SumTree()
    tree.extend(len(values), 0.0)
    tree.set(np.arange(len(values)), values)
    return tree


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097])
def test_find_matches_searchsorted_of_cumsum(n: int) -> None:
    rng = np.random.default_rng(n)
    values = rng.random(n) * (rng.random(n) > 0.3)  # zeros in between
    values[0] = max(values[0], 0.5)
    tree = _tree(values)
    assert tree.total == pytest.approx(values.sum())
    u = rng.random(5000) * tree.total
    want = np.searchsorted(np.cumsum(values), u, side="right")
    np.testing.assert_array_equal(tree.find(u), want)


def test_find_never_returns_a_zero_value_at_the_boundary() -> None:
    values = np.array([0.0, 1.0, 2.0, 0.0, 0.0])
    tree = _tree(values)
    got = tree.find(np.array([tree.total, tree.total * 2, np.nextafter(tree.total, 0)]))
    assert (values[got] > 0).all(), got


def test_set_updates_sums_and_minima_last_duplicate_wins() -> None:
    tree = _tree(np.ones(100))
    tree.set(np.array([5, 7, 5]), np.array([10.0, 0.25, 3.0]))
    assert tree.get(np.array([5, 7])).tolist() == [3.0, 0.25]
    assert tree.total == pytest.approx(98 + 3.0 + 0.25)
    assert tree.min == 0.25
    np.testing.assert_array_equal(tree.values[[5, 7]], [3.0, 0.25])


def test_extend_within_and_past_capacity_gives_new_rows_the_value() -> None:
    tree = SumTree()
    tree.extend(5, 1.0)
    tree.extend(8, 2.0)  # within the power-of-two capacity
    tree.extend(300, 0.5)  # past it: rebuilt
    assert len(tree) == 300
    want = np.r_[np.ones(5), np.full(3, 2.0), np.full(292, 0.5)]
    np.testing.assert_array_equal(tree.values, want)
    assert tree.total == pytest.approx(want.sum())
    assert tree.min == 0.5
    tree.extend(10, 9.0)  # never shrinks
    assert len(tree) == 300


def test_from_values_equals_incremental_build() -> None:
    values = np.random.default_rng(0).random(777)
    a, b = SumTree.from_values(values), _tree(values)
    assert a.total == pytest.approx(b.total)
    u = np.linspace(0, a.total, 1000, endpoint=False)
    np.testing.assert_array_equal(a.find(u), b.find(u))


def test_both_walks_agree() -> None:
    rng = np.random.default_rng(7)
    values = rng.random(3000)
    trees = []
    for walks in (None, sumtree.compiled()):
        tree = SumTree()
        tree._walks = walks
        tree.extend(3000, 0.0)
        tree.set(np.arange(3000), values)
        idx = rng.integers(0, 3000, 256)
        tree.set(idx, np.r_[rng.random(255), 0.0])
        trees.append(tree)
        rng = np.random.default_rng(7)
        rng.random(3000)
    a, b = trees
    np.testing.assert_array_equal(a.values, b.values)
    assert a.total == pytest.approx(b.total) and a.min == b.min
    u = np.linspace(0, a.total, 4096, endpoint=False)
    np.testing.assert_array_equal(a.find(u), b.find(u))
