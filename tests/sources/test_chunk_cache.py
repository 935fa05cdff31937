"""The decoded-chunk cache: bounded by bytes whatever is put in it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from grain_replay.sources.reading.cache import ChunkCache


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
    from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES, fit_cap_bytes

    cache = ChunkCache(DEFAULT_CACHE_BYTES)
    cache.register("obs", 300 * 2**20)
    cache.register("next_obs", 100 * 2**20)
    fits = 400 * 2**20 <= fit_cap_bytes()
    assert cache.max_bytes == (400 * 2**20 if fits else int(DEFAULT_CACHE_BYTES))
    cache.register("pixels", 64 * 2**30)  # the store no longer fits: back to the default
    assert cache.max_bytes == int(DEFAULT_CACHE_BYTES)
    assert fit_cap_bytes() <= 2**30


def test_cache_budget_is_split_between_workers_and_reads_cgroup_v1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from grain_replay.sources.reading import cache as chunked

    monkeypatch.setattr(chunked.os, "sysconf", lambda name: 2**20)  # 1 TiB of 1 MiB pages
    v1 = tmp_path / "memory.limit_in_bytes"
    v1.write_text("8589934592\n")  # 8 GiB: 256 MiB is 1/32
    monkeypatch.setattr(chunked, "_MEMORY_LIMITS", (str(tmp_path / "absent"), str(v1)))
    assert chunked.fit_cap_bytes() == 256 * 2**20
    v1.write_text("9223372036854771712\n")  # v1's "no limit": physical memory counts
    assert chunked.fit_cap_bytes() == 2**30
    v1.write_text("68719476736\n")  # 64 GiB: 1 GiB is the cap
    try:
        chunked.share_cache_budget(4)
        assert chunked.fit_cap_bytes() == 2**30 // 4
        chunked.share_cache_budget(16)  # never below the 128 MiB default
        assert chunked.fit_cap_bytes() == int(chunked.DEFAULT_CACHE_BYTES)
    finally:
        chunked.share_cache_budget(1)
    assert chunked.fit_cap_bytes() == 2**30


def test_explicit_bound_never_grows() -> None:
    cache = ChunkCache(128 * 2**20)  # equal to the default, but given by the user
    cache.register("obs", 300 * 2**20)
    assert cache.max_bytes == 128 * 2**20


def test_default_survives_pickling_as_fit_the_store() -> None:
    import pickle

    from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES

    again = pickle.loads(pickle.dumps(DEFAULT_CACHE_BYTES))
    assert again == DEFAULT_CACHE_BYTES and type(again) is type(DEFAULT_CACHE_BYTES)


def _reader(cache_bytes: int, n: int = 1000, chunk_rows: int = 64):
    from grain_replay.sources.reading.chunked import ChunkedLeafReader

    data = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    calls: list[list[int]] = []

    def read_blocks(ids):
        calls.append(list(ids))
        # The last block comes back padded past N, as some codecs return it.
        blocks = [data[c * chunk_rows : (c + 1) * chunk_rows] for c in ids]
        return [np.resize(b, (chunk_rows, 3)) for b in blocks]

    cache = ChunkCache(cache_bytes)
    reader = ChunkedLeafReader("x", n, chunk_rows, (3,), np.dtype(np.float32), read_blocks, cache)
    return reader, cache, calls, data


def test_a_store_that_fits_is_decoded_into_one_dense_array_once() -> None:
    reader, cache, calls, data = _reader(cache_bytes=1000 * 12)
    idx = np.array([999, 0, 63, 64, 999, -0, 500])
    np.testing.assert_array_equal(reader.take(idx), data[idx])
    assert calls == [[0, 1, 7, 15]] and (cache.misses, cache.hits) == (4, 0)
    assert cache._data == {} and cache.nbytes == (3 * 64 + 1000 - 960) * 12
    np.testing.assert_array_equal(reader.take(np.array([1, 998, 70])), data[[1, 998, 70]])
    assert len(calls) == 1 and cache.hits == 3  # nothing decoded again
    everything = np.random.default_rng(0).permutation(1000)
    np.testing.assert_array_equal(reader.take(everything), data[everything])
    assert cache.nbytes == data.nbytes <= cache.max_bytes
    cache.clear()  # the benchmark's "cold" case: decoded again after a clear
    assert cache.nbytes == 0
    np.testing.assert_array_equal(reader.take(np.array([5])), data[[5]])
    assert calls[-1] == [0]


def test_a_store_larger_than_the_bound_stays_in_the_lru() -> None:
    reader, cache, _, data = _reader(cache_bytes=1000 * 12 - 1)
    idx = np.arange(0, 1000, 7)
    np.testing.assert_array_equal(reader.take(idx), data[idx])
    assert cache._dense == {} and 0 < cache.nbytes <= cache.max_bytes


def test_dense_reads_from_many_threads_agree() -> None:
    import concurrent.futures

    reader, _, _, data = _reader(cache_bytes=2**20, n=5000, chunk_rows=7)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 5000, 256) for _ in range(64)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for idx, got in zip(batches, pool.map(reader.take, batches)):
            np.testing.assert_array_equal(got, data[idx])
