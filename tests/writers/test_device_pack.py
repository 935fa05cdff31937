"""Accelerator appends: like trees stacked on the device, copied to host once a group.

The suite has CPU devices only, whose arrays are host memory (never packed); these
tests take the accelerator path with CPU arrays by saying no device is on the host.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import grain_replay as gr
from grain_replay.writers.device import leaves as device_leaves
from grain_replay.writers.device import pack as device_pack
from grain_replay.writers.device.queue import Item
from tests.helpers.store_reads import read_all

THREAD = "grain_replay-device-writes"


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """No device is the host's; records every pack call (the trees it was given and
    packed, and its thread) and every transfer started (its thread and shape)."""
    monkeypatch.setattr(device_leaves, "on_host", lambda leaf: False)
    monkeypatch.setattr(device_pack, "_unpackable", set())
    state: dict[str, Any] = {"packs": [], "copies": []}
    real_pack = device_pack.pack_batch

    def pack_batch(batch: list[Any]) -> list[Any]:
        packed = real_pack(batch)
        n = sum(p.count for p in packed)
        state["packs"].append((len(batch), n, threading.current_thread().name))
        return packed

    monkeypatch.setattr(device_pack, "pack_batch", pack_batch)
    array_type = type(jnp.zeros(1))
    real_copy = array_type.copy_to_host_async

    def copy_to_host_async(self: Any) -> None:
        state["copies"].append((threading.current_thread().name, self.shape))
        real_copy(self)

    monkeypatch.setattr(array_type, "copy_to_host_async", copy_to_host_async)
    return state


def _tree(i: int, rows: int = 32) -> dict[str, Any]:
    base = i * rows + jnp.arange(rows)
    return {
        "obs": (base[:, None] * jnp.ones((1, 3))).astype(jnp.float32),
        "action": base.astype(jnp.int32),
        "done": base % 3 == 0,
        "pixels": jnp.broadcast_to((base % 251).astype(jnp.uint8)[:, None, None], (rows, 2, 2)),
        "half": base.astype(jnp.float16),
        "reward": base.astype(jnp.float32)[0] * jnp.ones(rows, jnp.float32),
    }


def _host(trees: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([np.asarray(t[k]) for t in trees]) for k in trees[0]}


def _check(path: str, trees: list[dict[str, Any]]) -> None:
    got, want = read_all(path), _host(trees)
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_like_trees_are_stacked_and_copied_once_a_group(
    tmp_path: Any, accelerator: dict[str, Any], fmt: str, bounded: bool
) -> None:
    path = str(tmp_path / {"npy": "s", "hdf5": "s.h5", "zarr": "s.zarr"}[fmt])
    trees = [_tree(i) for i in range(100)]
    kwargs: dict[str, Any] = {"capacity": 10_000, "writer_id": "a"} if bounded else {}
    with gr.ReplayWriter(path, format=fmt, **kwargs) as w:
        for t in trees:
            w.append(t)
        # The thread may already copy the first group (64 trees are queued by now); no
        # copy is started in the caller's thread.
        caller = threading.current_thread().name
        assert caller not in {name for name, _ in accelerator["copies"]}, (
            "append started a copy in the caller's thread"
        )
    _check(path, trees)
    # 100 like trees: a batch of 64 (one group), then 36 at close (groups of 32 and 4),
    # one transfer a leaf a group.
    assert accelerator["packs"] == [(64, 64, THREAD), (36, 36, THREAD)]
    assert [shape for _, shape in accelerator["copies"]] == [
        (n, *v.shape) for n in (64, 32, 4) for v in trees[0].values()
    ]
    assert {name for name, _ in accelerator["copies"]} == {THREAD}


def test_unlike_trees_and_host_leaves_keep_their_rows_and_order(
    tmp_path: Any, accelerator: dict[str, Any]
) -> None:
    path = str(tmp_path / "s")
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    sharded = NamedSharding(mesh, PartitionSpec("d"))
    trees: list[dict[str, Any]] = []
    for i in range(40):
        rows = 16 if (i // 5) % 2 else 32  # runs of 5 trees of one row count
        t = _tree(i, rows)
        if i % 7 == 3:
            t["action"] = np.asarray(t["action"])  # a host leaf in a device tree
        if 20 <= i < 26:
            t = {k: jax.device_put(v, sharded) for k, v in t.items()}  # sharded over 8
        trees.append(t)
    with gr.ReplayWriter(path) as w:
        for t in trees:
            w.append(t)
    _check(path, trees)
    assert accelerator["packs"] and all(n < total for total, n, _ in accelerator["packs"])


def test_sizes_are_powers_of_two_up_to_the_group_and_lone_trees_left() -> None:
    assert device_pack._sizes(0) == [] and device_pack._sizes(1) == []
    assert device_pack._sizes(2) == [2] and device_pack._sizes(3) == [2]
    assert device_pack._sizes(100) == [64, 32, 4]
    assert device_pack._sizes(130) == [64, 64, 2]
    assert all(s & (s - 1) == 0 and s <= device_pack.MAX_GROUP for s in device_pack._sizes(999))


def test_groups_take_a_run_of_like_trees_whole_and_split_other_runs_by_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of one key (a run of appends like the last one) is grouped without a look
    at each tree; runs of other keys, and trees without one, split the groups as ever."""
    monkeypatch.setattr(device_pack, "_unpackable", set())
    a, b = (("a", 32), ("x",)), (("b", 32), ("x",))

    def items(packs: list[Any]) -> list[Item]:
        return [Item({}, 1, i, 1, print, p) for i, p in enumerate(packs)]

    assert device_pack._groups(items([a] * 64)) == [(a[0], 0, 64)]
    assert device_pack._groups(items([a] * 7)) == [(a[0], 0, 4), (a[0], 4, 2)]
    mixed = [a] * 3 + [b] * 2 + [None] + [a] * 2
    assert device_pack._groups(items(mixed)) == [(a[0], 0, 2), (b[0], 3, 2), (a[0], 6, 2)]
    equal = (("a", 32), ("x",))  # an equal key, another object: the same run
    assert device_pack._groups(items([a, equal, a, equal])) == [(a[0], 0, 4)]
    assert device_pack._groups(items([a, (("a", 16), ("x",))] * 2)) == []  # other rows
    device_pack._unpackable.add(a[0])
    assert device_pack._groups(items([a] * 8)) == []
    assert device_pack._groups(items([a] * 4 + [b] * 4)) == [(b[0], 4, 4)]


def test_like_appends_share_one_group_key(
    tmp_path: Any, accelerator: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trees taken as like the last one carry the same key object, so a steady actor's
    batch is one run (grouped whole); a new row count gets a key of its own."""
    keys: list[list[int]] = []
    real = device_pack._groups

    def groups(batch: list[Item]) -> Any:
        keys.append([id(item.pack) for item in batch])
        return real(batch)

    monkeypatch.setattr(device_pack, "_groups", groups)
    path = str(tmp_path / "s")
    trees = [_tree(i) for i in range(device_pack.MAX_GROUP)] + [_tree(99, rows=16)] * 2
    with gr.ReplayWriter(path) as w:
        for t in trees:
            w.append(t)
    _check(path, trees)
    flat = [k for batch in keys for k in batch]
    assert len(flat) == len(trees)
    first, rest = flat[: device_pack.MAX_GROUP], flat[device_pack.MAX_GROUP :]
    assert len(set(first)) == 1, "like appends were given keys of their own"
    assert len(set(rest)) == 1 and rest[0] != first[0]


def test_a_refused_packing_falls_back_leaf_by_leaf_and_is_not_tried_again(
    tmp_path: Any, accelerator: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def refuse(trees: Any) -> Any:
        calls.append(len(trees))
        raise TypeError("this packer takes no such tree")

    monkeypatch.setattr(device_pack, "_packer_fn", lambda: refuse)
    path = str(tmp_path / "s")
    trees = [_tree(i) for i in range(12)]
    with gr.ReplayWriter(path) as w:
        for t in trees[:6]:
            w.append(t)
        w.flush()
        tried = len(calls)
        for t in trees[6:]:
            w.append(t)
    _check(path, trees)
    assert tried == 1 and len(calls) == 1, "a refused tree shape was packed again"
    assert len(device_pack._unpackable) == 1


def test_a_deleted_leaf_is_named_by_the_background_error(
    tmp_path: Any, accelerator: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path)
    w.append(_tree(0))
    w.flush()
    gate = threading.Event()
    real = device_pack.pack_batch

    def held(batch: list[Any]) -> list[Any]:
        assert gate.wait(30)
        return real(batch)

    monkeypatch.setattr(device_pack, "pack_batch", held)
    trees = [_tree(i) for i in range(1, 5)]
    for t in trees:
        w.append(t)
    trees[2]["half"].delete()  # donated after append, before its copy
    gate.set()
    with pytest.raises(gr.BackgroundWriteError, match="'half'") as info:
        w.flush()
    assert info.value.leaf == "half"
    assert not device_pack._unpackable, "an array's failure marked the tree shape unpackable"
    w.close()
    assert len(gr.open_source(path)) == 32  # the committed rows are intact


def test_cpu_devices_are_never_packed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_pack, "_packer_fn", lambda: pytest.fail("CPU arrays were stacked"))
    path = str(tmp_path / "s")
    trees = [_tree(i) for i in range(10)]
    with gr.ReplayWriter(path) as w:
        for t in trees:
            w.append(t)
    _check(path, trees)
