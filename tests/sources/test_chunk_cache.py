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


def test_default_bound_grows_to_fit_the_store_up_to_the_cap() -> None:
    from grain_replay.sources.chunked import DEFAULT_CACHE_BYTES, fit_cap_bytes

    cache = ChunkCache(DEFAULT_CACHE_BYTES)
    cache.register("obs", 300 * 2**20)
    cache.register("next_obs", 100 * 2**20)
    fits = 400 * 2**20 <= fit_cap_bytes()
    assert cache.max_bytes == (400 * 2**20 if fits else int(DEFAULT_CACHE_BYTES))
    cache.register("pixels", 64 * 2**30)  # the store no longer fits: back to the default
    assert cache.max_bytes == int(DEFAULT_CACHE_BYTES)
    assert fit_cap_bytes() <= 2**30


def test_explicit_bound_never_grows() -> None:
    cache = ChunkCache(128 * 2**20)  # equal to the default, but given by the user
    cache.register("obs", 300 * 2**20)
    assert cache.max_bytes == 128 * 2**20


def test_default_survives_pickling_as_fit_the_store() -> None:
    import pickle

    from grain_replay.sources.chunked import DEFAULT_CACHE_BYTES

    again = pickle.loads(pickle.dumps(DEFAULT_CACHE_BYTES))
    assert again == DEFAULT_CACHE_BYTES and type(again) is type(DEFAULT_CACHE_BYTES)
