"""The decoded-chunk cache: bounded by bytes whatever is put in it."""

from __future__ import annotations

import numpy as np
import pytest

from grain_replay.sources.chunked import ChunkCache


def test_bound_respected_whatever_the_puts() -> None:
    cache = ChunkCache(10_000)
    rng = np.random.default_rng(0)
    for _ in range(500):
        cache.put(("k", int(rng.integers(0, 50))), np.zeros(int(rng.integers(1, 3000)), np.uint8))
        assert cache.nbytes <= 10_000
        assert cache.nbytes == sum(b.nbytes for b in cache._data.values())


def test_block_bigger_than_bound_not_kept() -> None:
    cache = ChunkCache(100)
    cache.put(("k", 0), np.zeros(101, np.uint8))
    assert cache.get(("k", 0)) is None and cache.nbytes == 0


def test_clear_empties_and_negative_bound_refused() -> None:
    cache = ChunkCache(1000)
    cache.put(("k", 1), np.zeros(10, np.uint8))
    cache.clear()
    assert cache.nbytes == 0 and cache.get(("k", 1)) is None
    with pytest.raises(ValueError, match="cache_bytes must be >= 0"):
        ChunkCache(-1)
