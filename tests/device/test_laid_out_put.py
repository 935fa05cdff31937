"""sharded_device_put over a loader that lays batches out as the packed buffer (one device).

The loader's batches then go to the device as the buffer they lie in (no copy in the
consuming process). Every test compares with the leaf-by-leaf put (``packed=False``):
values bit for bit, dtypes, shapes, shardings, order and checkpoint bytes.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

import grain_replay as gr
from grain_replay.device import packed as packing
from grain_replay.device.converter import Converter
from grain_replay.device.packed import PackedLayout, laid_out
from grain_replay.pipeline.in_process import InProcessLoaderIterator
from grain_replay.pipeline.lanes import ROW_BYTES, LaneBuffer, lane_views
from grain_replay.pipeline.workers import WorkerLoaderIterator


def _one_device() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[-1:]), ("data",)), PartitionSpec("data"))


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(0)
    n = 96
    obs = rng.standard_normal((n, 6), dtype=np.float32)
    obs[0, 0] = np.nan  # compared bit for bit
    tree = {
        "obs": obs,
        "frame": rng.integers(0, 256, (n, 30, 40, 4), dtype=np.uint8),  # padded element rows
        "action": rng.integers(0, 9, n).astype(np.int32),
        "done": rng.random(n) < 0.3,
        "nested": {"u16": rng.integers(0, 60_000, (n, 3), dtype=np.uint16)},
    }
    p = str(tmp_path_factory.mktemp("laid") / "s.npy")
    gr.write(p, tree, format="npy")
    return p


def _assert_same(got: Any, want: Any) -> None:
    g, gt = jax.tree_util.tree_flatten(got)
    w, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt
    for a, b in zip(g, w, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _count_region_puts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = PackedLayout.put_regions

    def put_regions(self: PackedLayout, regions: Any) -> Any:
        calls.append(len(regions))
        return real(self, regions)

    monkeypatch.setattr(PackedLayout, "put_regions", put_regions)
    return calls


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("group_bytes", [0, 1 << 20], ids=["alone", "grouped"])
def test_a_laid_out_loader_stream_and_its_state_equal_the_leaf_puts(
    path: str, workers: int, group_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packing, "GROUP_BYTES", group_bytes)
    calls = _count_region_puts(monkeypatch)
    src = gr.open_source(path, keys=None if workers else ["obs", "action", "done", "nested/u16"])
    sharding = _one_device()

    def stream(packed: bool) -> tuple[list[Any], Any]:
        loader: Any = gr.make_data_loader(
            src, batch_size=8, seed=3, num_epochs=None, worker_count=workers
        )
        if packed and group_bytes:  # grouped: not asked by default, asked here
            loader = iter(loader)
            loader.lay_out_lanes()  # still put as they lie (the regions concatenated)
        with gr.sharded_device_put(loader, sharding, packed=packed) as it:
            out = [next(it) for _ in range(40)]  # the first group of 16 has a plain batch
            return out, it.get_state()

    got, got_state = stream(True)
    assert calls, "the laid-out batches were packed again"
    assert sum(calls) >= 16  # in process the first batch is read as it is, then laid out
    want, want_state = stream(False)
    assert got_state == want_state
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)


def test_only_a_one_device_packed_put_of_one_batch_asks_the_loader_to_lay_out(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packing, "GROUP_BYTES", 0)  # one batch a transfer
    asked: list[str] = []
    for cls in (InProcessLoaderIterator, WorkerLoaderIterator):
        monkeypatch.setattr(cls, "lay_out_lanes", lambda self, c=cls: asked.append(c.__name__))
    src = gr.open_source(path)

    def first(sharding: Any, packed: bool | None) -> None:
        loader = gr.make_data_loader(src, batch_size=8, num_epochs=1)
        with gr.sharded_device_put(loader, sharding, packed=packed) as it:
            next(it)  # asked once the first batch said how batches move

    first(_one_device(), True)
    assert asked == ["InProcessLoaderIterator"]
    for sharding, packed in [(_one_device(), False), (None, True), (_one_device(), None)]:
        first(sharding, packed)  # None: off on CPU
    assert asked == ["InProcessLoaderIterator"]
    # several batches a transfer are copied into one buffer anyway: laying them out would
    # only cost the loader (in process: the step's thread) its lane views
    monkeypatch.setattr(packing, "GROUP_BYTES", 1 << 20)
    first(_one_device(), True)
    assert asked == ["InProcessLoaderIterator"]


@pytest.mark.parametrize("frame", [(4, 4, 4), (84, 84, 4)], ids=["grouped", "alone"])
def test_packed_by_default_batches_are_never_laid_out_and_one_alone_moves_leaf_by_leaf(
    tmp_path: Any, frame: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # packed=None as on a TPU: batches that group go packed (several a buffer: the loader
    # is not asked to lay them out); one that would go alone (a 256 KiB+ frame batch) goes
    # leaf by leaf on the producer thread, not laid out either (measured faster there:
    # bench_feed.py)
    from grain_replay.device import put_iterator

    monkeypatch.setattr(put_iterator, "packed_default", lambda packed: True)
    asked: list[str] = []
    monkeypatch.setattr(InProcessLoaderIterator, "lay_out_lanes", lambda self: asked.append("x"))
    packed_puts: list[int] = []
    real = PackedLayout.put
    monkeypatch.setattr(PackedLayout, "put", lambda self, a: packed_puts.append(1) or real(self, a))
    p = str(tmp_path / "f.npy")
    gr.write(p, {"f": np.arange(64 * int(np.prod(frame)), dtype=np.uint32).reshape(64, *frame)})
    loader = gr.make_data_loader(gr.open_source(p), batch_size=16, shuffle=False)
    with gr.sharded_device_put(loader, _one_device()) as it:
        got = [np.asarray(b["f"]) for b in it]
    want = np.arange(64 * int(np.prod(frame)), dtype=np.uint32).reshape(4, 16, *frame)
    np.testing.assert_array_equal(np.stack(got), want)
    alone = frame == (84, 84, 4)
    assert asked == []
    assert (not packed_puts) == alone


def _laid_batch(rows: int = 8) -> tuple[dict[str, np.ndarray], LaneBuffer]:
    leaves = {"a": (np.dtype(np.float32), (rows, 3)), "b": (np.dtype(np.uint8), (rows, 4100))}
    buf = np.zeros(20 * rows * ROW_BYTES, np.uint8).view(LaneBuffer)
    batch = lane_views(buf, leaves)
    batch["a"][...] = np.arange(rows * 3).reshape(rows, 3)
    batch["b"][...] = 7
    return batch, buf


def test_laid_out_finds_the_buffer_and_refuses_leaves_it_did_not_hand_out() -> None:
    batch, buf = _laid_batch()
    found = laid_out([batch["a"], batch["b"]])
    assert found is not None
    region, fields = found
    assert region.dtype == np.uint32 and region.shape == (buf.lane_rows, 128)
    assert np.shares_memory(region, np.asarray(buf)) and type(region) is np.ndarray
    assert [f.row for f in fields] == [0, 1] and laid_out([batch["b"], batch["a"]]) is not None
    other, _ = _laid_batch()
    assert laid_out([batch["a"], other["b"]]) is None  # two buffers
    assert laid_out([batch["a"], batch["b"][:]]) is None  # a new view: not handed out
    assert laid_out([batch["a"], batch["b"].copy()]) is None
    assert laid_out([np.zeros(3)]) is None and laid_out([]) is None
    wide = lane_views(
        np.zeros(4 * ROW_BYTES, np.uint8).view(LaneBuffer), {"i": (np.dtype(np.int64), (8,))}
    )
    assert laid_out([wide["i"]]) is None  # jax would narrow it: the host casts, no as-is put


def test_a_laid_out_leaf_changed_in_place_or_replaced_is_put_as_it_now_is() -> None:
    conv = Converter(SingleDeviceSharding(jax.devices()[0]), packed=True)
    batch, _ = _laid_batch()
    batch["a"][0] = -1.0  # in place: the buffer's bytes
    got = conv(batch)
    assert np.asarray(got["a"])[0].tolist() == [-1.0] * 3
    batch["b"] = np.full((8, 4100), 9, np.uint8)  # replaced: packed from the new leaf
    got = conv(batch)
    assert (np.asarray(got["b"]) == 9).all() and np.asarray(got["a"])[1].tolist() == [3, 4, 5]


def test_by_default_a_laid_out_batch_alone_in_its_transfer_stays_packed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packing, "GROUP_BYTES", 0)
    batch, _ = _laid_batch()
    plain = {k: v.copy() for k, v in batch.items()}
    sharding = SingleDeviceSharding(jax.devices()[0])
    auto = Converter(sharding, packed=True, packed_auto=True)
    assert auto.transfers(batch)[0] == 1 and auto.lays_out
    assert Converter(sharding, packed=True, packed_auto=True).transfers(plain)[0] == 1
    calls = _count_region_puts(monkeypatch)
    _assert_same(auto(batch), Converter(sharding)(plain))
    assert calls == [1]
