"""Device appends hold nothing on the device past their batch: live jax arrays are flat over
many appends and background commits, on CPU devices and on the accelerator path (like trees
stacked on the device, tests/writers/test_device_pack.py's stand-in); a stacked group is
written as one block a leaf; sharded leaves keep their values and order."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import grain_replay as gr
from grain_replay.writers.backends import NpySegmentBackend
from grain_replay.writers.device import leaves as device_leaves
from grain_replay.writers.device import pack as device_pack
from tests.helpers.store_reads import read_all

ENVS = 64  # rows an append: divisible by the 8 CPU devices
THREAD = "grain_replay-device-writes"


@jax.jit
def _step(state: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """An actor's step: the state moves on, the transition's leaves are new arrays."""
    nxt = state + 1.0
    return nxt, {
        "obs": state,
        "action": (state[:, 0] % 2).astype(jnp.int32),
        "reward": state.sum(axis=1),
        "done": state[:, 0] % 7 == 0,
    }


def _start(sharded: bool) -> jax.Array:
    state = jnp.arange(ENVS * 4, dtype=jnp.float32).reshape(ENVS, 4) * 0.0
    state = state + jnp.arange(ENVS, dtype=jnp.float32)[:, None] * 1000.0
    if sharded:
        mesh = jax.make_mesh((jax.device_count(),), ("d",))
        state = jax.device_put(state, NamedSharding(mesh, PartitionSpec("d")))
    return state


def _expected(steps: int) -> dict[str, np.ndarray]:
    """Every step's transition, in append order (the step is pure: computed on the host)."""
    base = np.arange(ENVS, dtype=np.float32)[:, None] * 1000.0 * np.ones((1, 4), np.float32)
    obs = np.concatenate([base + i for i in range(steps)])
    return {
        "obs": obs,
        "action": (obs[:, 0] % 2).astype(np.int32),
        "reward": obs.sum(axis=1),
        "done": obs[:, 0] % 7 == 0,
    }


# Steps the caller dispatches ahead of their execution, at the most. On the accelerator
# stand-in with sharded leaves, the writer's thread dispatches its stacking program over the
# 8 CPU devices while the caller dispatches its steps: XLA's CPU client launches each
# device's part of a program from a pool of 8 threads, and a launch waits there for a free
# slot on its device (a bounded number of programs in flight a device). A caller hundreds of
# steps ahead fills the slots, the two programs' 14 launches take every pool thread, and
# the programs that would free a slot cannot launch: both threads wait forever (a CI run
# hung so; gdb: 8 pool threads in Semaphore::ScopedAcquire, the caller and the writer in
# PjRtLoadedExecutable::Execute). A real accelerator's copies never take this path (a CPU
# device's arrays are read in place), nor does a caller's single-device step.
RUN_AHEAD = 8


def _run(writer: gr.ReplayWriter, state: jax.Array, steps: int, flush_every: int) -> jax.Array:
    for i in range(steps):
        state, transition = _step(state)
        writer.append(transition)
        if (i + 1) % RUN_AHEAD == 0:
            state.block_until_ready()
        if (i + 1) % flush_every == 0:
            writer.flush(wait=False)
    writer.flush()
    return state


def _live() -> int:
    gc.collect()
    return len(jax.live_arrays())


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """No device is the host's (the accelerator path); records each group's size."""
    monkeypatch.setattr(device_leaves, "on_host", lambda leaf: False)
    monkeypatch.setattr(device_pack, "_unpackable", set())
    sizes: list[int] = []
    real = device_pack.pack_batch

    def pack_batch(batch: list[Any]) -> list[Any]:
        packed = real(batch)
        sizes.extend(p.count for p in packed)
        return packed

    monkeypatch.setattr(device_pack, "pack_batch", pack_batch)
    return sizes


@pytest.mark.parametrize("path_kind", ["cpu", "accelerator"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "sharded"])
def test_live_arrays_flat_over_many_appends_and_commits(
    tmp_path: Any, request: pytest.FixtureRequest, path_kind: str, sharded: bool
) -> None:
    sizes = request.getfixturevalue("accelerator") if path_kind == "accelerator" else None
    path = str(tmp_path / "s")
    steps = 300
    state = _start(sharded)
    with gr.ReplayWriter(path, capacity=100 * ENVS, writer_id="a", segment_rows=16 * ENVS) as w:
        state = _run(w, state, 20, 10)  # warm: compiled, threads started, a commit done
        before = _live()
        state = _run(w, state, steps, 100)
        after = _live()
        assert after == before, f"{after - before} device arrays more after {steps} appends"
        assert w.committed == (20 + steps) * ENVS
    assert _live() == before, "the closed writer left arrays alive"
    if sizes is not None:
        assert sizes and max(sizes) == device_pack.MAX_GROUP, sizes
    # capacity 100 appends: the newest 100 steps are live, in order.
    got, want = read_all(path), _expected(20 + steps)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v[-100 * ENVS :], err_msg=k)


def test_queued_trees_are_released_once_written(tmp_path: Any, accelerator: list[int]) -> None:
    """The device arrays of a batch are dropped by the writer when its block is written,
    before the caller's next flush: at most a batch of trees (and the bound) is held."""
    path = str(tmp_path / "s")
    state = _start(False)
    with gr.ReplayWriter(path) as w:
        state = _run(w, state, 4, 4)
        before = _live()
        for _ in range(device_pack.MAX_GROUP):
            state, transition = _step(state)
            w.append(transition)
        del transition
        deadline = time.monotonic() + 30  # the thread wakes at a batch of trees, no flush
        while _live() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _live() == before, "the written batch's device arrays are still held"
        assert accelerator[-1] == device_pack.MAX_GROUP
        assert w.committed == 4 * ENVS, "the thread committed without a flush"


def test_a_stacked_group_is_written_as_one_block_a_leaf(
    tmp_path: Any, accelerator: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[tuple[str, int, str]] = []
    real = NpySegmentBackend.write

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        for k, a in arrays.items():
            writes.append((k, len(a), threading.current_thread().name))
        real(self, arrays, start)

    monkeypatch.setattr(NpySegmentBackend, "write", write)
    path = str(tmp_path / "s")
    steps = 2 * device_pack.MAX_GROUP
    rows = steps * ENVS
    with gr.ReplayWriter(path, capacity=rows, writer_id="a", segment_rows=rows) as w:
        _run(w, _start(True), steps, steps)
    assert accelerator == [device_pack.MAX_GROUP, device_pack.MAX_GROUP]
    rows = device_pack.MAX_GROUP * ENVS
    leaves = ["action", "done", "obs", "reward"]  # jit returns dicts with sorted keys
    assert writes == [(k, rows, THREAD) for _ in range(2) for k in leaves]
    got, want = read_all(path), _expected(steps)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_tree_signature_takes_a_jitted_steps_tree_on_identities_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A jitted step's leaves share their aval (shape and dtype) and sharding objects call
    after call: the quick check takes them on identities, without a look at shapes or
    dtypes; a tree that differs in any of them (or holds a deleted leaf) is checked
    attribute by attribute, and refused when unlike."""
    state = _start(True)
    state, first = _step(state)
    sig = device_leaves.TreeSignature.of(first, dict(first), lambda _: True, "store")
    assert sig is not None
    full = []
    real = device_leaves.TreeSignature._check_attributes

    def by_attributes(self: Any, given: dict[str, Any]) -> Any:
        full.append(len(given))
        return real(self, given)

    monkeypatch.setattr(device_leaves.TreeSignature, "_check_attributes", by_attributes)
    row_bytes = 4 * 4 + 4 + 4 + 1
    state, second = _step(state)
    assert sig.check(second) == (ENVS, ENVS * row_bytes)
    assert len(full) == 1
    state, third = _step(state)
    assert all(third[k].aval is second[k].aval for k in first)  # what the quick path uses
    assert all(third[k].sharding is second[k].sharding for k in first)
    assert sig.check(second) == (ENVS, ENVS * row_bytes)  # taken on identities now
    assert sig.check(third) == (ENVS, ENVS * row_bytes)
    assert len(full) == 1, "a like tree was checked attribute by attribute"
    assert sig.check({**second, "action": second["action"].astype(jnp.float32)}) is None
    assert sig.check({**second, "obs": second["obs"][:, :3]}) is None
    assert sig.check({k: second[k] for k in reversed(second)}) is None
    unsharded = {k: jax.device_put(v, jax.devices()[0]) for k, v in second.items()}
    assert sig.check(unsharded) is None, "a leaf on another sharding was taken"
    doubled = {k: jnp.concatenate([v, v]) for k, v in second.items()}
    assert sig.check(doubled) == (2 * ENVS, 2 * ENVS * row_bytes)  # any row count
    state, fourth = _step(state)
    fourth["reward"].delete()
    assert sig.check(fourth) is None, "a deleted leaf was taken"


class _NoAval:
    """A device-array stand-in with a shape, dtype and sharding but no aval."""

    def __init__(self, rows: int, dtype: Any = np.float32) -> None:
        self.shape = (rows, 3)
        self.dtype = np.dtype(dtype)
        self.sharding = "one device"
        self.deleted = False

    def is_deleted(self) -> bool:
        return self.deleted


def test_tree_signature_checks_leaves_without_an_aval_by_attributes_every_time() -> None:
    """Leaves without an aval are never taken on identities: every tree is checked from
    its shapes, dtypes, shardings and liveness, and refused when unlike."""
    first = {"x": _NoAval(4)}
    sig = device_leaves.TreeSignature.of(first, dict(first), lambda _: True, "store")
    assert sig is not None
    assert sig.check({"x": _NoAval(4)}) == (4, 4 * 12)
    assert sig.check({"x": _NoAval(5)}) == (5, 5 * 12)
    assert sig.check({"x": _NoAval(5, np.int64)}) is None
    dead = _NoAval(4)
    dead.deleted = True
    assert sig.check({"x": dead}) is None
    assert sig.check({"x": _NoAval(4)}) == (4, 4 * 12)
