"""Mixtures: exact per-batch counts, per-source epochs, leaves, resume, shards, workers."""

from __future__ import annotations

import collections
from typing import Any, ClassVar

import grain
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sampling.mixture import MixtureSampler, apportion


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix")
    a = {"obs": np.arange(60, dtype=np.float32)[:, None] * np.ones(3, np.float32),
         "id": np.arange(60, dtype=np.int64)}  # fmt: skip
    b = {"obs": -np.arange(1, 24, dtype=np.float32)[:, None] * np.ones(3, np.float32),
         "id": 1000 + np.arange(23, dtype=np.int64),
         "extra": np.zeros(23, np.int8)}  # fmt: skip
    gr.write_npy(root / "a", a)
    gr.write_npy(root / "b", b)
    return {"a": str(root / "a"), "b": str(root / "b")}


def _sources(stores: dict[str, str], keys: Any = ("obs", "id")) -> dict[str, Any]:
    return {n: gr.NpyDataSource(p, keys=list(keys)) for n, p in stores.items()}


class CountingSource:
    """Wraps a source and counts read_batch calls (picklable)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.calls = 0

    def __len__(self) -> int:
        return len(self.source)

    @property
    def spec(self) -> Any:
        return self.source.spec

    @property
    def treedef(self) -> Any:
        return self.source.treedef

    def read_batch(self, rows: np.ndarray) -> Any:
        self.calls += 1
        return self.source.read_batch(rows)


def test_apportion_is_largest_remainder() -> None:
    assert apportion(np.array([2.5, 3.5, 4.0]), 10).tolist() == [3, 3, 4]  # tie: earlier
    assert apportion(np.array([0.6, 1.7, 7.7]), 10).tolist() == [0, 2, 8]
    assert apportion(np.array([0.0, 10.0]), 10).tolist() == [0, 10]


@pytest.mark.parametrize(
    "weights", [[0.25, 0.75], [0.1, 0.3, 0.6], [1 / 3, 1 / 3, 1 / 3], [0.01, 0.99]]
)
def test_counts_sum_to_batch_and_never_drift(weights: list[float]) -> None:
    names = [f"s{i}" for i in range(len(weights))]
    sampler = MixtureSampler(
        dict.fromkeys(names, 1000), dict(zip(names, weights)), 7, seed=0, shuffle=True
    )
    total = np.zeros(len(names))
    for step in range(1, 400):
        task = sampler.draw()
        counts = np.array([len(task.get(n, ())) for n in names])
        assert counts.sum() == 7 and (counts >= 0).all()
        total += counts
        # the cumulative count is the rounded cumulative target: off by less than one row
        assert np.abs(total - step * 7 * np.array(weights)).max() < 1.0, (step, total)


def test_schedule_of_the_step_anneals_counts() -> None:
    def anneal(step: int) -> dict[str, float]:
        frac = min(step / 10, 1.0)
        return {"offline": 1 - frac, "online": frac}

    sampler = MixtureSampler({"offline": 100, "online": 100}, anneal, 10, seed=0, shuffle=True)
    counts = []
    for _ in range(12):
        task = sampler.draw()
        counts.append(len(task.get("online", ())))
    assert counts[0] == 0 and counts[5] == 5 and counts[10:] == [10, 10]


@pytest.mark.parametrize(
    "weights",
    [{"a": -1.0, "b": 1.0}, {"a": float("nan"), "b": 1.0}, {"a": 0.0, "b": 0.0}, {"c": 1.0}, [1]],
)
def test_bad_weights_are_refused(stores: dict[str, str], weights: Any) -> None:
    with pytest.raises(gr.InvalidSamplingError) as e:
        gr.make_data_loader(_sources(stores), weights=weights, batch_size=8)
    assert isinstance(e.value, ValueError)


def test_bad_schedule_value_is_refused_at_that_step(stores: dict[str, str]) -> None:
    it = iter(
        gr.make_data_loader(
            _sources(stores),
            weights=lambda s: {"a": 1.0, "b": 1.0} if s < 2 else {"a": float("inf")},
            batch_size=8,
        )
    )
    next(it), next(it)
    with pytest.raises(gr.InvalidSamplingError, match="step 2"):
        next(it)


def test_every_batch_holds_exact_counts_and_one_read_per_source(stores: dict[str, str]) -> None:
    srcs = {n: CountingSource(s) for n, s in _sources(stores).items()}
    loader = gr.make_data_loader(
        srcs, weights={"a": 0.25, "b": 0.75}, batch_size=8, source_leaf="source"
    )
    it = iter(loader)
    for step in range(1, 21):
        batch = next(it)
        assert batch["obs"].shape == (8, 3) and batch["id"].dtype == np.int64
        from_b = int((batch["source"] == 1).sum())
        assert from_b == 6  # 0.75 * 8 exactly
        np.testing.assert_array_equal(batch["source"] == 1, batch["id"] >= 1000)
        assert srcs["a"].calls == step and srcs["b"].calls == step


def test_each_source_walks_its_own_epochs(stores: dict[str, str]) -> None:
    it = iter(gr.make_data_loader(_sources(stores), weights={"a": 0.5, "b": 0.5}, batch_size=4))
    ids = np.concatenate([next(it)["id"] for _ in range(60)])  # 120 a-rows = 2 epochs of a
    a = ids[ids < 1000]
    b = ids[ids >= 1000] - 1000
    assert sorted(a[:60].tolist()) == list(range(60)) and sorted(a[60:].tolist()) == list(range(60))
    assert (a[:60] != a[60:]).any()  # a fresh permutation each epoch
    assert sorted(b[:23].tolist()) == list(range(23))


def test_leaves_that_differ_are_named_unless_keys_selects(stores: dict[str, str]) -> None:
    srcs = {n: gr.NpyDataSource(p) for n, p in stores.items()}
    with pytest.raises(gr.LeafMismatchError, match=r"'a' .*lacks \['extra'\]") as e:
        gr.make_data_loader(srcs, weights={"a": 1, "b": 1}, batch_size=4)
    assert "keys=['id', 'obs']" in str(e.value) or "keys=['obs', 'id']" in str(e.value)
    with pytest.raises(gr.LeafMismatchError, match="lacks"):
        gr.make_data_loader(srcs, weights={"a": 1, "b": 1}, batch_size=4, keys=["extra"])
    batch = next(
        iter(gr.make_data_loader(srcs, weights={"a": 1, "b": 1}, batch_size=4, keys=["id"]))
    )
    assert set(batch) == {"id"}


def test_source_leaf_name_clash_is_refused(stores: dict[str, str]) -> None:
    with pytest.raises(gr.InvalidSamplingError, match="source_leaf"):
        gr.make_data_loader(_sources(stores), weights={"a": 1}, batch_size=4, source_leaf="obs")


def test_resume_identical_with_schedule(stores: dict[str, str]) -> None:
    def weights(step: int) -> dict[str, float]:
        return {"a": 1.0 / (1 + step), "b": 0.3}

    loader = gr.make_data_loader(_sources(stores), weights=weights, batch_size=6, seed=3)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = it.get_state()
    want = [next(it)["id"] for _ in range(9)]
    fresh = iter(loader)
    fresh.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(fresh)["id"], w)


def test_state_of_another_mixture_is_refused(stores: dict[str, str]) -> None:
    state = iter(gr.make_data_loader(_sources(stores), weights={"a": 1}, batch_size=6)).get_state()
    other = iter(gr.make_data_loader(_sources(stores), weights={"a": 1}, batch_size=4))
    with pytest.raises(gr.InvalidSamplingError, match="batch_size"):
        other.set_state(state)
    with pytest.raises(gr.InvalidSamplingError, match="Not a state"):
        other.set_state(b"{}")


def test_shards_read_disjoint_shares_of_every_source(stores: dict[str, str]) -> None:
    seen: list[collections.Counter[int]] = []
    for index in range(2):
        loader = gr.make_data_loader(
            _sources(stores),
            weights={"a": 0.5, "b": 0.5},
            batch_size=4,
            shard_options=grain.sharding.ShardOptions(index, 2, drop_remainder=True),
        )
        it = iter(loader)
        seen.append(
            collections.Counter(np.concatenate([next(it)["id"] for _ in range(15)]).tolist())
        )
    # 15 steps x 2 rows x 2 shards = 60 rows of a: one epoch between them, disjoint
    a0 = {i for i in seen[0] if i < 1000}
    a1 = {i for i in seen[1] if i < 1000}
    assert not a0 & a1 and a0 | a1 == set(range(60))


def test_workers_yield_the_in_process_stream(stores: dict[str, str]) -> None:
    args = dict(weights={"a": 0.3, "b": 0.7}, batch_size=8, seed=5, source_leaf="src")
    plain = iter(gr.make_data_loader(_sources(stores), **args))
    with iter(gr.make_data_loader(_sources(stores), worker_count=2, **args)) as workers:
        for _ in range(12):
            x, y = next(plain), next(workers)
            np.testing.assert_array_equal(x["id"], y["id"])
            np.testing.assert_array_equal(x["src"], y["src"])
        state = workers.get_state()
        want = [next(workers)["id"] for _ in range(5)]
        workers.set_state(state)
        for w in want:
            np.testing.assert_array_equal(next(workers)["id"], w)


def test_replay_dataset_takes_a_mixture(stores: dict[str, str]) -> None:
    ds = gr.replay_dataset(_sources(stores), weights={"a": 0.5, "b": 0.5}, batch_size=4)
    assert isinstance(ds, grain.IterDataset)
    it = iter(ds)
    first = [next(it)["id"] for _ in range(3)]
    state = it.get_state()
    nxt = next(it)["id"]
    again = iter(ds)
    np.testing.assert_array_equal(next(again)["id"], first[0])
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["id"], nxt)


def test_num_epochs_other_than_one_or_none_is_refused(stores: dict[str, str]) -> None:
    with pytest.raises(gr.InvalidSamplingError, match="endless"):
        gr.make_data_loader(_sources(stores), weights={"a": 1}, batch_size=4, num_epochs=3)


def test_non_map_operations_are_refused(stores: dict[str, str]) -> None:
    with pytest.raises(gr.InvalidSamplingError, match="Map"):
        gr.make_data_loader(
            _sources(stores), weights={"a": 1}, batch_size=4, operations=[grain.transforms.Batch(2)]
        )


def test_mixture_under_uniform_replay_draws_from_growing_sources(tmp_path: Any) -> None:
    offline = str(tmp_path / "offline")
    online = str(tmp_path / "online")
    gr.write_npy(offline, {"id": np.arange(100, dtype=np.int64)})
    with gr.ReplayWriter(online, format="npy") as writer:
        writer.append({"id": 1000 + np.arange(4, dtype=np.int64)})
        writer.flush()
        srcs = {"offline": gr.NpyDataSource(offline), "online": gr.NpyDataSource(online)}
        loader = gr.make_data_loader(
            srcs,
            weights=lambda step: {"offline": 0.5, "online": 0.5},
            batch_size=8,
            sampling=gr.UniformReplay(refresh_every=None),
        )
        it = iter(loader)
        first = np.concatenate([next(it)["id"] for _ in range(10)])
        assert set(first[first >= 1000].tolist()) <= {1000, 1001, 1002, 1003}
        assert (first >= 1000).sum() == 40  # exact counts, drawn with replacement
        writer.append({"id": 1004 + np.arange(96, dtype=np.int64)})
        writer.flush()
        state = it.get_state()
        it.refresh()
        later = np.concatenate([next(it)["id"] for _ in range(10)])
        assert later.max() >= 1004  # the online source grew and was read
        # resume at the saved point: the same draws (same lengths seen)
        fresh = iter(loader)
        fresh.set_state(state)
        fresh.refresh()
        again = np.concatenate([next(fresh)["id"] for _ in range(10)])
        np.testing.assert_array_equal(again, later)


def test_empty_online_source_with_rows_due_is_refused(tmp_path: Any) -> None:
    gr.write_npy(tmp_path / "a", {"id": np.arange(10, dtype=np.int64)})

    class Empty:
        spec: ClassVar[dict[str, Any]] = {"id": None}
        treedef: ClassVar[dict[str, Any]] = {
            "type": "dict",
            "keys": ["id"],
            "children": [{"type": "leaf"}],
        }

        def __len__(self) -> int:
            return 0

        def read_batch(self, rows: np.ndarray) -> Any:
            raise AssertionError("never read")

    loader = gr.make_data_loader(
        {"a": gr.NpyDataSource(tmp_path / "a"), "online": Empty()},
        weights=lambda step: {"a": 1.0, "online": 0.0 if step < 2 else 1.0},
        batch_size=4,
        sampling=gr.UniformReplay(),
    )
    it = iter(loader)
    next(it), next(it)
    with pytest.raises(gr.InvalidSamplingError, match="no committed rows"):
        next(it)


def test_leaves_of_other_dtypes_or_shapes_are_named_unless_keys_leaves_them_out(
    tmp_path: Any,
) -> None:
    gr.write_npy(tmp_path / "f32", {"obs": np.zeros((10, 3), np.float32), "id": np.arange(10)})
    gr.write_npy(tmp_path / "f64", {"obs": np.ones((10, 3), np.float64), "id": np.arange(10)})
    gr.write_npy(tmp_path / "wide", {"obs": np.ones((10, 4), np.float32), "id": np.arange(10)})
    srcs = {n: gr.NpyDataSource(tmp_path / n) for n in ("f32", "f64", "wide")}
    with pytest.raises(
        gr.LeafMismatchError, match=r"'obs'.*float32\[3\].*'f64'.*float64\[3\]"
    ) as e:
        gr.make_data_loader(srcs, weights={"f32": 1, "f64": 1, "wide": 1}, batch_size=6)
    assert "float32[4]" in str(e.value) and "keys=" in str(e.value)
    batch = next(
        iter(gr.make_data_loader(srcs, weights={"f32": 1, "f64": 1, "wide": 1}, batch_size=6,
                                 keys=["id"], source_leaf="src"))
    )  # fmt: skip
    assert set(batch) == {"id", "src"} and batch["src"].tolist() == [0, 0, 1, 1, 2, 2]


def test_a_foreign_source_and_a_store_fill_one_batch(stores: dict[str, str]) -> None:
    """A source without read_into (read_batch only) writes its rows into the same batch."""
    srcs = _sources(stores)
    ours = iter(gr.make_data_loader(srcs, weights={"a": 3, "b": 1}, batch_size=8, seed=4))
    mixed = {"a": srcs["a"], "b": CountingSource(srcs["b"])}
    theirs = iter(gr.make_data_loader(mixed, weights={"a": 3, "b": 1}, batch_size=8, seed=4))
    for _ in range(12):
        x, y = next(ours), next(theirs)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
            assert x[k].flags.c_contiguous and x[k].flags.writeable


def test_rows_past_a_shrunk_source_raise_instead_of_reading_other_rows(tmp_path: Any) -> None:
    gr.write_npy(tmp_path / "a", {"id": np.arange(60, dtype=np.int64)})
    gr.write_npy(tmp_path / "b", {"id": 1000 + np.arange(60, dtype=np.int64)})
    a, b = gr.NpyDataSource(tmp_path / "a"), gr.NpyDataSource(tmp_path / "b")
    it = iter(gr.make_data_loader({"a": a, "b": b}, weights={"a": 1, "b": 1}, batch_size=16))
    next(it)
    gr.write_npy(tmp_path / "a", {"id": np.arange(5, dtype=np.int64)}, overwrite=True)
    a.refresh()  # the store was replaced by a shorter one
    with pytest.raises(gr.RecordIndexError, match="out of range"):
        next(it)  # 8 rows of 60 drawn: some are past the 5 left


@pytest.mark.parametrize("shuffle", [True, False])
def test_fixed_weights_drawn_in_blocks_equal_step_by_step_draws(shuffle: bool) -> None:
    """Fixed weights draw 16 steps at once; a callable draws one by one: same steps, states."""
    sizes, weights = {"a": 50, "b": 7, "c": 1000}, {"a": 0.3, "b": 0.2, "c": 0.5}
    blocked = MixtureSampler(sizes, weights, 10, seed=3, shuffle=shuffle)
    stepwise = MixtureSampler(sizes, lambda step: weights, 10, seed=3, shuffle=shuffle)
    assert blocked._blocked and not stepwise._blocked
    for step in range(70):  # many epochs of "b", blocks of 16 cut mid-epoch
        if step == 37:  # resume mid-block from the other's state
            blocked.set_state(stepwise.state())
        assert blocked.state() == stepwise.state()
        x, y = blocked.draw(), stepwise.draw()
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(x[name], y[name])
