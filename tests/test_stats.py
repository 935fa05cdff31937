"""gr.compute_stats against numpy on the whole array: moments, extremes, quantiles, merges."""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np
import pytest
from rl_fixtures import ArraySource

import grain_replay as gr
import grain_replay.stats.cache as stats_store
from grain_replay.sources.access import LeafAccess
from grain_replay.stats import quantile_error, quantile_name, stats_cache_path

SUFFIX = {"hdf5": ".h5", "npy": "", "zarr": ".zarr"}
QS = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
Point = collections.namedtuple("Point", ["x", "y"])


def _tree(n: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "obs": {
            "vec": (rng.standard_normal((n, 3, 4)) * 50 + 1e4).astype(np.float32),
            "pix": rng.integers(0, 256, (n, 5), dtype=np.uint8),
        },
        "action": rng.integers(-7, 1000, n).astype(np.int64),
        "reward": rng.standard_normal(n).astype(np.float16),
        "done": rng.random(n) < 0.2,
    }


def _flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in gr.tree.flatten(tree)[0].items()}


def _leaf_stats(stats: Any) -> dict[str, dict[str, np.ndarray]]:
    flat = gr.tree.flatten(stats)[0]
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, value in flat.items():
        leaf, _, name = key.rpartition("/")
        out.setdefault(leaf, {})[name] = value
    return out


def _assert_matches_numpy(stats: Any, tree: Any, quantiles: Any = QS) -> None:
    """Every statistic equals numpy's over the whole array (quantiles exactly)."""
    got = _leaf_stats(stats)
    for key, x in _flat(tree).items():
        s, x64 = got[key], x.astype(np.float64)
        assert int(s["count"]) == len(x), key
        np.testing.assert_allclose(s["mean"], x64.mean(0), rtol=1e-12, atol=1e-12, err_msg=key)
        np.testing.assert_allclose(s["std"], x64.std(0), rtol=1e-9, atol=1e-9, err_msg=key)
        assert s["min"].dtype == x.dtype and s["max"].dtype == x.dtype, key
        np.testing.assert_array_equal(s["min"], x.min(0), err_msg=key)
        np.testing.assert_array_equal(s["max"], x.max(0), err_msg=key)
        for q in quantiles:
            np.testing.assert_array_equal(
                s[quantile_name(q)], np.quantile(x64, q, axis=0), err_msg=f"{key} {q}"
            )
        assert s["mean"].shape == s["q50"].shape == x.shape[1:], key


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_stats_match_numpy_per_element_for_every_format(tmp_path: Any, fmt: str) -> None:
    tree = _tree(5000)
    path = gr.write(str(tmp_path / f"s{SUFFIX[fmt]}"), tree, format=fmt)
    # Small blocks: many blocks, the read-ahead thread and the pairwise kernel's odd sizes.
    stats = gr.compute_stats(gr.open_source(path), quantiles=QS, block_bytes=7777)
    assert list(stats) == ["obs", "action", "reward", "done"]
    assert list(stats["obs"]) == ["vec", "pix"]
    _assert_matches_numpy(stats, tree)


def test_block_size_does_not_change_the_result(tmp_path: Any) -> None:
    src = gr.open_source(gr.write(str(tmp_path / "s.h5"), _tree(3001)))
    a = _leaf_stats(gr.compute_stats(src, block_bytes=1, cache=False))
    b = _leaf_stats(gr.compute_stats(src, block_bytes=1 << 30, cache=False))
    for key in a:
        for name in a[key]:
            np.testing.assert_allclose(a[key][name], b[key][name], rtol=1e-12, err_msg=key)


def test_mean_and_std_accumulate_in_float64_without_cancellation(tmp_path: Any) -> None:
    # float32 values around 1e6 with spread 1e-2: float32 sums or naive E[x^2] - E[x]^2 fail.
    rng = np.random.default_rng(1)
    x = (1e6 + rng.standard_normal((200_000, 2)) * 1e-2).astype(np.float32)
    src = gr.open_source(gr.write(str(tmp_path / "x.npy"), {"x": x}))
    s = gr.compute_stats(src, cache=False, block_bytes=1 << 16)["x"]
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(s["mean"], x64.mean(0), rtol=1e-14)
    np.testing.assert_allclose(s["std"], x64.std(0), rtol=1e-8)


def test_tree_structure_is_kept_for_tuples_and_namedtuples(tmp_path: Any) -> None:
    tree = (np.arange(10.0), Point(np.ones((10, 2), np.float32), np.arange(10, dtype=np.int32)))
    src = gr.open_source(gr.write(str(tmp_path / "t.h5"), tree))
    stats = gr.compute_stats(src)
    assert isinstance(stats, tuple) and isinstance(stats[1], Point)
    assert float(stats[0]["mean"]) == 4.5
    np.testing.assert_array_equal(stats[1].x["std"], [0.0, 0.0])


def test_bare_leaf_store_gives_one_dict(tmp_path: Any) -> None:
    path = str(tmp_path / "a.npy")
    np.save(path, np.arange(12, dtype=np.int16).reshape(6, 2))
    stats = gr.compute_stats(path)
    np.testing.assert_array_equal(stats["max"], [10, 11])
    np.testing.assert_array_equal(stats["q50"], [5.0, 6.0])


def test_keys_select_leaves_and_groups(tmp_path: Any) -> None:
    src = gr.open_source(gr.write(str(tmp_path / "s.h5"), _tree(100)))
    stats = gr.compute_stats(src, keys=["obs", "done"])
    assert list(stats) == ["obs", "done"] and list(stats["obs"]) == ["vec", "pix"]


def test_any_source_with_read_batch_works_without_cache() -> None:
    tree = _tree(700)
    _assert_matches_numpy(gr.compute_stats(ArraySource(tree), quantiles=QS), tree)


def test_stats_read_through_the_views_leaf_access(tmp_path: Any, monkeypatch: Any) -> None:
    """compute_stats has no read of its own: every leaf at once is one read_flat a block, a
    subset one read_leaf per leaf, as every view reads (sources/access.py LeafAccess.take)."""
    tree = _tree(500)
    src = gr.open_source(gr.write(str(tmp_path / "s.h5"), tree))
    calls: list[str] = []
    for name in ("read_flat", "read_leaf", "read_batch"):
        real = getattr(src, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(src, name, spy)
    _assert_matches_numpy(gr.compute_stats(src, quantiles=QS, block_bytes=4096, cache=False), tree)
    blocks = len([c for c in calls if c == "read_flat"])
    assert blocks > 3 and set(calls) == {"read_flat"}
    calls.clear()
    stats = gr.compute_stats(src, keys=["action", "reward"], block_bytes=4096, cache=False)
    np.testing.assert_allclose(stats["action"]["mean"], tree["action"].mean(), rtol=1e-12)
    assert set(calls) == {"read_leaf"} and len(calls) % 2 == 0
    # The views' reads: one read_flat for every leaf at one row array of any shape.
    calls.clear()
    rows = np.array([[3, 1], [499, 3]])
    got = LeafAccess(src).take(dict.fromkeys(src.keys, rows))
    assert calls == ["read_flat"]
    for key, x in _flat(tree).items():
        np.testing.assert_array_equal(got[key], x[rows], err_msg=key)
    calls.clear()
    LeafAccess(src).take({k: rows.copy() for k in src.keys})  # different rows per leaf
    assert set(calls) == {"read_leaf"}


def test_quantiles_of_a_sampled_store_are_within_the_rank_error(tmp_path: Any) -> None:
    n, k = 60_000, 4000
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(n // 2), rng.exponential(5.0, n // 2)])
    x = np.stack([x, -x * 3], axis=1)[rng.permutation(n)]
    src = gr.open_source(gr.write(str(tmp_path / "q.h5"), {"x": x}))
    s = gr.compute_stats(src, sample_rows=k, quantiles=QS, cache=False)["x"]
    eps = quantile_error(k, delta=1e-6)
    for q in QS:
        for col in range(2):
            v = np.sort(x[:, col])
            got = s[quantile_name(q)][col]
            # Ranks the reported value covers in the exact data.
            lo, hi = np.searchsorted(v, got, "left") / n, np.searchsorted(v, got, "right") / n
            assert lo - eps <= q <= hi + eps, (q, col, lo, hi, eps)
    # Moments and extremes stay exact when the quantiles are sampled.
    np.testing.assert_allclose(s["mean"], x.mean(0), rtol=1e-12)
    np.testing.assert_array_equal(s["min"], x.min(0))


def test_quantile_error_bound_and_names() -> None:
    assert quantile_error(1 << 16) == pytest.approx(0.0105, abs=1e-4)
    assert quantile_error(1 << 18) == pytest.approx(0.0053, abs=1e-4)
    assert [quantile_name(q) for q in (0.01, 0.1, 0.5, 0.99, 0.999, 0.0, 1.0)] == [
        "q01", "q10", "q50", "q99", "q99.9", "q00", "q100",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="sample_rows"):
        quantile_error(0)


def test_nan_propagates_per_element_like_numpy(tmp_path: Any) -> None:
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    x[7, 1] = np.nan
    src = gr.open_source(gr.write(str(tmp_path / "n.h5"), {"x": x}))
    # A sample of 4 rows (of 20) almost surely misses the NaN row: quantiles must still be NaN.
    s = gr.compute_stats(src, sample_rows=4, cache=False)["x"]
    for name in ("mean", "std", "min", "max", "q01", "q99"):
        assert not np.isnan(s[name][0]) and np.isnan(s[name][1]), name
    assert int(s["count"]) == 20


def test_empty_store_has_count_zero_and_nan(tmp_path: Any) -> None:
    src = ArraySource({"x": np.zeros((0, 3), np.float32)})
    s = gr.compute_stats(src)["x"]
    assert int(s["count"]) == 0 and s["mean"].shape == (3,) and np.isnan(s["q99"]).all()


# -- merges ---------------------------------------------------------------------------------


def test_pooled_stores_equal_numpy_on_the_concatenation(tmp_path: Any) -> None:
    a, b = _tree(1500, seed=1), _tree(700, seed=2)
    sa = gr.open_source(gr.write(str(tmp_path / "a.h5"), a))
    sb = gr.open_source(gr.write(str(tmp_path / "b.zarr"), b))
    both = {k: np.concatenate([_flat(a)[k], _flat(b)[k]]) for k in _flat(a)}
    stats = gr.compute_stats({"a": sa, "b": sb}, quantiles=QS)
    _assert_matches_numpy(stats, gr.tree.unflatten(sa.treedef, both))


def test_weighted_mixture_matches_the_mixture_distribution(tmp_path: Any) -> None:
    rng = np.random.default_rng(5)
    xa, xb = rng.normal(0, 1, (3000, 2)), rng.normal(10, 2, (500, 2))
    sa = gr.open_source(gr.write(str(tmp_path / "a.h5"), {"x": xa}))
    sb = gr.open_source(gr.write(str(tmp_path / "b.h5"), {"x": xb}))
    w = {"a": 0.25, "b": 0.75}
    s = gr.compute_stats({"a": sa, "b": sb}, weights=w, quantiles=QS)["x"]
    mean = 0.25 * xa.mean(0) + 0.75 * xb.mean(0)
    var = 0.25 * (xa.var(0) + (xa.mean(0) - mean) ** 2) + 0.75 * (
        xb.var(0) + (xb.mean(0) - mean) ** 2
    )
    np.testing.assert_allclose(s["mean"], mean, rtol=1e-12)
    np.testing.assert_allclose(s["std"], np.sqrt(var), rtol=1e-12)
    # Quantiles: numpy's weighted quantile over both stores, each row weighted by its share.
    values = np.concatenate([xa, xb])
    row_w = np.concatenate([np.full(3000, 0.25 / 3000), np.full(500, 0.75 / 500)])
    for q in QS:
        want = np.quantile(
            values, q, axis=0, method="inverted_cdf", weights=np.stack([row_w, row_w], 1)
        )
        np.testing.assert_array_equal(s[quantile_name(q)], want, err_msg=str(q))
    assert int(s["count"]) == 3500
    # A zero share leaves the store out of min and max.
    s0 = gr.compute_stats({"a": sa, "b": sb}, weights={"a": 1.0, "b": 0.0})["x"]
    np.testing.assert_array_equal(s0["max"], xa.max(0))


def test_mixture_of_stores_with_different_leaves_names_both(tmp_path: Any) -> None:
    sa = gr.open_source(gr.write(str(tmp_path / "a.h5"), {"x": np.zeros((4, 2))}))
    sb = gr.open_source(gr.write(str(tmp_path / "b.h5"), {"x": np.zeros((4, 3))}))
    with pytest.raises(gr.InvalidStoreError, match=r"'b'.*'a'.*keys="):
        gr.compute_stats({"a": sa, "b": sb})


@pytest.mark.parametrize(
    ("weights", "error", "match"),
    [
        ({"a": 1.0}, ValueError, "one share per source"),
        ({"a": -1.0, "b": 1.0}, ValueError, "finite, >= 0"),
        ({"a": 0.0, "b": 0.0}, ValueError, "not all 0"),
        (lambda step: {"a": 1.0, "b": 0.0}, TypeError, "schedule"),
    ],
)
def test_bad_weights_raise(tmp_path: Any, weights: Any, error: type, match: str) -> None:
    src = gr.open_source(gr.write(str(tmp_path / "a.h5"), {"x": np.zeros((4, 2))}))
    with pytest.raises(error, match=match):
        gr.compute_stats({"a": src, "b": src}, weights=weights)


def test_empty_store_with_a_positive_share_is_refused(tmp_path: Any) -> None:
    full = ArraySource({"x": np.arange(4.0)})
    empty = ArraySource({"x": np.zeros(0)})
    with pytest.raises(ValueError, match=r"\['e'\] have no rows"):
        gr.compute_stats({"f": full, "e": empty}, weights={"f": 0.5, "e": 0.5})
    s = gr.compute_stats({"f": full, "e": empty}, weights={"f": 1.0, "e": 0.0})
    assert float(s["x"]["mean"]) == 1.5


def test_bad_arguments_raise(tmp_path: Any) -> None:
    src = gr.open_source(gr.write(str(tmp_path / "a.h5"), {"x": np.zeros((4, 2))}))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gr.compute_stats(src, quantiles=[1.5])
    with pytest.raises(ValueError, match="weights= is for a mapping"):
        gr.compute_stats(src, weights={"a": 1.0})
    with pytest.raises(ValueError, match="sample_rows"):
        gr.compute_stats(src, sample_rows=0)
    with pytest.raises(ValueError, match="empty mapping"):
        gr.compute_stats({})
    with pytest.raises(gr.UnknownLeafError, match="nope"):
        gr.compute_stats(src, keys=["nope"])


def test_complex_leaf_is_refused_naming_it(tmp_path: Any) -> None:
    src = ArraySource({"z": np.zeros((3, 2), np.complex64), "x": np.zeros(3)})
    with pytest.raises(gr.InvalidStoreError, match=r"'z' \(complex64\).*keys="):
        gr.compute_stats(src)
    assert float(gr.compute_stats(src, keys=["x"])["x"]["mean"]) == 0.0


# -- cache and appended rows ----------------------------------------------------------------


def _spy_scans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []
    real = stats_store.scan

    def spy(source: Any, spec: Any, start: int, stop: int, **kw: Any) -> Any:
        calls.append((start, stop))
        return real(source, spec, start, stop, **kw)

    monkeypatch.setattr(stats_store, "scan", spy)
    return calls


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_appended_rows_are_read_alone_and_merged_exactly(
    tmp_path: Any, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy_scans(monkeypatch)
    path = str(tmp_path / f"r{SUFFIX[fmt]}")
    parts = [_tree(n, seed=i) for i, n in enumerate([900, 1, 2100])]
    with gr.ReplayWriter(path, format=fmt) as w:
        w.append(parts[0])
    gr.compute_stats(gr.open_source(path), quantiles=QS)
    assert os.path.exists(stats_cache_path(path))
    for part in parts[1:]:
        with gr.ReplayWriter(path) as w:
            w.append(part)
        stats = gr.compute_stats(gr.open_source(path), quantiles=QS)
    assert calls == [(0, 900), (900, 901), (901, 3001)]
    whole = {k: np.concatenate([_flat(p)[k] for p in parts]) for k in _flat(parts[0])}
    _assert_matches_numpy(stats, gr.tree.unflatten(gr.open_source(path).treedef, whole))
    # Unchanged store: served from the cache without reading.
    again = gr.compute_stats(gr.open_source(path), quantiles=QS)
    assert calls[-1] == (901, 3001)
    np.testing.assert_array_equal(again["obs"]["vec"]["q99"], stats["obs"]["vec"]["q99"])


def test_sampled_appended_parts_keep_the_rank_error(tmp_path: Any) -> None:
    path, k = str(tmp_path / "r.h5"), 1500
    rng = np.random.default_rng(9)
    parts = [rng.exponential(1.0, (n, 1)) * (i + 1) for i, n in enumerate([5000, 300, 8000])]
    for p in parts:
        with gr.ReplayWriter(path) as w:
            w.append({"x": p})
        s = gr.compute_stats(gr.open_source(path), sample_rows=k, quantiles=QS)["x"]
    v = np.sort(np.concatenate(parts)[:, 0])
    eps = quantile_error(k, delta=1e-6)
    for q in QS:
        got = s[quantile_name(q)][0]
        lo, hi = np.searchsorted(v, got, "left") / len(v), np.searchsorted(v, got, "right") / len(v)
        assert lo - eps <= q <= hi + eps, (q, lo, hi)
    np.testing.assert_allclose(s["mean"], v.mean(), rtol=1e-12)


def test_rewritten_store_is_read_again(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_scans(monkeypatch)
    path = gr.write(str(tmp_path / "s"), {"x": np.zeros((50, 2))}, format="npy")
    gr.compute_stats(path)
    gr.write(path, {"x": np.ones((60, 2))}, format="npy", overwrite=True)
    assert float(gr.compute_stats(path)["x"]["mean"][0]) == 1.0
    assert calls == [(0, 50), (0, 60)]


def test_rows_changed_in_place_are_read_again(tmp_path: Any) -> None:
    path = str(tmp_path / "a.npy")
    np.save(path, np.zeros((100, 2)))
    assert float(gr.compute_stats(path)["max"][0]) == 0.0
    m = np.load(path, mmap_mode="r+")
    m[99, 0] = 5.0  # same file, same inode, same length
    m.flush()
    del m
    assert float(gr.compute_stats(path)["max"][0]) == 5.0


def test_unreadable_cache_is_replaced(tmp_path: Any) -> None:
    path = gr.write(str(tmp_path / "s.h5"), {"x": np.arange(10.0)})
    with open(stats_cache_path(path), "wb") as f:
        f.write(b"not a cache")
    assert float(gr.compute_stats(path)["x"]["mean"]) == 4.5
    assert float(gr.compute_stats(path)["x"]["mean"]) == 4.5
    with np.load(stats_cache_path(path)) as z:
        assert "meta" in z


def test_cache_of_more_leaves_serves_a_selection(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy_scans(monkeypatch)
    path = gr.write(str(tmp_path / "s.h5"), _tree(300))
    full = gr.compute_stats(path)
    part = gr.compute_stats(path, keys=["action"])
    assert calls == [(0, 300)]
    np.testing.assert_array_equal(part["action"]["q50"], full["action"]["q50"])


def test_cache_false_neither_reads_nor_writes(tmp_path: Any) -> None:
    path = gr.write(str(tmp_path / "s.h5"), {"x": np.arange(10.0)})
    gr.compute_stats(path, cache=False)
    assert not os.path.exists(stats_cache_path(path))


def test_progress_counts_every_row(tmp_path: Any) -> None:
    path = gr.write(str(tmp_path / "s.h5"), _tree(1000))
    seen: list[int] = []
    gr.compute_stats(path, block_bytes=4096, progress=seen.append, cache=False)
    assert sum(seen) == 1000 and len(seen) > 10


def test_threads_and_column_chunks_do_not_change_the_result(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import grain_replay.stats.accumulate as accumulate
    import grain_replay.stats.results as results

    tree = _tree(20_000)
    src = gr.open_source(gr.write(str(tmp_path / "s.h5"), tree))
    monkeypatch.setattr(accumulate, "worker_threads", lambda: 3)
    monkeypatch.setattr(accumulate, "_MIN_THREAD_ROWS", 1000)
    monkeypatch.setattr(results, "_QUANTILE_VALUES", 50_000)  # 2 columns at a time
    _assert_matches_numpy(gr.compute_stats(src, quantiles=QS, cache=False), tree)


def test_cache_keeps_the_quantiles_taken(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import grain_replay.stats.results as stats_mod

    path = gr.write(str(tmp_path / "s.h5"), _tree(400))
    first = gr.compute_stats(path, quantiles=[0.01, 0.99])
    taken: list[list[float]] = []
    real = stats_mod._quantiles

    def spy(sample: Any, quantiles: Any, weights: Any) -> Any:
        taken.append(list(quantiles))
        return real(sample, quantiles, weights)

    monkeypatch.setattr(stats_mod, "_quantiles", spy)
    again = gr.compute_stats(path, quantiles=[0.01, 0.99])
    assert taken == []  # all from the cache
    np.testing.assert_array_equal(again["obs"]["vec"]["q99"], first["obs"]["vec"]["q99"])
    more = gr.compute_stats(path, quantiles=[0.5, 0.99])
    assert taken and all(t == [0.5] for t in taken)  # only the new one is taken
    x = _flat(_tree(400))["action"].astype(np.float64)
    assert float(more["action"]["q50"]) == np.quantile(x, 0.5)


def test_stats_normalize_the_batches_of_the_loader_on_devices(tmp_path: Any) -> None:
    import jax

    rng = np.random.default_rng(4)
    obs = (rng.standard_normal((4096, 3)) * [1.0, 10.0, 0.1] + [5.0, -3.0, 100.0]).astype(
        np.float32
    )
    src = gr.open_source(gr.write(str(tmp_path / "s.h5"), {"obs": obs}))
    s = gr.compute_stats(src)["obs"]
    loader = gr.make_data_loader(src, batch_size=512, seed=1, worker_count=0)
    with gr.sharded_device_put(loader) as batches:
        seen = [np.asarray(jax.device_get((b["obs"] - s["mean"]) / s["std"])) for b in batches]
    z = np.concatenate(seen)
    assert z.shape == (4096, 3)
    # On the devices the arithmetic is float32: 100 +- 0.1 normalizes to within ~1e-4.
    np.testing.assert_allclose(z.mean(0), 0.0, atol=2e-4)
    np.testing.assert_allclose(z.std(0), 1.0, atol=2e-4)


def test_leaf_of_zero_values_per_record_counts_rows() -> None:
    src = ArraySource({"e": np.zeros((5, 0), np.float32), "x": np.arange(5.0)})
    s = gr.compute_stats(src)
    assert int(s["e"]["count"]) == 5 and s["e"]["mean"].shape == (0,)
    assert s["e"]["q50"].shape == (0,) and float(s["x"]["q50"]) == 2.0


def test_sorted_quantiles_equal_numpy_bit_for_bit_for_every_small_size() -> None:
    import grain_replay.stats.results as stats_mod

    rng = np.random.default_rng(6)
    qs = [0.0, 1e-9, 0.01, 0.1, 0.25, 1 / 3, 0.5, 0.75, 0.9, 0.99, 1 - 1e-12, 1.0]
    for n in range(1, 40):
        x = rng.integers(-3, 4, (n, 3)).astype(np.float64) + rng.random((n, 3)) * (n % 2)
        got = stats_mod._quantiles(x, qs, None)
        np.testing.assert_array_equal(got, np.quantile(x, qs, axis=0), err_msg=str(n))


def test_every_kernel_path_matches_numpy() -> None:
    # 1 value per record (1-D reductions), 100 (pairwise halving), 300 (numpy's axis-0).
    rng = np.random.default_rng(8)
    tree = {
        "one": rng.standard_normal(3000).astype(np.float32),
        "hundred": rng.integers(0, 50_000, (3000, 100)).astype(np.int32),
        "wide": (rng.standard_normal((3000, 300)) + 7).astype(np.float32),
    }
    stats = gr.compute_stats(ArraySource(tree), quantiles=QS, block_bytes=300_000)
    _assert_matches_numpy(stats, tree)
