"""Tests for grain_replay.pipeline.shuffle.permute: a seeded bijection evaluated on slices."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_replay.pipeline import shuffle
from grain_replay.pipeline.shuffle import epoch_order, permute

LARGE_N = [2**16, 2**16 + 1, 1_000_003, 2**21 - 1]


def _full(n: int, seed: int = 0, epoch: int = 0) -> np.ndarray:
    return permute(np.arange(n), n, seed, epoch)


def _assert_bijection(order: np.ndarray, n: int) -> None:
    assert order.shape == (n,)
    assert order.dtype == np.int64
    np.testing.assert_array_equal(np.sort(order), np.arange(n))


@pytest.mark.parametrize("seed, epoch", [(0, 0), (1, 0), (0, 7), (12345, 3)])
def test_permute_is_bijection_for_small_n(seed: int, epoch: int) -> None:
    for n in range(1, 301):
        _assert_bijection(_full(n, seed, epoch), n)


@pytest.mark.parametrize("n", LARGE_N)
def test_permute_is_bijection_for_large_n(n: int) -> None:
    _assert_bijection(_full(n, seed=3, epoch=1), n)


def test_permute_is_bijection_for_huge_seed_and_epoch() -> None:
    _assert_bijection(_full(1000, seed=2**63 + 11, epoch=2**40), 1000)


def test_permute_empty_positions_give_empty_result() -> None:
    assert permute(np.arange(0), 0, 0, 0).shape == (0,)
    assert permute(np.arange(0), 10, 0, 0).shape == (0,)
    np.testing.assert_array_equal(permute(np.arange(1), 1, 5, 5), [0])


@pytest.mark.parametrize("n", [1, 2, 17, 300, 2**16 + 1])
def test_permute_is_deterministic_across_calls(n: int) -> None:
    a = _full(n, seed=9, epoch=4)
    b = _full(n, seed=9, epoch=4)
    np.testing.assert_array_equal(a, b)


def test_permute_does_not_modify_its_input() -> None:
    pos = np.arange(50)
    permute(pos, 50, 1, 1)
    np.testing.assert_array_equal(pos, np.arange(50))


@pytest.mark.parametrize("n", [10, 100, 1000, 2**16 + 1])
def test_permute_differs_across_epochs_and_seeds(n: int) -> None:
    orders = [_full(n, seed=0, epoch=e) for e in range(8)]
    orders += [_full(n, seed=s, epoch=0) for s in range(1, 8)]
    distinct = {o.tobytes() for o in orders}
    assert len(distinct) == len(orders)
    # Not merely distinct: two permutations of n >= 100 agree in few places.
    if n >= 100:
        for a, b in [(orders[0], orders[1]), (orders[0], orders[8])]:
            assert np.mean(a == b) < 0.1


@pytest.mark.parametrize("n", [100, 1000, 2**16 + 1])
def test_permute_is_not_identity_for_large_n(n: int) -> None:
    assert np.mean(_full(n) == np.arange(n)) < 0.1


@pytest.mark.parametrize("n", [5, 64, 97, 1000, 2**16 + 1])
def test_permute_of_slice_equals_slice_of_full_permutation(n: int) -> None:
    full = _full(n, seed=4, epoch=2)
    rng = np.random.default_rng(n)
    for _ in range(20):
        start, stop = sorted(rng.integers(0, n + 1, 2))
        np.testing.assert_array_equal(permute(np.arange(start, stop), n, 4, 2), full[start:stop])


def test_permute_of_arbitrary_positions_equals_gather_of_full_permutation() -> None:
    n = 997
    full = _full(n, seed=6, epoch=1)
    pos = np.random.default_rng(0).integers(0, n, 500)  # unsorted, with duplicates
    np.testing.assert_array_equal(permute(pos, n, 6, 1), full[pos])
    np.testing.assert_array_equal(permute(pos.tolist(), n, 6, 1), full[pos])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 10**6),
    data=st.data(),
)
def test_permute_slice_property_for_random_arguments(
    n: int, seed: int, epoch: int, data: st.DataObject
) -> None:
    full = _full(n, seed, epoch)
    _assert_bijection(full, n)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    np.testing.assert_array_equal(permute(np.arange(start, stop), n, seed, epoch), full[start:stop])


def _chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("n", [2, 3, 10, 37])
def test_permute_first_position_is_roughly_uniform_over_seeds(n: int) -> None:
    trials = 100 * n
    first = np.array([permute(np.arange(1), n, seed, 0)[0] for seed in range(trials)])
    counts = np.bincount(first, minlength=n)
    assert counts.min() > 0, counts
    # Loose bound: the 1e-6 upper tail of chi-square with n - 1 degrees of freedom is
    # below 5 * (n - 1) + 30 for these n; a degenerate shuffle is far above it.
    assert _chi_square(counts) < 5 * (n - 1) + 30, counts


def test_permute_every_position_is_roughly_uniform_over_epochs() -> None:
    n, trials = 8, 1600
    counts = np.zeros((n, n), dtype=np.int64)  # counts[position, value]
    for epoch in range(trials):
        counts[np.arange(n), _full(n, seed=1, epoch=epoch)] += 1
    assert counts.min() > 0
    for row in counts:
        assert _chi_square(row) < 5 * (n - 1) + 30, counts
    assert _chi_square(counts.ravel()) < 3 * n * n + 30, counts


def test_permute_pairs_are_not_correlated_over_seeds() -> None:
    # Adjacent positions of a random permutation: P(value[1] == value[0] + 1) = 1/n.
    n, trials = 50, 2000
    hits = 0
    for seed in range(trials):
        a, b = permute(np.arange(2), n, seed, 0)
        hits += int(b == a + 1)
    assert hits < 4 * trials / n, hits


# -- the fast evaluation: the same permutation as its definition --------------------------

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _finalizer(x: int) -> int:
    """splitmix64's output function."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _splitmix(x: int) -> int:
    return _finalizer((x + _GOLDEN) & _M64)


def _definition(position: int, n: int, seed: int, epoch: int) -> int:
    """The permutation as the module docstring defines it, one Python int at a time.

    Six Feistel rounds over the next even power of two, round ``r`` keyed by
    splitmix64 of (splitmix64 of (splitmix64 of the seed, xor the epoch) + r), its
    function the splitmix64 finalizer of (half xor key); cycle-walked into [0, n).
    """
    if n <= 1:
        return position
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = bits // 2
    mask = (1 << half) - 1
    base = _splitmix(_splitmix(seed & _M64) ^ (epoch & _M64))
    keys = [_splitmix(base + r) for r in range(6)]
    x = position
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_finalizer(right ^ k) & mask)
        x = (left << half) | right
        if x < n:
            return x


@pytest.mark.parametrize(
    "n, seed, epoch",
    [(2, 0, 0), (3, 1, 2), (37, 5, 0), (300, 7, 3), (1000, 2**63 + 11, 2**40), (4097, 2, 9)],
)
def test_permute_and_epoch_order_follow_the_definition(n: int, seed: int, epoch: int) -> None:
    want = [_definition(i, n, seed, epoch) for i in range(n)]
    np.testing.assert_array_equal(permute(np.arange(n), n, seed, epoch), want)
    order = epoch_order(n, seed, epoch)
    assert order.dtype == np.int32
    np.testing.assert_array_equal(order, want)


@pytest.mark.parametrize("n", [2**20 + 3, 2**33 + 5, 2**40 + 7])
def test_permute_follows_the_definition_for_large_n(n: int) -> None:
    # 2**33 and 2**40 have halves too wide for lookup tables: the direct network runs.
    pos = np.random.default_rng(n).integers(0, n, 64)
    want = [_definition(int(p), n, 3, 4) for p in pos]
    np.testing.assert_array_equal(permute(pos, n, 3, 4), want)
    np.testing.assert_array_equal(permute(pos.reshape(8, 8), n, 3, 4), np.reshape(want, (8, 8)))


@pytest.mark.parametrize("n", [0, 1, 2, 5, 255, 256, 257, 20_000, 65_537])
def test_epoch_order_equals_permute_of_every_position(n: int) -> None:
    order = epoch_order(n, 11, 2)
    assert order.dtype == np.int32
    np.testing.assert_array_equal(order, permute(np.arange(n), n, 11, 2))


def test_epoch_order_without_the_grid_and_permute_without_tables_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 3000
    want = permute(np.arange(n), n, 8, 1)
    monkeypatch.setattr(shuffle, "_GRID_MAX", 16)  # epoch_order falls back to permute
    np.testing.assert_array_equal(epoch_order(n, 8, 1), want)
    monkeypatch.setattr(shuffle, "_TABLE_BITS", 0)  # every round computed, not looked up
    np.testing.assert_array_equal(permute(np.arange(n), n, 8, 1), want)
    np.testing.assert_array_equal(epoch_order(n, 8, 1), want)


def test_permute_in_several_blocks_equals_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 5000
    want = epoch_order(n, 4, 4)
    monkeypatch.setattr(shuffle, "_BLOCK", 64)  # rows of the grid and blocks of positions
    np.testing.assert_array_equal(epoch_order(n, 4, 4), want)
    np.testing.assert_array_equal(permute(np.arange(n), n, 4, 4), want)
