"""Device-resident replay: sharded_device_put(loader, resident=True) against the host pipeline."""

from __future__ import annotations

import os

# Must precede the first jax import: 8 fake CPU devices, as `make test` runs.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import gc
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from loader_ops import Grow

import grain_replay as gr
from grain_replay.device import put as device_put_module
from grain_replay.device import put_options
from grain_replay.device import resident as resident_module
from grain_replay.device.put import ShardedDevicePutIterator
from grain_replay.device.resident import ResidentReplayIterator
from tests.helpers.counting_source import CountingSource

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 JAX devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
    "before JAX is first imported",
)

N = 203  # not a multiple of the batch: epochs drop (or keep) a remainder
# Batches gathered by one dispatch here: 8, not the default 64, whose gather program takes
# seconds to compile (once a process for each shape of store, batch and sharding: the
# programs are kept, device/resident_programs.py); 8 still makes several windows an
# epoch (keep-remainder: the short batch that does not split is read ahead while full
# batches are still queued, and refused only when the caller reaches it).
# These keep the default: a stream longer than one window of 64 (of one leaf: the program
# of 64 batches of the 5 leaves below took 7-10 s to compile), and the device bytes of two
# windows of 64.
SMALL_WINDOW = 8
DEFAULT_WINDOW = {
    "test_default_window_streams_past_its_first_window",
    "test_loads_only_rows_the_loader_was_made_with",
}


@pytest.fixture(autouse=True)
def _small_windows(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.name not in DEFAULT_WINDOW:
        monkeypatch.setattr(resident_module, "_MAX_WINDOW", SMALL_WINDOW)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Leaves of every kind a batch carries: nested, float64 (float32 on device), bool, int64."""
    rng = np.random.default_rng(7)
    path = str(tmp_path_factory.mktemp("resident") / "store")
    gr.write(
        path,
        {
            "id": np.arange(N, dtype=np.int64),
            "obs": {
                "pixels": rng.integers(0, 256, (N, 4, 3), dtype=np.uint8),
                "vec": rng.standard_normal((N, 5)),
            },
            "reward": rng.standard_normal(N).astype(np.float32),
            "done": rng.random(N) < 0.3,
        },
        format="npy",
    )
    return path


def _numpy(batch: Any) -> Any:
    return jax.tree.map(np.asarray, batch)


def _assert_same_batches(host: list[Any], resident: list[Any]) -> None:
    assert len(resident) == len(host)
    for step, (h, r) in enumerate(zip(host, resident, strict=True)):
        assert jax.tree.structure(h) == jax.tree.structure(r), step
        for a, b in zip(jax.tree.leaves(h), jax.tree.leaves(r), strict=True):
            assert a.dtype == b.dtype, step
            assert a.sharding == b.sharding, step
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {step}")


@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_size=16, num_epochs=2),
        dict(batch_size=16, num_epochs=2, shuffle=False),
        dict(batch_size=24, num_epochs=2, drop_remainder=False, seed=5),  # short batch of 11*8
        dict(batch_size=8, num_epochs=3, seed=11),  # more steps than one gathered window
    ],
    ids=["shuffled", "in-order", "keep-remainder", "many-windows"],
)
def test_yields_host_pipeline_batches_same_order_sharding_dtypes(store: str, kw: Any) -> None:
    src = gr.open_source(store)
    loader = gr.make_data_loader(src, **kw)
    if kw.get("drop_remainder", True):
        host = list(gr.sharded_device_put(loader))
        resident = list(gr.sharded_device_put(loader, resident=True))
        _assert_same_batches(host, resident)
        assert len(host) == kw["num_epochs"] * (N // kw["batch_size"])
    else:
        # The short last batch (11 records) does not split over 8 devices: both paths say so.
        host_it = gr.sharded_device_put(loader, prefetch=0)
        res_it = gr.sharded_device_put(loader, resident=True)
        full = N // 24
        _assert_same_batches(
            [next(host_it) for _ in range(full)], [next(res_it) for _ in range(full)]
        )
        with pytest.raises(gr.BatchShardingError, match="11"):
            next(host_it)
        with pytest.raises(gr.BatchShardingError, match="11 records per process"):
            next(res_it)


def test_default_window_streams_past_its_first_window(tmp_path: Path) -> None:
    n = 64  # batches of 8, one record per device: 200 steps, 3 windows of 64 and 8 more
    gr.write(str(tmp_path / "s"), {"x": np.arange(n, dtype=np.int32)}, format="npy")
    loader = gr.make_data_loader(gr.open_source(str(tmp_path / "s")), batch_size=8, num_epochs=25)
    res = gr.sharded_device_put(loader, resident=True)
    assert res.window == 64
    _assert_same_batches(list(gr.sharded_device_put(loader)), list(res))


def test_keeps_short_last_batch_that_splits(tmp_path: Path) -> None:
    n = 72  # batch 32: epochs of 32, 32 and a short 8
    gr.write(str(tmp_path / "s"), {"x": np.arange(n, dtype=np.float32)}, format="npy")
    loader = gr.make_data_loader(
        gr.open_source(str(tmp_path / "s")), batch_size=32, num_epochs=2, drop_remainder=False
    )
    host = list(gr.sharded_device_put(loader))
    resident = list(gr.sharded_device_put(loader, resident=True))
    assert [b["x"].shape[0] for b in resident] == [32, 32, 8, 32, 32, 8]
    _assert_same_batches(host, resident)


@pytest.mark.parametrize("kind", ["mesh", "named-2d"])
def test_follows_mesh_and_named_sharding(store: str, kind: str) -> None:
    devices = np.array(jax.devices()).reshape(4, 2)
    mesh = Mesh(devices, ("data", "model"))
    sharding: Any = mesh if kind == "mesh" else NamedSharding(mesh, PartitionSpec("model"))
    loader = gr.make_data_loader(gr.open_source(store), batch_size=16, num_epochs=1)
    host = list(gr.sharded_device_put(loader, sharding))
    resident = list(gr.sharded_device_put(loader, sharding, resident=True))
    _assert_same_batches(host, resident)
    spec = resident[0]["reward"].sharding.spec
    assert spec[0] == ("data" if kind == "mesh" else "model")


def test_resumes_mid_epoch_from_its_own_and_the_host_state(store: str) -> None:
    loader = gr.make_data_loader(gr.open_source(store), batch_size=16, num_epochs=2, seed=3)
    host_all = [_numpy(b) for b in gr.sharded_device_put(loader)]
    k = 7  # mid-epoch (12 batches per epoch), and mid-window after the resume below

    res = gr.sharded_device_put(loader, resident=True)
    host = gr.sharded_device_put(loader)
    for _ in range(k):
        next(res)
        next(host)
    state = res.get_state()
    assert state == host.get_state()  # the same checkpoint bytes
    rest = [_numpy(b) for b in res]
    assert len(rest) == len(host_all) - k
    for a, b in zip(rest, host_all[k:], strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)

    # A fresh resident iterator restored from the host's bytes, and the reverse.
    fresh = gr.sharded_device_put(loader, resident=True)
    fresh.set_state(host.get_state())
    jax.tree.map(np.testing.assert_array_equal, _numpy(next(fresh)), host_all[k])
    back = gr.sharded_device_put(loader)
    back.set_state(fresh.get_state())
    jax.tree.map(np.testing.assert_array_equal, _numpy(next(back)), host_all[k + 1])


def test_each_window_gathers_ids_sent_one_window_before(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Record ids travel a window ahead: every gather after the first takes ids put while
    the window before it was handed out, never a put made for it in the same call; a
    set_state elsewhere drops the ids sent ahead and the stream stays the loader's."""
    loader = gr.make_data_loader(gr.open_source(store), batch_size=8, num_epochs=3, seed=2)
    host_all = [_numpy(b) for b in gr.sharded_device_put(loader)]
    res = gr.sharded_device_put(loader, resident=True)
    events: list[tuple[str, int]] = []
    put, gather = res._ids_block, res._gather

    def counted_put(block: np.ndarray) -> Any:
        ids = put(block)
        events.append(("put", id(ids)))
        return ids

    def counted_gather(store_: Any, ids: Any) -> Any:
        events.append(("gather", id(ids)))
        return gather(store_, ids)

    monkeypatch.setattr(res, "_ids_block", counted_put)
    monkeypatch.setattr(res, "_gather", counted_gather)
    got = []
    for b in res:
        got.append(_numpy(b))
        events.append(("handed out", len(got)))
    assert len(got) == len(host_all) == 3 * (N // 8)
    for a, b in zip(got, host_all, strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)
    gathers = [i for i, (kind, _) in enumerate(events) if kind == "gather"]
    assert len(gathers) == -(-len(host_all) // SMALL_WINDOW)
    for g in gathers[1:]:
        # its ids: put right after the gather before it, batches handed out in between
        sent = next(i for i, e in enumerate(events) if e == ("put", events[g][1]))
        assert events[sent - 1][0] == "gather", events[: g + 1]
        assert sum(kind == "handed out" for kind, _ in events[sent:g]) >= SMALL_WINDOW // 2 - 1
    assert sum(kind == "put" for kind, _ in events) == len(gathers)  # none past the end

    events.clear()
    k = 2 * SMALL_WINDOW + 3  # mid-window, not where the ids sent ahead start
    res = gr.sharded_device_put(loader, resident=True)
    next(res)
    res.set_state(gr.sharded_device_put(loader, resident=True).get_state())  # back to 0
    for _ in range(k):
        next(res)
    state = res.get_state()
    res.set_state(state)
    rest = [_numpy(b) for b in res]
    for a, b in zip(rest, host_all[k:], strict=True):
        jax.tree.map(np.testing.assert_array_equal, a, b)


def test_state_bytes_match_worker_loader(store: str) -> None:
    loader = gr.make_data_loader(gr.open_source(store), batch_size=16, worker_count=2)
    res = gr.sharded_device_put(loader, resident=True)
    with gr.sharded_device_put(loader, prefetch=0) as host:
        for _ in range(5):
            jax.tree.map(np.testing.assert_array_equal, _numpy(next(res)), _numpy(next(host)))
            assert res.get_state() == host.get_state()


def test_set_state_refuses_state_of_another_loader(store: str) -> None:
    src = gr.open_source(store)
    a = gr.make_data_loader(src, batch_size=16, seed=1)
    b = gr.make_data_loader(src, batch_size=8, seed=1)
    res = gr.sharded_device_put(a, resident=True)
    with pytest.raises(gr.CheckpointMismatchError, match="Sampler in checkpoint"):
        res.set_state(gr.sharded_device_put(b).get_state())


def test_refuses_store_over_budget_naming_need_and_budget(store: str) -> None:
    loader = gr.make_data_loader(gr.open_source(store), batch_size=16)
    with pytest.raises(gr.ResidentBudgetError) as info:
        gr.sharded_device_put(loader, resident=True, budget_bytes=1000)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "1,000 B per device (budget_bytes)" in message
    assert f"{N:,} records" in message
    assert "resident='auto'" in message


def test_auto_falls_back_to_host_pipeline_with_warning(
    store: str, caplog: pytest.LogCaptureFixture
) -> None:
    loader = gr.make_data_loader(gr.open_source(store), batch_size=16)
    with caplog.at_level(logging.WARNING, logger=resident_module.__name__):
        it = gr.sharded_device_put(loader, resident="auto", budget_bytes=1000)
    assert isinstance(it, ShardedDevicePutIterator)
    assert "budget" in caplog.text
    _assert_same_batches(list(gr.sharded_device_put(loader)), list(it))
    fits = gr.sharded_device_put(loader, resident="auto")
    assert isinstance(fits, ResidentReplayIterator)


def test_refuses_what_it_cannot_replay(store: str) -> None:
    src = gr.open_source(store)
    loader = gr.make_data_loader(src, batch_size=16)
    with pytest.raises(gr.ResidentUnsupportedError, match="not an iterator"):
        gr.sharded_device_put(iter(loader), resident=True)
    mapped = gr.make_data_loader(src, batch_size=16, operations=[Grow()])
    with pytest.raises(gr.ResidentUnsupportedError, match="host operation"):
        gr.sharded_device_put(mapped, resident=True)
    tree = {"id": NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec("d"))}
    with pytest.raises(gr.ResidentUnsupportedError, match="NamedSharding"):
        gr.sharded_device_put(loader, tree, resident=True)
    assert isinstance(gr.sharded_device_put(mapped, resident="auto"), ShardedDevicePutIterator)


def test_refuses_sampling_loader_naming_its_sampling_and_auto_falls_back(store: str) -> None:
    src = gr.open_source(store)
    for loader in (
        gr.make_data_loader(src, batch_size=16, sampling=gr.UniformReplay()),
        gr.make_data_loader({"a": src, "b": src}, weights={"a": 0.5, "b": 0.5}, batch_size=16),
    ):
        with pytest.raises(gr.ResidentUnsupportedError, match="samples otherwise") as info:
            gr.sharded_device_put(loader, resident=True)
        assert "resident=False" in str(info.value)
        it = gr.sharded_device_put(loader, resident="auto")
        assert isinstance(it, ShardedDevicePutIterator)
        assert next(it)["id"].shape[0] == 16
        it.close()


def test_raises_error_invalid_arguments(store: str) -> None:
    loader = gr.make_data_loader(gr.open_source(store), batch_size=16)
    with pytest.raises(ValueError, match="resident must be"):
        gr.sharded_device_put(loader, resident="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget_bytes must be"):
        gr.sharded_device_put(loader, resident=True, budget_bytes=-1)
    with pytest.raises(ValueError, match="budget_bytes applies"):
        gr.sharded_device_put(loader, budget_bytes=10)
    uneven = gr.make_data_loader(gr.open_source(store), batch_size=12)
    with pytest.raises(gr.BatchShardingError, match="multiple of 8"):
        gr.sharded_device_put(uneven, resident=True)


def test_loads_store_in_chunks_then_never_reads_it(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = CountingSource(gr.open_source(store))
    record_bytes = 4 + 12 + 5 * 4 + 4 + 1  # on device: id int32, pixels, vec float32, ...
    # 50 records' bytes: rounded up to 128 rows, a chunk starts a line of every buffer.
    monkeypatch.setattr(resident_module, "_CHUNK_BYTES", 50 * record_bytes)
    loader = gr.make_data_loader(src, batch_size=16, num_epochs=2)
    res = gr.sharded_device_put(loader, resident=True)
    assert src.reads == [1, 128, 75]  # the probe, then chunks of 128 rows
    batches = list(res)
    assert len(src.reads) == 3  # every batch was gathered on the devices
    _assert_same_batches(list(gr.sharded_device_put(loader)), batches)


def test_loads_only_rows_the_loader_was_made_with(tmp_path: Path) -> None:
    path = str(tmp_path / "grow")
    with gr.ReplayWriter(path, format="npy") as w:
        w.append({"x": np.arange(64, dtype=np.int32)})
        w.flush()
        src = gr.open_source(path)
        loader = gr.make_data_loader(src, batch_size=16, num_epochs=1)
        w.append({"x": np.arange(64, 80, dtype=np.int32)})
        w.flush()
    res = gr.sharded_device_put(loader, resident=True)
    # 64 rows of one word: half a line of 128 lanes, a TPU tile (8 lines) as the device
    # holds it; and two windows of 64 steps of 2 rows per device (row and int32 id).
    assert res.store_bytes == 8 * 128 * 4
    assert res.device_bytes == res.store_bytes + 2 * 64 * 2 * (4 + 4)
    seen = np.concatenate([np.asarray(b["x"]) for b in res])
    np.testing.assert_array_equal(np.sort(seen), np.arange(64))


def test_close_releases_store_and_ends_iteration_for_good(store: str) -> None:
    loader = gr.make_data_loader(gr.open_source(store), batch_size=16, num_epochs=None)
    with gr.sharded_device_put(loader, resident=True) as res:
        state = res.get_state()
        next(res)
        # The store's replicas: one buffer per layout and width of leaves.
        shapes = {a.shape for a in res._store}
        held = sum(a.shape in shapes for a in jax.live_arrays())
    assert len(shapes) >= 2
    gc.collect()
    assert sum(a.shape in shapes for a in jax.live_arrays()) <= held - len(shapes)
    with pytest.raises(StopIteration):
        next(res)
    res.set_state(state)
    with pytest.raises(StopIteration):
        next(res)


@pytest.mark.parametrize("pinned", [False, True])
def test_pinned_staging_yields_same_device_arrays(store: str, pinned: bool) -> None:
    loader = gr.make_data_loader(gr.open_source(store), batch_size=16)
    plain = list(gr.sharded_device_put(loader))
    staged = list(gr.sharded_device_put(loader, pinned=pinned))
    _assert_same_batches(plain, staged)
    assert all(a.sharding.memory_kind == "device" for a in jax.tree.leaves(staged))


def test_pinned_staging_stages_through_pinned_host(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device_put_module.has_pinned_host()  # jax's CPU backend has pinned_host memory
    kinds: list[str | None] = []
    real = jax.make_array_from_callback

    def spy(shape: Any, sharding: Any, cb: Any, *args: Any, **kw: Any) -> Any:
        kinds.append(sharding.memory_kind)
        return real(shape, sharding, cb, *args, **kw)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    batch = {"x": np.arange(16, dtype=np.float32)}
    (out,) = list(gr.sharded_device_put([batch], pinned=True, prefetch=0))
    assert kinds == ["pinned_host"]
    assert out["x"].sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(out["x"]), batch["x"])


def test_pinned_staging_falls_back_without_pinned_host(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(put_options, "has_pinned_host", lambda: False)
    batch = {"x": np.arange(16, dtype=np.float32)}
    with caplog.at_level(logging.WARNING, logger=device_put_module.__name__):
        (out,) = list(gr.sharded_device_put([batch], pinned=True))
    assert "no pinned_host memory" in caplog.text
    np.testing.assert_array_equal(np.asarray(out["x"]), batch["x"])


def test_packs_leaves_of_every_width_bit_exact(tmp_path: Path) -> None:
    """Leaves share a packed row per dtype width; -0.0, NaN payloads and complex survive."""
    rng = np.random.default_rng(3)
    n = 64
    f32 = rng.standard_normal((n, 3)).astype(np.float32)
    f32[0, 0] = -0.0
    f32[1, 1] = np.frombuffer(np.uint32(0x7FC00123).tobytes(), np.float32)[0]  # NaN payload
    tree = {
        "f32": f32,
        "i32": rng.integers(-(2**31), 2**31 - 1, (n, 2), dtype=np.int32),
        "f16": rng.standard_normal((n, 2, 2)).astype(np.float16),
        "i16": rng.integers(-300, 300, n, dtype=np.int16),
        "i8": rng.integers(-128, 127, (n, 5), dtype=np.int8),
        "u8": rng.integers(0, 255, (n, 1), dtype=np.uint8),
        "b": rng.random((n, 2)) < 0.5,
        "c64": (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64),
    }
    gr.write(str(tmp_path / "w"), tree, format="npy")
    loader = gr.make_data_loader(gr.open_source(str(tmp_path / "w")), batch_size=16, num_epochs=2)
    host = list(gr.sharded_device_put(loader))
    resident = list(gr.sharded_device_put(loader, resident=True))
    _assert_same_batches(host, resident)
    for h, r in zip(host, resident, strict=True):  # bit patterns, not just values
        np.testing.assert_array_equal(
            np.asarray(h["f32"]).view(np.uint32), np.asarray(r["f32"]).view(np.uint32)
        )
