"""Tests for make_data_loader, replay_dataset (grain_replay.loading) and BatchedReads."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterable
from typing import Any

import cloudpickle
import grain
import jax
import numpy as np
import pytest
from conformance import assert_tree_equal, make_tree
from jax.sharding import NamedSharding

import grain_replay as gr
from grain_replay import tree as tree_lib
from grain_replay.pipeline import batches as batches_lib
from grain_replay.pipeline.loader import BatchedReads, LoaderOptions

# grain pickles the pipeline for its spawned workers with cloudpickle. Pickling this
# module's helper classes by value means the workers never import the test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NO_SHARDING = grain.sharding.NoSharding()

needs_8_devices = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 JAX devices: XLA_FLAGS=--xla_force_host_platform_device_count=8",
)


# -- helpers run in grain workers (pickled by value) -------------------------------


class CountingSource:
    """Delegates ``read_batch`` and tags each batch with this process's call count and pid.

    ``__getitem__`` and ``_getitems`` raise: the loader must read whole batches only.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        self.calls = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"CountingSource({self.source!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> Any:
        raise RuntimeError(f"__getitem__({index}) called; the loader must use read_batch")

    def _getitems(self, indices: Any) -> Any:
        raise RuntimeError("_getitems called; the loader must use read_batch")

    def read_batch(self, indices: Any) -> Any:
        with self._lock:
            self.calls += 1
            call = self.calls
        batch = dict(self.source.read_batch(indices))
        rows = len(indices)
        batch["_call"] = np.full(rows, call, np.int64)
        batch["_pid"] = np.full(rows, os.getpid(), np.int64)
        return batch


class AddDoubledReward(grain.transforms.Map):
    """An ``operations`` step: adds a field computed from the host batch."""

    def map(self, element: Any) -> Any:
        out = dict(element)
        out["reward2"] = element["reward"] * 2
        return out


class ProbeProcess(grain.transforms.Map):
    """Records, per row, the pid and how many JAX backends the running process holds."""

    def map(self, element: Any) -> Any:
        xla_bridge = sys.modules.get("jax._src.xla_bridge")
        backends = len(xla_bridge._backends) if xla_bridge is not None else 0
        rows = len(element["id"])
        out = dict(element)
        out["pid"] = np.full(rows, os.getpid(), np.int64)
        out["jax_backends"] = np.full(rows, backends, np.int64)
        return out


# -- fixtures and local helpers ------------------------------------------------------


def _tree(n: int) -> dict[str, Any]:
    tree = make_tree(n)
    tree["id"] = np.arange(n, dtype=np.int64)
    return tree


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``store(n, fmt="hdf5")`` -> path of a store of ``_tree(n)``, written once per module."""
    root = tmp_path_factory.mktemp("stores")
    paths: dict[tuple[int, str], str] = {}
    suffix = {"hdf5": ".h5", "npy": "", "zarr": ".zarr"}

    def get(n: int, fmt: str = "hdf5") -> str:
        if (n, fmt) not in paths:
            path = str(root / f"n{n}_{fmt}{suffix[fmt]}")
            gr.write(path, _tree(n), format=fmt)
            paths[n, fmt] = path
        return paths[n, fmt]

    return get


def _loader(source: Any, **kwargs: Any) -> grain.DataLoader:
    kwargs.setdefault("shard_options", NO_SHARDING)
    return gr.make_data_loader(source, **kwargs)


def _reads(source: Any, shard_count: int = 1, **kwargs: Any) -> BatchedReads:
    return BatchedReads(source, LoaderOptions(**kwargs), shard_count)


def _ids(batches: Iterable[Any]) -> list[np.ndarray]:
    return [np.asarray(b["id"]) for b in batches]


def _assert_trees_equal(got: Any, want: Any, on_device: bool = False) -> None:
    """Same leaf paths (dict key order aside), dtypes and values.

    With ``on_device``, ``got`` holds jax.Arrays, whose dtypes are ``want``'s as JAX
    canonicalizes them (int64 -> int32 without ``jax_enable_x64``).
    """
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        g = np.asarray(g)
        want_dtype = jax.dtypes.canonicalize_dtype(w.dtype) if on_device else w.dtype
        assert g.dtype == want_dtype, (jax.tree_util.keystr(path), g.dtype, want_dtype)
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


def _assert_streams_equal(got: list[Any], want: list[Any], on_device: bool = False) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _assert_trees_equal(g, w, on_device)


def _split_epochs(ids: list[np.ndarray], per_epoch: int) -> list[np.ndarray]:
    assert len(ids) % per_epoch == 0
    return [np.concatenate(ids[i : i + per_epoch]) for i in range(0, len(ids), per_epoch)]


def _assert_one_read_per_batch(batches: list[Any]) -> None:
    """Per process, the call counts tagged by CountingSource are 1..k for k batches."""
    calls: dict[int, list[int]] = {}
    for b in batches:
        assert len(set(b["_call"].tolist())) == 1 and len(set(b["_pid"].tolist())) == 1
        calls.setdefault(int(b["_pid"][0]), []).append(int(b["_call"][0]))
    for pid, seen in calls.items():
        assert sorted(seen) == list(range(1, len(seen) + 1)), (pid, seen)


# -- batches: values, reads, structure ----------------------------------------------


@pytest.mark.parametrize("fmt", ["hdf5", "npy", "zarr"])
def test_batches_equal_read_batch_of_record_ids_without_workers(
    store: Callable[..., str], fmt: str
) -> None:
    src = gr.open_source(store(100, fmt))
    counting = CountingSource(src)
    batches = list(_loader(counting, batch_size=8, seed=3, num_epochs=2))
    reads = _reads(src, batch_size=8, seed=3, num_epochs=2)
    assert len(batches) == len(reads) == 24
    for g, batch in enumerate(batches):
        ids = reads.record_ids(g)
        assert ids.shape == (8,)
        expected = dict(src.read_batch(ids))
        got = {k: v for k, v in batch.items() if not k.startswith("_")}
        assert_tree_equal(got, expected)
        for leaf in jax.tree_util.tree_leaves(batch):
            assert type(leaf) is np.ndarray and leaf.shape[0] == 8
    assert counting.calls == len(batches)  # worker_count=0 reads in this process
    _assert_one_read_per_batch(batches)
    assert sorted(b["_call"][0] for b in batches) == list(range(1, 25))


def test_read_into_reads_the_batch_into_the_arrays_or_says_it_cannot(
    store: Callable[..., str],
) -> None:
    src = gr.open_source(store(100, "npy"))
    kwargs = dict(batch_size=8, seed=3, num_epochs=1, drop_remainder=False)
    for reads in (_reads(src, **kwargs), pickle.loads(pickle.dumps(_reads(src, **kwargs)))):
        want, _ = tree_lib.flatten(reads[2])  # leaf key ("obs/pixels") -> array
        out = {k: np.zeros_like(v) for k, v in want.items()}
        assert reads.read_into(2, out)
        assert_tree_equal(out, want)
        last = len(reads) - 1  # 100 rows: a short last batch of 4 is not read into 8 rows
        assert not reads.read_into(last, {k: np.zeros_like(v) for k, v in want.items()})
    # a source with no read_into (asked once, when the reads are made): read_batch only
    plain = _reads(CountingSource(src), **kwargs)
    untouched = {k: np.zeros_like(v) for k, v in want.items()}
    assert not plain.read_into(2, untouched)
    assert all(not v.any() for v in untouched.values())


def test_one_read_batch_call_per_batch_with_monkeypatched_source(
    store: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = gr.open_source(store(100))
    calls: list[np.ndarray] = []
    original = src.read_batch

    def counting_read_batch(indices: Any) -> Any:
        calls.append(np.array(indices))
        return original(indices)

    def forbidden(*args: Any) -> Any:
        raise AssertionError("record-level read called")

    monkeypatch.setattr(src, "read_batch", counting_read_batch)
    monkeypatch.setattr(type(src), "__getitem__", forbidden)
    monkeypatch.setattr(type(src), "_getitems", forbidden)
    batches = list(_loader(src, batch_size=16, seed=1, num_epochs=1))
    assert len(batches) == len(calls) == 6
    reads = _reads(src, batch_size=16, seed=1, num_epochs=1)
    assert sorted(c.tobytes() for c in calls) == sorted(
        reads.record_ids(g).tobytes() for g in range(6)
    )


def test_batches_keep_tree_structure_and_dtypes(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    batch = next(iter(_loader(src, batch_size=8)))
    want = _tree(100)
    assert jax.tree_util.tree_structure(batch) == jax.tree_util.tree_structure(want)
    for got, ref in zip(jax.tree_util.tree_leaves(batch), jax.tree_util.tree_leaves(want)):
        assert got.dtype == ref.dtype
        assert got.shape == (8, *ref.shape[1:])


def test_record_ids_same_with_and_without_cached_order(
    store: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = gr.open_source(store(100))
    kwargs = dict(batch_size=7, seed=5, num_epochs=3, drop_remainder=False)
    reads = _reads(src, **kwargs)
    assert len(reads) == 3 * 15
    cached = [reads.record_ids(g) for g in range(len(reads))]
    assert reads._orders  # whole-epoch orders were computed and kept
    # Above the threshold each batch's slice of the order is computed on its own.
    monkeypatch.setattr(batches_lib, "CACHED_ORDER_MAX_RECORDS", 0)
    reads = _reads(src, **kwargs)
    for g, want in enumerate(cached):
        got = reads.record_ids(g)
        assert got.dtype == want.dtype == np.int64
        np.testing.assert_array_equal(got, want)
    assert not reads._orders


def test_batched_reads_pickles_without_order_cache(store: Callable[..., str]) -> None:
    reads = _reads(gr.open_source(store(100)), batch_size=8, seed=2, num_epochs=2)
    before = [reads.record_ids(g) for g in range(len(reads))]
    clone = pickle.loads(pickle.dumps(reads))
    assert clone._orders == {}
    assert repr(clone) == repr(reads)
    for g in range(len(reads)):
        np.testing.assert_array_equal(clone.record_ids(g), before[g])
    _assert_trees_equal(clone[3], reads[3])


# -- epochs and order --------------------------------------------------------------


@pytest.mark.parametrize(
    "n, drop_remainder",
    [(96, False), (100, False), (96, True), (100, True)],
    ids=["divisible-keep", "remainder-keep", "divisible-drop", "remainder-drop"],
)
def test_every_record_once_per_epoch_with_shuffle(
    store: Callable[..., str], n: int, drop_remainder: bool
) -> None:
    b, epochs = 8, 3
    src = gr.open_source(store(n))
    batches = list(
        _loader(src, batch_size=b, seed=11, num_epochs=epochs, drop_remainder=drop_remainder)
    )
    per_epoch = n // b if drop_remainder else -(-n // b)
    assert len(batches) == epochs * per_epoch
    ids = _ids(batches)
    for i, batch_ids in enumerate(ids):
        last = i % per_epoch == per_epoch - 1
        assert len(batch_ids) == (n - (per_epoch - 1) * b if last and not drop_remainder else b)
    orders = _split_epochs(ids, per_epoch)
    for order in orders:
        assert len(np.unique(order)) == len(order)
        if drop_remainder:
            assert len(order) == n // b * b and n - len(order) < b
        else:
            np.testing.assert_array_equal(np.sort(order), np.arange(n))
    assert len({o.tobytes() for o in orders}) == epochs
    assert not np.array_equal(orders[0], np.arange(len(orders[0])))


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_sequential_order_without_shuffle(store: Callable[..., str], drop_remainder: bool) -> None:
    n, b = 100, 8
    src = gr.open_source(store(n))
    loader = _loader(src, batch_size=b, shuffle=False, num_epochs=2, drop_remainder=drop_remainder)
    ids = np.concatenate(_ids(loader))
    kept = n // b * b if drop_remainder else n
    np.testing.assert_array_equal(ids, np.tile(np.arange(kept), 2))


def test_stream_depends_on_seed(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    a = np.concatenate(_ids(_loader(src, batch_size=10, seed=0)))
    b = np.concatenate(_ids(_loader(src, batch_size=10, seed=1)))
    again = np.concatenate(_ids(_loader(src, batch_size=10, seed=0)))
    np.testing.assert_array_equal(a, again)
    assert not np.array_equal(a, b)


def test_num_epochs_none_repeats_forever(store: Callable[..., str]) -> None:
    n, b = 100, 8
    src = gr.open_source(store(n))
    loader = _loader(src, batch_size=b, seed=4, num_epochs=None)
    assert len(loader._data_source) == sys.maxsize
    per_epoch = n // b
    ids = _ids(itertools.islice(iter(loader), 5 * per_epoch + 1))
    assert len(ids) == 5 * per_epoch + 1
    orders = _split_epochs(ids[:-1], per_epoch)
    for order in orders:
        assert len(np.unique(order)) == len(order) == per_epoch * b
    assert len({o.tobytes() for o in orders}) == 5
    finite = _ids(_loader(src, batch_size=b, seed=4, num_epochs=5))
    for got, want in zip(ids, finite):
        np.testing.assert_array_equal(got, want)


def test_drop_remainder_false_allows_batch_larger_than_store(store: Callable[..., str]) -> None:
    src = gr.open_source(store(10))
    batches = list(_loader(src, batch_size=64, drop_remainder=False, num_epochs=2))
    assert [len(b["id"]) for b in batches] == [10, 10]
    for b in batches:
        np.testing.assert_array_equal(np.sort(b["id"]), np.arange(10))


# -- operations and worker processes ----------------------------------------------------


# Starting grain workers takes seconds on a small machine, so one worker run (a
# counting source, two operations, two epochs with a partial last batch) serves
# the tests below; each checks one property of it against a run without workers.
WORKER_RUN = dict(batch_size=8, seed=7, num_epochs=2, drop_remainder=False)


@pytest.fixture(scope="module")
def worker_batches(store: Callable[..., str]) -> list[Any]:
    jax.devices()  # the consuming process holds a JAX backend; the workers must not
    src = CountingSource(gr.open_source(store(100)))
    ops = [ProbeProcess(), AddDoubledReward()]
    return list(_loader(src, worker_count=2, operations=ops, **WORKER_RUN))


@pytest.fixture(scope="module")
def inline_batches(store: Callable[..., str]) -> list[Any]:
    return list(_loader(gr.open_source(store(100)), worker_count=0, **WORKER_RUN))


def _source_fields(batch: Any) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k in _tree(1)}


def test_same_stream_for_worker_counts_zero_and_two(
    worker_batches: list[Any], inline_batches: list[Any]
) -> None:
    assert len(inline_batches) == 2 * 13
    _assert_streams_equal([_source_fields(b) for b in worker_batches], inline_batches)


def test_one_read_batch_call_per_batch_with_workers(
    worker_batches: list[Any], store: Callable[..., str]
) -> None:
    reads = _reads(gr.open_source(store(100)), **WORKER_RUN)
    assert len(worker_batches) == len(reads)
    for g, batch in enumerate(worker_batches):
        np.testing.assert_array_equal(batch["id"], reads.record_ids(g))
    _assert_one_read_per_batch(worker_batches)  # CountingSource.__getitem__ would raise
    assert os.getpid() not in {int(b["_pid"][0]) for b in worker_batches}


def test_operations_run_on_host_batches_with_workers(
    worker_batches: list[Any], inline_batches: list[Any]
) -> None:
    for got, want in zip(worker_batches, inline_batches, strict=True):
        np.testing.assert_array_equal(got["reward2"], want["reward"] * 2)
        assert got["reward2"].shape == got["pid"].shape == (len(want["id"]),)


def test_operations_run_on_host_batches_without_workers(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    plain = list(_loader(src, **WORKER_RUN))
    mapped = list(_loader(src, operations=[AddDoubledReward(), ProbeProcess()], **WORKER_RUN))
    assert len(mapped) == len(plain) == 26
    for got, want in zip(mapped, plain):
        np.testing.assert_array_equal(got["reward2"], want["reward"] * 2)
        _assert_trees_equal(_source_fields(got), want)
        assert set(got["pid"].tolist()) == {os.getpid()}
        assert int(got["jax_backends"][0]) >= 1  # the probe does see this process's backend


def test_workers_never_initialize_a_jax_backend(worker_batches: list[Any]) -> None:
    pids = {int(p) for b in worker_batches for p in b["pid"]}
    assert os.getpid() not in pids
    assert 1 <= len(pids) <= 2
    assert {int(x) for b in worker_batches for x in b["jax_backends"]} == {0}
    assert {int(p) for b in worker_batches for p in b["_pid"]} == pids  # read where mapped


_SCRIPT = textwrap.dedent(
    """
    import sys

    import numpy as np

    import grain_replay as gr


    def main() -> None:
        src = gr.open_source(sys.argv[1])
        loader = gr.make_data_loader(src, batch_size=8, num_epochs=1, seed=0, worker_count=2)
        batches = 0
        checksum = 0
        for batch in loader:
            batches += 1
            checksum += int(np.asarray(batch["id"]).sum() * 1000 + batch["action"].sum())
        print(f"batches={batches} checksum={checksum}")


    if __name__ == "__main__":
        main()
    """
)


def test_workers_start_from_a_plain_script(store: Callable[..., str], tmp_path: Any) -> None:
    path = store(100)
    script = tmp_path / "plain_script.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), path],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    src = gr.open_source(path)
    reads = _reads(src, batch_size=8, seed=0)
    tree = _tree(100)
    want = sum(
        int(reads.record_ids(g).sum() * 1000 + tree["action"][reads.record_ids(g)].sum())
        for g in range(len(reads))
    )
    assert f"batches={len(reads)} checksum={want}" in proc.stdout, (proc.stdout, proc.stderr)
    assert "UnparsedFlagAccessError" not in proc.stderr


# -- sharding over processes ---------------------------------------------------------


def test_two_shards_are_disjoint_and_cover_the_epoch(store: Callable[..., str]) -> None:
    n, b = 100, 8
    src = gr.open_source(store(n))
    shards = []
    for i in range(2):
        opts = grain.sharding.ShardOptions(shard_index=i, shard_count=2, drop_remainder=True)
        shards.append(_ids(_loader(src, batch_size=b, seed=6, num_epochs=2, shard_options=opts)))
    per_epoch = (n // (b * 2)) * 2
    assert len(shards[0]) == len(shards[1]) == per_epoch  # per_epoch / 2 batches, 2 epochs
    reads = _reads(src, shard_count=2, batch_size=b, seed=6, num_epochs=2)
    assert reads.batches_per_epoch == per_epoch
    every = {reads.record_ids(g).tobytes() for g in range(2 * per_epoch)}
    seen = [x.tobytes() for shard in shards for x in shard]
    assert len(set(seen)) == len(seen) and set(seen) == every
    half = per_epoch // 2
    for epoch in range(2):
        a = np.concatenate(shards[0][epoch * half : (epoch + 1) * half])
        c = np.concatenate(shards[1][epoch * half : (epoch + 1) * half])
        assert np.intersect1d(a, c).size == 0
        both = np.concatenate([a, c])
        assert len(np.unique(both)) == len(both) == per_epoch * b


def test_default_shard_options_shard_by_jax_process(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    default = _ids(gr.make_data_loader(src, batch_size=8, seed=1))
    explicit = _ids(_loader(src, batch_size=8, seed=1))
    assert jax.process_count() == 1
    assert len(default) == len(explicit) == 12
    for a, b in zip(default, explicit):
        np.testing.assert_array_equal(a, b)


def test_two_shards_without_drop_remainder_raise_value_error(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    opts = grain.sharding.ShardOptions(shard_index=0, shard_count=2, drop_remainder=True)
    with pytest.raises(ValueError, match="drop_remainder"):
        gr.make_data_loader(src, batch_size=8, drop_remainder=False, shard_options=opts)
    with pytest.raises(ValueError, match="drop_remainder"):
        gr.replay_dataset(src, batch_size=8, drop_remainder=False, shard_options=opts)


def test_store_smaller_than_one_batch_per_shard_raises(store: Callable[..., str]) -> None:
    src = gr.open_source(store(10))
    opts = grain.sharding.ShardOptions(shard_index=0, shard_count=2, drop_remainder=True)
    with pytest.raises(ValueError, match="batch_size"):
        gr.make_data_loader(src, batch_size=8, shard_options=opts)


# -- checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize("worker_count", [0, 2])
def test_set_state_resumes_identical_stream(store: Callable[..., str], worker_count: int) -> None:
    path = store(100)
    kwargs = dict(batch_size=8, seed=9, num_epochs=2, worker_count=worker_count)
    reference = list(_loader(gr.open_source(path), **{**kwargs, "worker_count": 0}))
    total = len(reference)
    rng = np.random.default_rng(worker_count)
    points = [int(rng.integers(1, total))]
    if worker_count == 0:  # workers take seconds to start: one point there
        points += [0, 12, int(rng.integers(1, total))]
    for k in points:
        it = iter(_loader(gr.open_source(path), **kwargs))
        head = [next(it) for _ in range(k)]
        state = it.get_state()
        rest = list(it)
        _assert_streams_equal(head + rest, reference)
        resumed = iter(_loader(gr.open_source(path), **kwargs))  # a fresh source and loader
        resumed.set_state(state)
        _assert_streams_equal(list(resumed), reference[k:])


@pytest.mark.parametrize("worker_count", [0, 2])
def test_get_state_at_a_position_is_the_state_after_that_many_batches(
    store: Callable[..., str], worker_count: int
) -> None:
    # sharded_device_put reads ahead and asks for the state of the last batch it handed
    # out only at a checkpoint: get_state_at(k) must be the bytes get_state() gave then
    loader = _loader(gr.open_source(store(100)), batch_size=8, seed=5, num_epochs=None,
                     worker_count=worker_count)  # fmt: skip
    with iter(loader) as it:
        states = [it.get_state()]
        for _ in range(15):  # past an epoch (12 batches)
            next(it)
            states.append(it.get_state())
        assert it.position == 15
        assert [it.get_state_at(k) for k in range(16)] == states
        assert it.get_state_at(it.position) == it.get_state()


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("worker_count", [0, 2])
@needs_8_devices
def test_device_put_resumes_identical_stream(
    store: Callable[..., str], prefetch: int, worker_count: int
) -> None:
    path = store(100)
    b = 16
    kwargs = dict(batch_size=b, seed=13, num_epochs=2, worker_count=worker_count)
    reference = list(_loader(gr.open_source(path), **{**kwargs, "worker_count": 0}))
    total = len(reference)
    assert total == 12
    rng = np.random.default_rng(prefetch + 10 * worker_count)
    k1, k2 = sorted(int(k) for k in rng.choice(np.arange(1, total), 2, replace=False))

    states = {}
    got = []
    with gr.sharded_device_put(_loader(gr.open_source(path), **kwargs), prefetch=prefetch) as it:
        for step, arrays in enumerate(it, start=1):
            for leaf in jax.tree_util.tree_leaves(arrays):
                assert isinstance(leaf, jax.Array)
                assert leaf.shape[0] == b
                assert isinstance(leaf.sharding, NamedSharding)
                assert len(leaf.sharding.device_set) == 8
            got.append(jax.tree_util.tree_map(np.asarray, arrays))
            if step in (k1, k2):
                states[step] = it.get_state()
    _assert_streams_equal(got, reference, on_device=True)

    fresh = _loader(gr.open_source(path), **kwargs)
    with gr.sharded_device_put(fresh, prefetch=prefetch) as it:
        it.set_state(states[k1])
        _assert_streams_equal(list(it), reference[k1:], on_device=True)
        if worker_count == 0:  # each set_state restarts grain's workers: seconds each
            it.set_state(states[k2])  # rewinding an exhausted wrapper works too
            _assert_streams_equal(list(it), reference[k2:], on_device=True)


# -- argument errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, option",
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=-4), ValueError, "batch_size"),
        (dict(batch_size=2.5), TypeError, "batch_size"),
        (dict(batch_size="8"), TypeError, "batch_size"),
        (dict(batch_size=True), TypeError, "batch_size"),
        (dict(batch_size=8, num_epochs=0), ValueError, "num_epochs"),
        (dict(batch_size=8, num_epochs=-1), ValueError, "num_epochs"),
        (dict(batch_size=8, seed=-1), ValueError, "seed"),
        (dict(batch_size=8, worker_count=-1), ValueError, "worker_count"),
        (dict(batch_size=101), ValueError, "batch_size"),
    ],
    ids=lambda x: repr(x) if isinstance(x, dict) else "",
)
def test_bad_options_raise_error_naming_the_option(
    store: Callable[..., str], kwargs: dict[str, Any], error: type[Exception], option: str
) -> None:
    src = gr.open_source(store(100))
    with pytest.raises(error, match=option):
        _loader(src, **kwargs)
    if "worker_count" not in kwargs:
        with pytest.raises(error, match=option):
            gr.replay_dataset(src, shard_options=NO_SHARDING, **kwargs)


def test_batch_larger_than_store_error_names_store_size(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    with pytest.raises(ValueError, match=r"100 records.*101"):
        _loader(src, batch_size=101)


@pytest.mark.parametrize("bad", ["2", None, 1.5], ids=["str", "None", "float"])
def test_non_int_worker_count_raises_type_error_naming_the_option(
    store: Callable[..., str], bad: Any
) -> None:
    src = gr.open_source(store(100))
    with pytest.raises(TypeError, match="worker_count"):
        _loader(src, batch_size=8, worker_count=bad)


@pytest.mark.parametrize("option", ["batch_size", "seed", "num_epochs"])
def test_numpy_integer_options_are_accepted(store: Callable[..., str], option: str) -> None:
    src = gr.open_source(store(100))
    kwargs: dict[str, Any] = dict(batch_size=8, seed=3, num_epochs=1)
    want = _ids(_loader(src, **kwargs))
    kwargs[option] = np.int64(kwargs[option])
    got = _ids(_loader(src, **kwargs))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("option", ["seed", "num_epochs"])
def test_bool_options_raise_type_error(store: Callable[..., str], option: str) -> None:
    src = gr.open_source(store(100))
    with pytest.raises(TypeError, match=option):
        _loader(src, batch_size=8, **{option: True})


# -- replay_dataset -------------------------------------------------------------------------


def test_replay_dataset_matches_data_loader(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    kwargs = dict(batch_size=8, seed=21, num_epochs=2, drop_remainder=False)
    from_loader = list(_loader(src, **kwargs))
    from_dataset = list(gr.replay_dataset(src, shard_options=NO_SHARDING, **kwargs))
    _assert_streams_equal(from_dataset, from_loader)
    default = list(gr.replay_dataset(src, **kwargs))  # ShardByJaxProcess, one process
    _assert_streams_equal(default, from_loader)


def test_replay_dataset_shards_match_data_loader_shards(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    for i in range(2):
        opts = grain.sharding.ShardOptions(shard_index=i, shard_count=2, drop_remainder=True)
        kwargs = dict(batch_size=8, seed=5, shard_options=opts)
        _assert_streams_equal(
            list(gr.replay_dataset(src, **kwargs)), list(gr.make_data_loader(src, **kwargs))
        )


def test_replay_dataset_map_composes(store: Callable[..., str]) -> None:
    src = gr.open_source(store(100))
    ds = gr.replay_dataset(src, batch_size=8, seed=1, shard_options=NO_SHARDING)
    assert isinstance(ds, grain.IterDataset)
    plain = list(ds)
    mapped = list(ds.map(AddDoubledReward()).map(lambda b: {**b, "n": b["id"] * 0 + 1}))
    assert len(mapped) == len(plain) == 12
    for got, want in zip(mapped, plain):
        np.testing.assert_array_equal(got["reward2"], want["reward"] * 2)
        np.testing.assert_array_equal(got["n"], np.ones(8, np.int64))
        np.testing.assert_array_equal(got["id"], want["id"])


def test_replay_dataset_checkpoint_round_trip(store: Callable[..., str]) -> None:
    path = store(100)

    def make() -> grain.IterDataset:
        return gr.replay_dataset(
            gr.open_source(path), batch_size=8, seed=3, num_epochs=2, shard_options=NO_SHARDING
        )

    reference = list(make())
    for k in [0, 5, 12, 23]:
        it = iter(make())
        for _ in range(k):
            next(it)
        state = it.get_state()
        resumed = iter(make())
        resumed.set_state(state)
        _assert_streams_equal(list(resumed), reference[k:])
        _assert_streams_equal(list(it), reference[k:])
