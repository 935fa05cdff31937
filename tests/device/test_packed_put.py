"""sharded_device_put(packed=True): one buffer per device per transfer, the same arrays.

Every test compares the packed path with the leaf-by-leaf one (``packed=False``): values
(bit for bit), dtypes, shapes, shardings, order and checkpoint states.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from typing import Any, NamedTuple

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

import grain_replay as gr
from grain_replay.device import packed as packing
from grain_replay.device.converter import Converter
from grain_replay.errors import InvalidArgumentError

needs_8_devices = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs 8 JAX devices (XLA_FLAGS=...device_count=8)"
)


class Step(NamedTuple):
    obs: dict[str, np.ndarray]
    action: np.ndarray


def _batch(i: int, rows: int = 16) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    f32 = rng.standard_normal((rows, 5), dtype=np.float32)
    f32[0, 0] = np.nan  # compared bit for bit
    return {
        "frames": rng.integers(0, 256, (rows, 8, 6, 4), dtype=np.uint8),  # last axis 4: lanes
        "rgb": rng.integers(0, 256, (rows, 40, 40, 3), dtype=np.uint8),  # per-element rows
        "f32": f32,
        "i64": rng.integers(-(2**40), 2**40, rows),  # narrowed to int32 as jax narrows it
        "f64": rng.standard_normal((rows, 3)),
        "f16": rng.standard_normal((rows, 3)).astype(np.float16),
        "u16": rng.integers(0, 60_000, (rows, 7), dtype=np.uint16),
        "i8": rng.integers(-128, 128, (rows,), dtype=np.int8),
        "done": rng.random(rows) < 0.3,
        "mask": rng.random((rows, 2, 4)) < 0.5,  # bool with a last axis of 4
        "empty": np.zeros((rows, 0), np.float32),
        "nested": Step({"x": np.arange(rows * 2, dtype=np.int32).reshape(rows, 2) + i},
                       np.arange(rows, dtype=np.uint32)),
    }  # fmt: skip


def _assert_same(got: Any, want: Any) -> None:
    g, gt = jax.tree_util.tree_flatten(got)
    w, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt
    for a, b in zip(g, w, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        x, y = np.asarray(a), np.asarray(b)
        assert x.tobytes() == y.tobytes()


def _shardings() -> list[Any]:
    out: list[Any] = [None, SingleDeviceSharding(jax.devices()[-1])]
    if jax.device_count() >= 8:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
        out += [NamedSharding(mesh, PartitionSpec(("a", "b"))), mesh]
    return out


@pytest.mark.parametrize("sharding", _shardings(), ids=lambda s: type(s).__name__)
def test_packed_batches_equal_leaf_by_leaf_puts(sharding: Any) -> None:
    batches = [_batch(i) for i in range(3)]
    plain = list(gr.sharded_device_put(iter(batches), sharding, packed=False))
    packed = list(gr.sharded_device_put(iter(batches), sharding, packed=True))
    assert len(packed) == 3
    for got, want in zip(packed, plain, strict=True):
        _assert_same(got, want)


def test_packed_path_is_taken_for_these_batches() -> None:
    """plan() packs every leaf kind above (else the tests above compare the fallback)."""
    conv = Converter(None, packed=True)
    assert conv.transfers(_batch(0))[0] >= 1
    leaves = jax.tree_util.tree_leaves(_batch(0))
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    layout = packing.plan(leaves, [sharding] * len(leaves))
    assert layout is not None
    assert layout.rows * 512 >= sum(x.nbytes for x in leaves) // jax.device_count()


def test_falls_back_where_packing_does_not_apply() -> None:
    leaves = [np.zeros((16, 4), np.float32), np.zeros((16,), np.int32)]
    n = jax.device_count()
    named = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    assert packing.plan(leaves, [named, named]) is not None
    # two shardings, a replicated one, strings, a jax.Array leaf: leaf by leaf
    single = SingleDeviceSharding(jax.devices()[0])
    assert packing.plan(leaves, [named, single]) is None or n == 1
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec())
    assert packing.plan(leaves, [replicated, replicated]) is None
    assert packing.plan([np.array(["a"] * 16)], [named]) is None
    assert packing.plan([jax.numpy.zeros((16,))], [named]) is None


@needs_8_devices
def test_replicated_and_per_leaf_shardings_fall_back_with_the_same_arrays() -> None:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    for sharding in (
        NamedSharding(mesh, PartitionSpec("a")),  # replicated over "b"
        {
            "x": NamedSharding(mesh, PartitionSpec("a")),
            "y": NamedSharding(mesh, PartitionSpec(("a", "b"))),
        },
    ):  # fmt: skip
        batch = {"x": np.arange(32.0, dtype=np.float32).reshape(16, 2), "y": np.arange(16)}
        _assert_same(
            next(gr.sharded_device_put(iter([batch]), sharding, packed=True)),
            next(gr.sharded_device_put(iter([batch]), sharding, packed=False)),
        )


class _Stateful:
    """A stateful iterator of numbered batches that may fail at ``fail_at``."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.i, self.n, self.fail_at = 0, n, fail_at

    def __iter__(self) -> _Stateful:
        return self

    def __next__(self) -> Any:
        if self.i == self.fail_at:
            self.fail_at = None
            raise ValueError("read failed")
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return {"obs": np.full((8, 3), self.i, np.float32), "t": np.full(8, self.i, np.int64)}

    def get_state(self) -> dict[str, int]:
        return {"i": self.i}

    def set_state(self, state: dict[str, int]) -> None:
        self.i = state["i"]


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_groups_of_batches_keep_order_states_and_the_last_partial_group(
    monkeypatch: pytest.MonkeyPatch, prefetch: int
) -> None:
    # 96 + 64 bytes a batch: 3 batches a transfer; 10 batches end in a group of 1
    monkeypatch.setattr(packing, "GROUP_BYTES", 3 * 160)
    assert Converter(None, packed=True).transfers(next(_Stateful(1))) == (3, 1)
    it = gr.sharded_device_put(_Stateful(10), prefetch=prefetch, packed=True)
    ref = gr.sharded_device_put(_Stateful(10), prefetch=prefetch, packed=False)
    states = []
    for k in range(10):
        _assert_same(next(it), next(ref))
        assert it.get_state() == ref.get_state() == {"i": k + 1}
        states.append(it.get_state())
    with pytest.raises(StopIteration):
        next(it)
    # resume mid-group: the same batches again
    it.set_state(states[3])
    ref.set_state(states[3])
    for _ in range(6):
        _assert_same(next(it), next(ref))
    it.close()
    ref.close()


def test_a_failure_inside_a_group_comes_after_the_batches_read_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(packing, "GROUP_BYTES", 3 * 160)
    it = gr.sharded_device_put(_Stateful(10, fail_at=4), prefetch=2, packed=True)
    got = [int(np.asarray(next(it)["t"])[0]) for _ in range(4)]
    assert got == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="read failed"):
        next(it)


def test_a_loader_stream_and_its_checkpoint_bytes_are_the_same_packed(tmp_path: Any) -> None:
    path = str(tmp_path / "store")
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (64, 6, 6, 4), dtype=np.uint8)
    gr.write(path, {"obs": obs, "a": rng.integers(0, 9, 64), "r": rng.random(64, dtype=np.float32)})
    src = gr.open_source(path)

    def stream(packed: bool, sampling: Any = "epochs") -> tuple[list[Any], list[bytes]]:
        loader = gr.make_data_loader(src, batch_size=8, seed=3, num_epochs=None, sampling=sampling)
        with gr.sharded_device_put(loader, packed=packed) as it:
            out = [next(it) for _ in range(7)]
            return out, [it.get_state()]

    for sampling in ("epochs", gr.UniformReplay(), gr.PrioritizedReplay()):
        got, got_state = stream(True, sampling)
        want, want_state = stream(False, sampling)
        assert got_state == want_state
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("inline", [False, True], ids=["thread", "inline"])
def test_over_a_loader_the_state_of_every_batch_is_computed_at_the_checkpoint_not_copied(
    tmp_path: Any, workers: int, inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the loader's state is a function of its position (get_state_at): the feed reading
    # groups ahead no longer copies it per batch, and every batch's bytes stay the same
    from grain_replay.device import put_options
    from grain_replay.pipeline.grain_iterator import GrainStateIterator

    monkeypatch.setattr(put_options, "INLINE", inline)
    path = str(tmp_path / "store")
    rng = np.random.default_rng(1)
    gr.write(path, {"obs": rng.random((96, 5), dtype=np.float32), "a": np.arange(96)})
    src = gr.open_source(path)

    def loader() -> Any:
        return gr.make_data_loader(src, batch_size=8, seed=4, num_epochs=None, worker_count=workers)

    with iter(loader()) as plain:
        want = [plain.get_state()] + [next(plain) and plain.get_state() for _ in range(30)]
    asked: list[int] = []
    real = GrainStateIterator.get_state
    monkeypatch.setattr(GrainStateIterator, "get_state", lambda s: asked.append(1) or real(s))
    with gr.sharded_device_put(loader(), SingleDeviceSharding(jax.devices()[0]), packed=True) as it:
        got = [it.get_state()] + [next(it) and it.get_state() for _ in range(30)]
        assert not asked, "the feed copied the loader's state per batch"
        it.set_state(want[13])
        assert it.get_state() == want[13]
        again = [next(it) and it.get_state() for _ in range(5)]
    assert got == want
    assert again == want[14:19]


def test_packed_must_be_a_bool_or_none() -> None:
    with pytest.raises(InvalidArgumentError, match="Fix: packed=None"):
        gr.sharded_device_put(iter([]), packed="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("packed", [False, True])
def test_large_batches_move_on_several_threads_in_order(
    monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    monkeypatch.setattr(packing, "PARALLEL_BYTES", 100)
    monkeypatch.setattr(packing, "PUT_THREADS", 3)
    monkeypatch.setattr(packing, "GROUP_BYTES", 0)
    assert Converter(None, packed=packed).transfers(next(_Stateful(1))) == (1, 3)
    it = gr.sharded_device_put(_Stateful(12, fail_at=9), prefetch=2, packed=packed)
    ref = gr.sharded_device_put(_Stateful(12, fail_at=9), prefetch=0, packed=False)
    for k in range(9):
        _assert_same(next(it), next(ref))
        assert it.get_state() == {"i": k + 1}
    with pytest.raises(ValueError, match="read failed"):
        next(it)
    it = gr.sharded_device_put(_Stateful(10**6), prefetch=2, packed=packed)
    next(it)
    it.close()  # the put threads are stopped with the producer
    with pytest.raises(StopIteration):
        next(it)


def test_by_default_a_batch_alone_in_its_transfer_goes_leaf_by_leaf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = next(_Stateful(1))
    auto = Converter(None, packed=True, packed_auto=True)
    monkeypatch.setattr(packing, "GROUP_BYTES", 0)
    assert auto.transfers(batch)[0] == 1
    monkeypatch.setattr(packing, "GROUP_BYTES", 10_000)
    assert auto.transfers(batch)[0] == 1  # it dropped packing for good
    asked = Converter(None, packed=True)
    monkeypatch.setattr(packing, "GROUP_BYTES", 0)
    assert asked.transfers(batch)[0] == 1
    monkeypatch.setattr(packing, "GROUP_BYTES", 10_000)
    assert asked.transfers(batch)[0] > 1


def test_on_tpu_pinned_is_switched_off_with_the_reason_and_packing_is_the_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    batches = [next(_Stateful(1)) for _ in range(2)]
    want = next(gr.sharded_device_put(iter(batches), packed=False))
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with caplog.at_level("WARNING", logger="grain_replay.device.put"):
        it = gr.sharded_device_put(iter(batches), pinned=True)
    assert "pinned=True) is off on TPU" in caplog.text
    assert "docs/loader.md" in caplog.text
    _assert_same(next(it), want)
    it.close()
    # packed=None on a TPU: small batches go several to a transfer
    auto = gr.sharded_device_put(iter(batches))
    _assert_same(next(auto), want)
    auto.close()
