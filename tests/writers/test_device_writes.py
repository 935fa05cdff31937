"""ReplayWriter.append with jax.Array leaves: copied and written in the background, in order."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import grain_replay as gr
from grain_replay.store import layout as layout_lib
from grain_replay.tree import flatten
from grain_replay.writers.backends import HDF5Backend, NpyBackend, NpySegmentBackend, ZarrBackend
from grain_replay.writers.device import background, host_copies
from grain_replay.writers.device import leaves as device_leaves
from tests.helpers.store_reads import read_all

SUFFIXES = {"npy": "s", "hdf5": "s.h5", "zarr": "s.zarr"}
BACKEND_CLASSES = {"npy": NpyBackend, "hdf5": HDF5Backend, "zarr": ZarrBackend}
BOUNDED = {"capacity": 1000, "writer_id": "actor-0"}
THREAD = "grain_replay-device-writes"


def _path(tmp_path: Any, fmt: str) -> str:
    return str(tmp_path / SUFFIXES[fmt])


def _sharded(x: np.ndarray) -> jax.Array:
    """``x`` split along its rows over every device (8 fake CPU devices in the suite)."""
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec("d")))


def _block(i: int, rows: int = 16) -> dict[str, np.ndarray]:
    base = i * rows + np.arange(rows)
    return {
        "obs": (base[:, None] * np.ones(3)).astype(np.float32),
        "action": base.astype(np.int32),
        "done": base % 3 == 0,
    }


def _on_device(block: dict[str, np.ndarray], i: int) -> dict[str, Any]:
    """Alternately: every leaf sharded over the devices; one leaf on device 1; mixed."""
    if i % 3 == 0:
        return {k: _sharded(v) for k, v in block.items()}
    if i % 3 == 1:
        dev = jax.devices()[1 % jax.device_count()]
        return {
            "obs": jax.device_put(block["obs"], dev),
            **{k: block[k] for k in ("action", "done")},
        }
    return {
        "obs": jnp.asarray(block["obs"]),
        "action": block["action"],
        "done": jnp.asarray(block["done"]),
    }


def _expected(blocks: int, rows: int = 16) -> dict[str, np.ndarray]:
    parts = [_block(i, rows) for i in range(blocks)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.fixture
def slow_copy(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``to_host`` (the wait for a leaf's copy) blocks until ``release`` is set; records threads."""
    state: dict[str, Any] = {"release": threading.Event(), "threads": [], "calls": 0}
    real = host_copies.to_host

    def blocked(leaf: Any) -> np.ndarray:
        state["threads"].append(threading.current_thread().name)
        state["calls"] += 1
        assert state["release"].wait(30), "the test never released the copy"
        return real(leaf)

    monkeypatch.setattr(host_copies, "to_host", blocked)
    yield state
    state["release"].set()


@pytest.fixture
def eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread writes each append as it comes (no batching), so a failure happens now."""
    monkeypatch.setattr(background, "WRITE_BATCH_BYTES", 1)


@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
@pytest.mark.parametrize("fmt", list(SUFFIXES))
def test_device_appends_round_trip_in_append_order(tmp_path: Any, fmt: str, bounded: bool) -> None:
    path = _path(tmp_path, fmt)
    blocks = 9
    with gr.ReplayWriter(path, format=fmt, **(BOUNDED if bounded else {})) as w:
        for i in range(blocks):
            # Host-only blocks interleaved with device ones keep their place.
            w.append(_block(i) if i % 4 == 3 else _on_device(_block(i), i))
            if i == 4:
                assert w.flush() == 5 * 16
        assert len(w) == blocks * 16
        assert w.flush() == blocks * 16
    got = read_all(path)
    want = _expected(blocks)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_accelerator_path_copies_in_the_writers_thread_not_at_append(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CPU device's array is host memory (no copy); on an accelerator the writer's
    # thread copies the leaves (like trees stacked into one transfer: test_device_pack.py),
    # and append starts none. Take that path with CPU arrays.
    monkeypatch.setattr(device_leaves, "on_host", lambda leaf: False)
    started: list[str] = []
    array_type = type(_sharded(np.zeros((8, 1), np.float32)))
    real = array_type.copy_to_host_async

    def copy_to_host_async(self: Any) -> None:
        started.append(threading.current_thread().name)
        real(self)

    monkeypatch.setattr(array_type, "copy_to_host_async", copy_to_host_async)
    path = _path(tmp_path, "hdf5")
    main = threading.current_thread().name
    with gr.ReplayWriter(path) as w:
        for i in range(3):
            w.append(_on_device(_block(i), i))
            assert main not in started, "append started a copy in the caller's thread"
    np.testing.assert_array_equal(read_all(path)["obs"], _expected(3)["obs"])
    np.testing.assert_array_equal(read_all(path)["done"], _expected(3)["done"])


def test_device_append_reopened_store_continues(tmp_path: Any) -> None:
    path = _path(tmp_path, "npy")
    with gr.ReplayWriter(path) as w:
        w.append(_on_device(_block(0), 0))
    with gr.ReplayWriter(path) as w:
        w.append(_on_device(_block(1), 1))
        assert len(w) == 32
    np.testing.assert_array_equal(read_all(path)["action"], _expected(2)["action"])


def test_append_returns_before_the_copy_and_flush_waits(
    tmp_path: Any, slow_copy: dict[str, Any]
) -> None:
    path = _path(tmp_path, "npy")
    w = gr.ReplayWriter(path)
    w.append(_on_device(_block(0), 0))  # the thread blocks in the copy of the first leaf
    w.append(_on_device(_block(1), 2))
    assert len(w) == 32 and w.committed == 0  # queued: appended, not yet committed
    flushed = threading.Event()
    t = threading.Thread(target=lambda: (w.flush(), flushed.set()))
    t.start()
    time.sleep(0.3)
    assert not flushed.is_set(), "flush returned before the queued rows were written"
    slow_copy["release"].set()
    t.join(30)
    assert flushed.is_set() and w.committed == 32
    assert slow_copy["calls"] >= 3 and set(slow_copy["threads"]) == {THREAD}
    w.close()
    np.testing.assert_array_equal(read_all(path)["obs"], _expected(2)["obs"])


def test_host_appends_to_an_idle_writer_stay_in_the_caller(tmp_path: Any) -> None:
    with gr.ReplayWriter(_path(tmp_path, "npy")) as w:
        for i in range(3):
            w.append(_block(i))
        assert w.committed == 0 and len(w) == 48
        assert THREAD not in {t.name for t in threading.enumerate()}


def test_host_buffer_reused_after_a_queued_append(tmp_path: Any, slow_copy: dict[str, Any]) -> None:
    path = _path(tmp_path, "npy")
    with gr.ReplayWriter(path) as w:
        w.append(_on_device(_block(0), 0))
        buf = _block(1)
        w.append(buf)  # queued behind the device block: its arrays are copied now
        buf["action"][:] = -1  # the caller reuses its buffer
        slow_copy["release"].set()
    np.testing.assert_array_equal(read_all(path)["action"], _expected(2)["action"])


def test_inflight_bound_makes_append_wait(tmp_path: Any, slow_copy: dict[str, Any]) -> None:
    block = _block(0)
    nbytes = sum(a.nbytes for a in block.values())
    w = gr.ReplayWriter(_path(tmp_path, "npy"), max_inflight_bytes=nbytes + 1)
    w.append(_on_device(block, 0))  # alone above nothing: queued even at the bound
    done = threading.Event()
    t = threading.Thread(target=lambda: (w.append(_on_device(_block(1), 0)), done.set()))
    t.start()
    time.sleep(0.3)
    assert not done.is_set(), "append went past max_inflight_bytes"
    slow_copy["release"].set()
    t.join(30)
    assert done.is_set()
    assert w.flush() == 32
    w.close()


def test_tree_larger_than_the_bound_is_queued_alone(tmp_path: Any) -> None:
    with gr.ReplayWriter(_path(tmp_path, "npy"), max_inflight_bytes=8) as w:
        for i in range(3):
            w.append(_on_device(_block(i), 0))
        assert w.flush() == 48


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "256MiB"])
def test_max_inflight_bytes_must_be_a_positive_int(tmp_path: Any, bad: Any) -> None:
    with pytest.raises(gr.InvalidArgumentError, match="max_inflight_bytes must be a positive int"):
        gr.ReplayWriter(_path(tmp_path, "npy"), max_inflight_bytes=bad)


def test_bad_device_tree_fails_at_append_without_a_copy(
    tmp_path: Any, slow_copy: dict[str, Any]
) -> None:
    path = _path(tmp_path, "npy")
    with gr.ReplayWriter(path) as w:
        w.append(_block(0))
        bad = {**_on_device(_block(1), 0), "action": jnp.zeros((16, 2), jnp.int32)}
        with pytest.raises(gr.InvalidTreeError, match=r"leaf 'action' is int32\[2\] per row"):
            w.append(bad)
        with pytest.raises(gr.InvalidTreeError, match="leaves"):
            w.append({"obs": jnp.zeros((16, 3), jnp.float32)})
        with pytest.raises(gr.InvalidTreeError, match=r"same length|leading"):
            w.append({**_on_device(_block(1), 0), "done": jnp.zeros(15, bool)})
        assert slow_copy["calls"] == 0
        assert len(w) == 16
    assert len(gr.open_source(path)) == 16


def test_deleted_device_array_fails_at_append(tmp_path: Any) -> None:
    with gr.ReplayWriter(_path(tmp_path, "npy")) as w:
        tree = _on_device(_block(0), 2)
        tree["done"].delete()
        with pytest.raises(gr.InvalidTreeError, match="leaf 'done' cannot be copied to host"):
            w.append(tree)
        w.append(_on_device(_block(0), 2))  # the writer goes on
        assert w.flush() == 16


def _fail_on_leaf(monkeypatch: pytest.MonkeyPatch, cls: type, leaf: str) -> dict[str, bool]:
    """Backend writes of ``leaf`` fail with ENOSPC once ``armed`` is set."""
    state = {"armed": False}
    real = cls.write

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        if state["armed"] and leaf in arrays:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(self, arrays, start)

    monkeypatch.setattr(cls, "write", write)
    return state


@pytest.mark.parametrize("raised_by", ["append", "flush", "close"])
@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
@pytest.mark.parametrize("fmt", list(SUFFIXES))
def test_failing_background_write_raised_naming_the_leaf(
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    eager: None,
    fmt: str,
    bounded: bool,
    raised_by: str,
) -> None:
    path = _path(tmp_path, fmt)
    cls = NpySegmentBackend if bounded and fmt == "npy" else BACKEND_CLASSES[fmt]
    inject = _fail_on_leaf(monkeypatch, cls, "done")
    kwargs = BOUNDED if bounded else {}
    w = gr.ReplayWriter(path, format=fmt, **kwargs)
    w.append(_on_device(_block(0), 0))
    w.append(_on_device(_block(1), 1))
    assert w.flush() == 32
    inject["armed"] = True
    w.append(_on_device(_block(2), 0))
    deadline = time.monotonic() + 30
    while THREAD in {t.name for t in threading.enumerate()} and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread stops at the failure
    call = {
        "append": lambda: w.append(_on_device(_block(3), 0)),
        "flush": w.flush,
        "close": w.close,
    }[raised_by]
    with pytest.raises(gr.BackgroundWriteError) as info:
        call()
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err.__cause__, OSError)
    assert err.leaf == "done"
    msg = str(err)
    assert path in msg and "'done'" in msg and "No space left" in msg
    assert "rows [32, 48)" in msg and "reopen" in msg
    inject["armed"] = False
    if raised_by != "close":
        with pytest.raises(gr.GrainReplayError, match="stopped after a failed background"):
            w.append(_block(3))
        with pytest.raises(gr.GrainReplayError, match="stopped after a failed background"):
            w.flush()
        w.close()  # releases the store; the error was raised already
    w.close()  # twice is fine
    # The rows committed before the failure are intact, and the store reopens.
    got = read_all(path)
    for k, v in _expected(2).items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    with gr.ReplayWriter(path, format=fmt, **kwargs) as again:
        assert again.committed == 32
        again.append(_on_device(_block(2), 2))
    np.testing.assert_array_equal(read_all(path)["action"], _expected(3)["action"])


def test_failing_copy_names_the_leaf(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = host_copies.to_host

    def to_host(leaf: Any) -> np.ndarray:
        if leaf.dtype == np.bool_:
            raise RuntimeError("INTERNAL: device lost (injected)")
        return real(leaf)

    monkeypatch.setattr(host_copies, "to_host", to_host)
    path = _path(tmp_path, "hdf5")
    with gr.ReplayWriter(path) as w:
        w.append(_block(0))
        w.flush()
        w.append(_on_device(_block(1), 0))
        with pytest.raises(
            gr.BackgroundWriteError, match="copying it to host failed for leaf 'done'"
        ):
            w.flush()
    assert len(gr.open_source(path)) == 16


def test_flush_every_with_device_appends(tmp_path: Any) -> None:
    path = _path(tmp_path, "zarr")
    with gr.ReplayWriter(path, flush_every=32) as w:
        for i in range(3):
            w.append(_on_device(_block(i), i))
        assert w.committed == 32 and len(w) == 48
    assert len(gr.open_source(path)) == 48


def test_writer_imports_no_jax_for_host_appends(tmp_path: Any) -> None:
    code = textwrap.dedent(
        f"""
        import sys, numpy as np, grain_replay as gr
        with gr.ReplayWriter({str(tmp_path / "s")!r}, capacity=100) as w:
            w.append({{"x": np.arange(10)}})
        assert "jax" not in sys.modules, sorted(m for m in sys.modules if "jax" in m)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_crash_loses_only_rows_after_the_last_flush(tmp_path: Any) -> None:
    path = _path(tmp_path, "npy")
    code = textwrap.dedent(
        f"""
        import os, jax.numpy as jnp, grain_replay as gr
        w = gr.ReplayWriter({path!r})
        w.append({{"x": jnp.arange(64, dtype=jnp.int32)}})
        w.flush()
        w.append({{"x": jnp.arange(64, 128, dtype=jnp.int32)}})  # queued, never flushed
        os._exit(3)
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 3, proc.stderr
    np.testing.assert_array_equal(read_all(path)["x"], np.arange(64))
    with gr.ReplayWriter(path) as w:  # reopens after the committed rows
        assert w.committed == 64
        w.append({"x": jnp.arange(64, 70, dtype=jnp.int32)})
    np.testing.assert_array_equal(read_all(path)["x"], np.arange(70))


class _Step(NamedTuple):
    reward: jax.Array
    done: jax.Array


@jax.jit
def _nested_step(i: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """A step whose transition is nested: a dict of dicts, a NamedTuple and a list."""
    base = (i * 8 + jnp.arange(8)).astype(jnp.float32)
    return i + 1, {
        "obs": {"pos": base[:, None] * jnp.ones((1, 2)), "vel": -base},
        "step": _Step(base * 0.5, base % 3 == 0),
        "extra": [base.astype(jnp.int32)],
    }


def _nested_expected(steps: int) -> dict[str, np.ndarray]:
    base = np.arange(8 * steps, dtype=np.float32)
    return {
        "obs/pos": base[:, None] * np.ones((1, 2), np.float32),
        "obs/vel": -base,
        "step/reward": base * 0.5,
        "step/done": base % 3 == 0,
        "extra/0": base.astype(np.int32),
    }


def test_nested_device_trees_like_the_last_skip_the_full_check(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nested trees (dicts of dicts, NamedTuples, lists) of a jitted step are taken by the
    quick check after the first, on the accelerator path, stacked and written in order."""
    monkeypatch.setattr(device_leaves, "on_host", lambda leaf: False)
    full: list[int] = []
    real = layout_lib.check_leaves

    def check_leaves(tree: Any, **kwargs: Any) -> Any:
        full.append(1)
        return real(tree, **kwargs)

    monkeypatch.setattr(layout_lib, "check_leaves", check_leaves)
    steps = 70  # more than a group of like trees (pack.MAX_GROUP)
    path = _path(tmp_path, "npy")
    i = jnp.zeros((), jnp.int32)
    with gr.ReplayWriter(path) as w:
        for _ in range(steps):
            i, transition = _nested_step(i)
            w.append(transition)
        assert w.flush() == 8 * steps
    assert len(full) == 1, "a like nested tree took the full check"
    got, _ = flatten(read_all(path))
    want = _nested_expected(steps)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_nested_device_tree_unlike_the_last_gets_the_full_checks_errors(tmp_path: Any) -> None:
    """A nested tree unlike the last one (dict keys reordered, a NamedTuple turned tuple)
    is refused by the full check; a deleted nested leaf is named by its path."""
    i = jnp.zeros((), jnp.int32)
    with gr.ReplayWriter(_path(tmp_path, "npy")) as w:
        i, first = _nested_step(i)
        w.append(first)
        i, t = _nested_step(i)
        w.append(t)  # taken by the quick check
        i, t = _nested_step(i)
        with pytest.raises(gr.InvalidTreeError, match="different container structure"):
            w.append({**t, "obs": {"vel": t["obs"]["vel"], "pos": t["obs"]["pos"]}})
        with pytest.raises(gr.InvalidTreeError, match="different container structure"):
            w.append({**t, "step": tuple(t["step"])})
        t["step"].done.delete()
        with pytest.raises(gr.InvalidTreeError, match="leaf 'step/done' cannot be copied"):
            w.append(t)
        i, t = _nested_step(i)
        w.append(t)  # the writer goes on
        assert w.flush() == 3 * 8
