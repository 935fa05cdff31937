"""Tests for grain_replay.device.put.sharded_device_put."""

from __future__ import annotations

import os

# Must precede the first jax import: 8 fake CPU devices, as `make test` runs.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import gc
import random
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from grain_replay.device import put_options
from grain_replay.device.put import (
    InvalidPrefetchError,
    InvalidShardingError,
    ShardedDevicePutIterator,
    UnsupportedStateError,
    sharded_device_put,
)
from grain_replay.errors import BatchShardingError, GrainReplayError

needs_8_devices = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 JAX devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
    "before JAX is first imported",
)


@pytest.fixture(params=[False, True], ids=["thread", "inline"])
def feed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways of reading ahead: a producer thread, or the caller's own (the TPU's)."""
    monkeypatch.setattr(put_options, "INLINE", request.param)
    return bool(request.param)


class Transition(NamedTuple):
    obs: dict[str, np.ndarray]
    action: np.ndarray
    extras: tuple[np.ndarray, list[np.ndarray]]


def _dict_batch(i: int, rows: int = 16) -> dict[str, Any]:
    base = i * 1000
    return {
        "obs": {
            "pixels": (np.arange(rows * 12, dtype=np.uint8) + i).reshape(rows, 3, 4),
            "vec": np.arange(base, base + rows * 3, dtype=np.float32).reshape(rows, 3),
        },
        "reward": np.arange(base, base + rows, dtype=np.float32),
    }


def _tuple_batch(i: int, rows: int = 16) -> Transition:
    d = _dict_batch(i, rows)
    act = np.arange(rows, dtype=np.int32) + i
    return Transition(obs=d["obs"], action=act, extras=(d["reward"], [act * 2]))


def _mesh_1d() -> Mesh:
    return Mesh(np.array(jax.devices()), ("data",))


def _mesh_2d() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))


def _to_numpy(tree: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, tree)


def _assert_sharded(arrays: Any, host: Any, shardings: Any) -> None:
    """Each leaf: global shape, sharding, per-device rows and values equal the host batch."""
    host_leaves, host_def = jax.tree_util.tree_flatten(host)
    out_leaves, out_def = jax.tree_util.tree_flatten(arrays)
    assert out_def == host_def
    if isinstance(shardings, Sharding):
        shardings = [shardings] * len(host_leaves)
    for out, expected, sharding in zip(out_leaves, host_leaves, shardings, strict=True):
        assert isinstance(out, jax.Array)
        assert out.shape == expected.shape  # one process: global batch == local batch
        assert out.dtype == expected.dtype
        assert out.sharding.is_equivalent_to(sharding, expected.ndim)
        wanted = sharding.devices_indices_map(expected.shape)
        for shard in out.addressable_shards:
            assert shard.index == wanted[shard.device]
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
        np.testing.assert_array_equal(np.asarray(out), expected)


class StatefulIterator:
    """Minimal grain-like iterator: state is the index of the next batch."""

    def __init__(self, n: int, make: Any = _dict_batch) -> None:
        self._n, self._make, self._index = n, make, 0

    def __iter__(self) -> StatefulIterator:
        return self

    def __next__(self) -> Any:
        if self._index >= self._n:
            raise StopIteration
        self._index += 1
        return self._make(self._index - 1)

    def get_state(self) -> dict[str, int]:
        return {"index": self._index}

    def set_state(self, state: dict[str, int]) -> None:
        self._index = state["index"]


class _LoaderError(RuntimeError):
    pass


def _failing_batches(k: int) -> Iterator[dict[str, Any]]:
    for i in range(k):
        yield _dict_batch(i)
    raise _LoaderError(f"disk vanished at batch {k}")


@needs_8_devices
@pytest.mark.parametrize("make", [_dict_batch, _tuple_batch], ids=["dict", "namedtuple"])
def test_yields_global_sharded_arrays_default_sharding(make: Any) -> None:
    expected = NamedSharding(_mesh_1d(), PartitionSpec("data"))
    hosts = [make(i) for i in range(3)]
    with sharded_device_put(iter(hosts)) as it:
        outs = list(it)
    assert len(outs) == 3
    for out, host in zip(outs, hosts, strict=True):
        _assert_sharded(out, host, expected)
    assert isinstance(outs[1], Transition if make is _tuple_batch else dict)
    # device k of the 1-D mesh holds rows 2k:2k+2 of a 16-row batch
    rewards = [o["reward"] if isinstance(o, dict) else o.extras[0] for o in (outs[0], hosts[0])]
    for shard in rewards[0].addressable_shards:
        k = jax.devices().index(shard.device)
        np.testing.assert_array_equal(np.asarray(shard.data), rewards[1][2 * k : 2 * k + 2])


@needs_8_devices
def test_shards_over_first_axis_mesh_argument() -> None:
    mesh = _mesh_2d()
    hosts = [_tuple_batch(i, rows=8) for i in range(2)]
    outs = list(sharded_device_put(hosts, mesh, prefetch=1))
    for out, host in zip(outs, hosts, strict=True):
        _assert_sharded(out, host, NamedSharding(mesh, PartitionSpec("x")))
        # replicated over "y": the two devices of a row of the mesh hold the same 2 rows
        rows = {s.device: s.index[0] for s in out.action.addressable_shards}
        for a, b in mesh.devices:
            assert rows[a] == rows[b] and rows[a].stop - rows[a].start == 2


@needs_8_devices
def test_uses_sharding_as_is_named_sharding_argument() -> None:
    sharding = NamedSharding(_mesh_2d(), PartitionSpec(("x", "y")))
    hosts = [_dict_batch(i) for i in range(2)]
    outs = list(sharded_device_put(hosts, sharding))
    for out, host in zip(outs, hosts, strict=True):
        _assert_sharded(out, host, sharding)


@needs_8_devices
def test_uses_one_sharding_per_leaf_pytree_of_shardings() -> None:
    mesh = _mesh_2d()
    by_x = NamedSharding(mesh, PartitionSpec("x"))
    by_all = NamedSharding(mesh, PartitionSpec(("x", "y")))
    # a prefix tree: one sharding for the whole "obs" subtree, a Mesh leaf converted too
    shardings = {"obs": by_all, "reward": mesh}
    host = _dict_batch(0)
    (out,) = list(sharded_device_put([host], shardings, prefetch=0))
    _assert_sharded(out, host, [by_all, by_all, by_x])


@needs_8_devices
def test_matches_sharding_tree_per_structure_batches_of_two_structures() -> None:
    mesh = _mesh_2d()
    by_x = NamedSharding(mesh, PartitionSpec("x"))
    by_all = NamedSharding(mesh, PartitionSpec(("x", "y")))
    nested = _dict_batch(0)  # "obs" is a subtree of two leaves
    flat = {"obs": np.zeros((8, 3), np.float32), "reward": np.ones(8, np.float32)}
    bad = {"obs": np.zeros((8, 3), np.float32), "done": np.ones(8, bool)}
    hosts = [nested, flat, nested, flat, bad]
    it = sharded_device_put(iter(hosts), {"obs": by_all, "reward": by_x}, prefetch=0)
    for host in hosts[:-1]:  # the shardings worked out for one structure never leak into another
        want = [by_all, by_all, by_x] if host is nested else [by_all, by_x]
        _assert_sharded(next(it), host, want)
    with pytest.raises(BatchShardingError, match="prefix"):
        next(it)


@needs_8_devices
def test_names_leaf_uneven_batch_after_earlier_batches_of_same_structure() -> None:
    good = {"a": np.zeros((8,)), "b": {"c": np.zeros((8, 2)), "d": np.zeros((8,))}}
    bad = {"a": np.zeros((8,)), "b": {"c": np.zeros((8, 2)), "d": np.zeros((12,))}}
    it = sharded_device_put([good, good, bad], prefetch=0)
    next(it), next(it)
    with pytest.raises(BatchShardingError, match=r"Leaf 'b/d' .* 12,.* 8 process-local"):
        next(it)


def test_same_stream_prefetch_0_1_3(feed: bool) -> None:
    streams = []
    for prefetch in (0, 1, 3):
        streams.append(_to_numpy(list(sharded_device_put(StatefulIterator(7), prefetch=prefetch))))
    expected = [_dict_batch(i) for i in range(7)]
    for stream in streams:
        jax.tree_util.tree_map(np.testing.assert_array_equal, stream, expected)


@needs_8_devices
@pytest.mark.parametrize("prefetch", [0, 2])
def test_raises_batch_sharding_error_uneven_batch(prefetch: int) -> None:
    batches = [{"obs": np.zeros((250, 3), np.float32)}]
    it = sharded_device_put(batches, prefetch=prefetch)
    with pytest.raises(BatchShardingError) as info:
        next(it)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'obs'" in message and "250" in message and "8 process-local devices" in message
    assert "multiple of 8" in message and "248 or 256" in message
    with pytest.raises(StopIteration):
        next(it)


@needs_8_devices
def test_raises_batch_sharding_error_uneven_batch_over_mesh_first_axis() -> None:
    batch = {"a": np.zeros((8,)), "b": {"c": np.zeros((6, 2))}}
    with pytest.raises(BatchShardingError, match=r"'b/c'.* 6,.* 4 process-local.*4 or 8"):
        next(sharded_device_put([batch], _mesh_2d()))


def test_raises_error_naming_leaf_rank0_leaf() -> None:
    batch = {"obs": np.zeros((8, 2)), "step": np.int64(3)}
    with pytest.raises(BatchShardingError, match=r"'step' is a scalar \(rank 0\)"):
        next(sharded_device_put([batch], prefetch=1))


def test_raises_error_sharding_tree_mismatch() -> None:
    sharding = NamedSharding(_mesh_1d(), PartitionSpec("data"))
    with pytest.raises(BatchShardingError, match="prefix"):
        next(sharded_device_put([_dict_batch(0)], {"obs": sharding, "done": sharding}))


def test_raises_error_invalid_arguments() -> None:
    with pytest.raises(InvalidShardingError, match="Got str"):
        sharded_device_put([], "data")
    with pytest.raises(InvalidPrefetchError, match="got -1"):
        sharded_device_put([], prefetch=-1)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_reraises_iterator_error_after_earlier_batches(prefetch: int, feed: bool) -> None:
    it = sharded_device_put(_failing_batches(3), prefetch=prefetch)
    delivered = []
    with pytest.raises(_LoaderError, match="batch 3") as info:
        for batch in it:
            delivered.append(np.asarray(batch["reward"]))
    assert len(delivered) == 3
    for i, reward in enumerate(delivered):
        np.testing.assert_array_equal(reward, _dict_batch(i)["reward"])
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_failing_batches" in frames  # original traceback kept
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resumes_exact_stream_fresh_wrapper(prefetch: int, feed: bool) -> None:
    n = 9
    expected = [_dict_batch(i) for i in range(n)]
    rng = random.Random(prefetch)
    for k in sorted({0, n, *rng.sample(range(1, n), 3)}):
        first = sharded_device_put(StatefulIterator(n), prefetch=prefetch)
        for _ in range(k):
            next(first)
        state = first.get_state()
        assert state == {"index": k}  # the last batch handed out, not the prefetched ones
        first.close()
        resumed = sharded_device_put(StatefulIterator(n), prefetch=prefetch)
        resumed.set_state(state)
        rest = _to_numpy(list(resumed))
        assert len(rest) == n - k
        jax.tree_util.tree_map(np.testing.assert_array_equal, rest, expected[k:])


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resumes_exact_stream_same_wrapper_mid_stream(prefetch: int, feed: bool) -> None:
    expected = [_dict_batch(i) for i in range(10)]
    it = sharded_device_put(StatefulIterator(10), prefetch=prefetch)
    assert it.get_state() == {"index": 0}
    for _ in range(3):
        next(it)
    state = it.get_state()
    for _ in range(4):
        next(it)
    it.set_state(state)
    rest = _to_numpy(list(it))
    jax.tree_util.tree_map(np.testing.assert_array_equal, rest, expected[3:])
    it.set_state({"index": 8})  # also after exhaustion
    assert len(list(it)) == 2


class _Counting(StatefulIterator):
    pulled = 0

    def __next__(self) -> dict[str, Any]:
        batch = super().__next__()
        self.pulled += 1
        return batch


def test_inline_feed_reads_a_group_ahead_in_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(put_options, "INLINE", True)
    baseline = threading.active_count()
    inner = _Counting(40)
    it = sharded_device_put(inner, prefetch=2, packed=True)
    size = 16  # small batches: MAX_GROUP a packed transfer
    got = []
    for k in range(1, 41):
        got.append(_to_numpy(next(it)))
        assert not _producers() and threading.active_count() == baseline
        # the next group read (and put) while this one is consumed, never more; the
        # first batch is read alone (it says how batches move)
        low = k if k == 1 else min(40, k + 1)
        assert low <= inner.pulled <= min(40, k + size + size - 1)
        assert it.get_state() == {"index": k}  # the last batch handed out
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, [_dict_batch(i) for i in range(40)])
    with pytest.raises(StopIteration):
        next(it)


def test_leaf_by_leaf_puts_keep_the_producer_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(put_options, "INLINE", True)  # inline applies to packed transfers
    with sharded_device_put(StatefulIterator(6), prefetch=2, packed=False) as it:
        got = [_to_numpy(next(it)) for _ in range(3)]
        assert len(_producers()) == 1
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, [_dict_batch(i) for i in range(3)])
    assert not _producers()


def test_inline_feed_close_drops_what_was_read_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(put_options, "INLINE", True)
    it = sharded_device_put(_endless(), prefetch=2)
    next(it)
    it.close()
    with pytest.raises(StopIteration):
        next(it)


def test_get_state_is_copy_before_first_batch() -> None:
    it = sharded_device_put(StatefulIterator(5), prefetch=3)
    state = it.get_state()
    state["index"] = 99
    assert it.get_state() == {"index": 0}
    next(it)
    assert it.get_state() == {"index": 1}
    it.close()


def test_raises_unsupported_state_error_stateless_iterator() -> None:
    it = sharded_device_put(iter([_dict_batch(0)]))
    with pytest.raises(UnsupportedStateError, match="no get_state") as info:
        it.get_state()
    assert isinstance(info.value, TypeError) and isinstance(info.value, GrainReplayError)
    with pytest.raises(UnsupportedStateError):
        it.set_state({"index": 0})


def test_wraps_iterable_once_non_iterator() -> None:
    it = sharded_device_put([_dict_batch(0), _dict_batch(1)], prefetch=0)
    assert isinstance(it, ShardedDevicePutIterator) and iter(it) is it
    assert len(list(it)) == 2 and list(it) == []


def _endless() -> Iterator[dict[str, Any]]:
    i = 0
    while True:
        yield _dict_batch(i % 4)
        i += 1


def _wait_for_threads(baseline: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


def _producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sharded_device_put"]


def test_close_stops_thread_endless_iterator() -> None:
    baseline = threading.active_count()
    it = sharded_device_put(_endless(), prefetch=2)
    next(it), next(it)  # the first batch is read in the caller's thread, then the producer's
    assert len(_producers()) == 1 and threading.active_count() == baseline + 1
    it.close()
    assert not _producers() and threading.active_count() <= baseline
    with pytest.raises(StopIteration):
        next(it)
    with sharded_device_put(_endless(), prefetch=2) as it2:
        next(it2), next(it2)
    assert not _producers() and threading.active_count() <= baseline
    it3 = sharded_device_put(_endless(), prefetch=2)
    next(it3), next(it3)
    del it3  # __del__ signals the producer, which exits within its poll interval
    gc.collect()
    assert _wait_for_threads(baseline) <= baseline and not _producers()


def test_overlaps_loading_and_consuming_prefetch_2() -> None:
    n, delay = 20, 0.02
    serial = n * 2 * delay

    def slow() -> Iterator[dict[str, Any]]:
        for i in range(n):
            time.sleep(delay)
            yield _dict_batch(i % 2)

    def timed(prefetch: int) -> float:
        start = time.perf_counter()
        for batch in sharded_device_put(slow(), prefetch=prefetch):
            jax.block_until_ready(batch)
            time.sleep(delay)
        return time.perf_counter() - start

    list(sharded_device_put([_dict_batch(0)], prefetch=0))  # warm up jax outside the timing
    # Against prefetch=0 timed in turns, on the same machine load (a loaded machine adds
    # the same overhead to both); best of two. Ideal: serial / 2 against serial.
    overlapped, unprefetched = [], []
    for _ in range(2):
        overlapped.append(timed(2))
        unprefetched.append(timed(0))
    assert min(unprefetched) >= 0.95 * serial, unprefetched  # the sleeps alone take that long
    assert min(overlapped) < 0.8 * min(unprefetched), (
        f"no overlap: prefetch=2 took {overlapped}, prefetch=0 {unprefetched} (serial {serial}s)"
    )


@needs_8_devices
def test_jax_array_leaves_are_put_like_numpy_leaves() -> None:
    expected = NamedSharding(_mesh_1d(), PartitionSpec("data"))
    host = {"jax": jax.numpy.arange(16), "np": np.arange(16), "np64": np.arange(16.0)}
    with sharded_device_put(iter([host])) as it:
        out = next(it)
    for key in host:
        assert out[key].sharding == expected, key
        assert out[key].dtype == jax.device_put(host[key]).dtype, key  # x64 rules kept
        np.testing.assert_array_equal(np.asarray(out[key]), np.arange(16), key)


@needs_8_devices
def test_loader_batches_are_fresh_arrays_so_device_arrays_never_change(tmp_path: Any) -> None:
    import grain_replay as gr

    path = str(tmp_path / "s.npy")
    gr.write(path, {"x": np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)}, format="npy")
    loader = gr.make_data_loader(gr.open_source(path), batch_size=16, shuffle=False)
    with sharded_device_put(loader, prefetch=2) as it:
        outs = list(it)  # the host batches behind them are not reused for later batches
    for k, out in enumerate(outs):
        want = np.arange(k * 16 * 4096, (k + 1) * 16 * 4096, dtype=np.float32).reshape(16, 4096)
        np.testing.assert_array_equal(np.asarray(out["x"]), want)


def test_an_interrupt_while_waiting_for_the_producer_is_followed_by_a_clean_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ctrl-C in the caller's wait on the producer's queue: the wrapper forgot the producer
    # without stopping it, so set_state() moved the wrapped iterator under a thread still
    # reading it, and close() left that thread running for good
    from grain_replay.device import prefetch as prefetch_lib

    monkeypatch.setattr(put_options, "INLINE", False)
    real = prefetch_lib.Prefetcher.next
    calls = [0]

    def interrupted_once(self: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(prefetch_lib.Prefetcher, "next", interrupted_once)
    baseline = threading.active_count()
    it = sharded_device_put(StatefulIterator(1000), prefetch=2)
    next(it), next(it)  # the caller's thread, then the producer's first
    with pytest.raises(KeyboardInterrupt):
        next(it)
    state = it.get_state()
    assert state == {"index": 2}
    it.set_state(state)
    rest = _to_numpy([next(it) for _ in range(4)])
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, rest, [_dict_batch(i) for i in range(2, 6)]
    )
    it.close()
    assert _wait_for_threads(baseline) <= baseline and not _producers()
