"""Tests for the prioritized batch's one-call draw: SumTree.find_stratified and Draws.units."""

from __future__ import annotations

import numpy as np
import pytest

from grain_replay.sampling import sumtree
from grain_replay.sampling.draws import BLOCK, Draws, uniforms
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


@pytest.mark.parametrize("count", [1, 3, 256])
def test_find_stratified_is_find_and_get_of_its_targets(count: int) -> None:
    rng = np.random.default_rng(count)
    values = rng.random(5000) * (rng.random(5000) > 0.5)  # zeros: never drawn
    values[-1] = 0.0
    tree = _tree(values)
    for unit in (rng.random(count), np.zeros(count), np.full(count, np.nextafter(1.0, 0.0))):
        unit.flags.writeable = False  # Draws hands out read-only blocks
        index, found = tree.find_stratified(unit)
        targets = (unit + np.arange(count)) * (tree.total / count)
        np.testing.assert_array_equal(index, tree.find(targets))
        np.testing.assert_array_equal(found, tree.get(index))
        assert (found > 0).all()
        assert (np.diff(index) >= 0).all()  # one draw per slice, in order


def test_find_stratified_past_the_total_lands_on_the_last_nonzero_value() -> None:
    tree = _tree(np.array([0.0, 1.0, 2.0, 0.0, 0.0]))
    index, found = tree.find_stratified(np.full(2, np.nextafter(1.0, 0.0)))
    assert index.tolist() == [2, 2] and found.tolist() == [2.0, 2.0]


def test_find_stratified_equals_the_numpy_walk(walks: str) -> None:
    values = np.random.default_rng(3).random(3000) ** 4
    unit = np.random.default_rng(4).random(256)
    tree = SumTree.from_values(values)  # this run's walks
    assert (tree._walks is None) == (walks == "numpy")
    want = SumTree.from_values(values)
    want._walks = None
    index, found = tree.find_stratified(unit)
    np.testing.assert_array_equal(index, want.find((unit + np.arange(256)) * (want.total / 256)))
    np.testing.assert_array_equal(found, want.get(index))


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_draws_units_are_the_uniforms_read_only_in_any_order(seed: int) -> None:
    draws = Draws(seed, 1, 256)
    for step in [0, 1, BLOCK - 1, BLOCK, 5, 3 * BLOCK + 2, 2**40 + 1, 0]:
        got = draws.units(step)
        np.testing.assert_array_equal(got, uniforms(seed, 1, step, 256))
        assert not got.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            got[0] = 0.5
