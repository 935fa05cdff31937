"""Device appends at speed: batched background writes, the quick check of a tree like the
last one, and filled segments committed by the thread before flush()."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import grain_replay as gr
from grain_replay.store import layout
from grain_replay.store import parts as parts_lib
from grain_replay.writers.backends import NpyBackend, NpySegmentBackend
from grain_replay.writers.device import background
from grain_replay.writers.parts_writer import PartWriter
from tests.helpers.store_reads import read_all

ROWS = 16


def _block(i: int, rows: int = ROWS) -> dict[str, np.ndarray]:
    base = i * ROWS + np.arange(rows)
    return {
        "obs": (base[:, None] * np.ones(3)).astype(np.float32),
        "action": base.astype(np.int32),
        "done": base % 3 == 0,
    }


BLOCK_BYTES = sum(a.nbytes for a in _block(0).values())


def _device(block: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: jnp.asarray(v) for k, v in block.items()}


def _expected(blocks: list[int]) -> dict[str, np.ndarray]:
    parts = [_block(i) for i in blocks]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _assert_rows(path: str, blocks: list[int]) -> None:
    got = read_all(path)
    for k, v in _expected(blocks).items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def _wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def _count_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts full tree checks (``layout.check_leaves``) of appended trees."""
    calls: list[int] = []
    real = layout.check_leaves

    def check_leaves(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(layout, "check_leaves", check_leaves)
    return calls


def test_small_device_appends_written_in_batches_in_order(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background, "WRITE_BATCH_BYTES", 3 * BLOCK_BYTES)
    writes: list[int] = []
    real = NpyBackend.write

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        if "action" in arrays:
            writes.append(len(arrays["action"]))
        real(self, arrays, start)

    monkeypatch.setattr(NpyBackend, "write", write)
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path) as w:
        w.append(_device(_block(0)))
        w.append(_block(1))  # host rows queued behind a device tree keep their place
        time.sleep(0.2)
        assert writes == [], "the thread wrote before a batch was queued"
        w.append({**_device(_block(2)), "action": _block(2)["action"]})  # mixed: a batch now
        _wait_until(lambda: writes, "the first batch is written")
        assert writes == [3 * ROWS]
        w.append(_device(_block(3)))
        w.append(_device(_block(4)))
        time.sleep(0.2)
        assert writes == [3 * ROWS] and len(w) == 5 * ROWS and w.committed == 0
        assert w.flush() == 5 * ROWS  # the barrier writes what is queued, as one block
        assert writes == [3 * ROWS, 2 * ROWS]
    _assert_rows(path, [0, 1, 2, 3, 4])


@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_tree_like_the_last_skips_the_full_check(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, bounded: bool
) -> None:
    calls = _count_checks(monkeypatch)
    path = str(tmp_path / "s")
    kwargs: dict[str, Any] = {"capacity": 10_000, "writer_id": "a"} if bounded else {}
    with gr.ReplayWriter(path, **kwargs) as w:
        for i in range(10):
            w.append(_device(_block(i)))
        assert len(calls) == 1, "trees like the first one were walked and checked again"
        w.append(_device(_block(10, rows=5)))  # another row count: still like the last
        assert len(calls) == 1 and len(w) == 10 * ROWS + 5
    got = read_all(path)
    want = _expected(list(range(10)))
    for k in want:
        np.testing.assert_array_equal(got[k][: 10 * ROWS], want[k], err_msg=k)
        np.testing.assert_array_equal(got[k][10 * ROWS :], _block(10, rows=5)[k], err_msg=k)


def test_tree_unlike_the_last_takes_the_full_check(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_checks(monkeypatch)
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path) as w:
        w.append(_device(_block(0)))
        good = _device(_block(1))
        with pytest.raises(gr.InvalidTreeError, match=r"leaf 'action' is int16\[\] per row"):
            w.append({**good, "action": good["action"].astype(jnp.int16)})
        with pytest.raises(gr.InvalidTreeError, match="leaves"):
            w.append({k: good[k] for k in ("action", "obs", "done")})  # another key order
        with pytest.raises(gr.InvalidTreeError, match="leaves"):
            w.append({**good, "done": {"x": good["done"]}})  # nested
        with pytest.raises(gr.InvalidTreeError, match=r"same length|leading"):
            w.append({**good, "done": good["done"][:3]})
        with pytest.raises(gr.InvalidTreeError, match=r"obs.*float32\[3\]"):
            w.append({**good, "obs": good["obs"][:, :2]})
        w.append({k: v[:0] for k, v in good.items()})  # zero rows: nothing to write
        assert len(calls) == 7 and len(w) == ROWS
        mesh = jax.make_mesh((jax.device_count(),), ("d",))
        sharded = jax.device_put(good["obs"], NamedSharding(mesh, PartitionSpec("d")))
        w.append({**good, "obs": sharded})  # another sharding: checked in full, then kept
        w.append(_device(_block(2)))  # the first sharding again: checked in full
        w.append(_device(_block(3)))  # like the last one
        assert len(calls) == 9
    _assert_rows(path, [0, 1, 2, 3])


def test_deleted_array_in_a_tree_like_the_last_fails_at_append(tmp_path: Any) -> None:
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path) as w:
        w.append(_device(_block(0)))
        tree = _device(_block(1))
        tree["done"].delete()
        with pytest.raises(gr.InvalidTreeError, match="leaf 'done' cannot be copied to host"):
            w.append(tree)
        w.append(_device(_block(1)))  # the writer goes on
    _assert_rows(path, [0, 1])


@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_closed_writer_refuses_a_tree_like_the_last(tmp_path: Any, bounded: bool) -> None:
    kwargs: dict[str, Any] = {"capacity": 100, "writer_id": "a"} if bounded else {}
    w = gr.ReplayWriter(str(tmp_path / "s"), **kwargs)
    w.append(_device(_block(0)))
    w.close()
    with pytest.raises(gr.GrainReplayError, match="closed"):
        w.append(_device(_block(1)))


def test_batch_failure_raised_by_flush_naming_the_leaf(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = NpyBackend.write

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        if "done" in arrays:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(self, arrays, start)

    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path)
    w.append(_block(0))
    w.flush()
    monkeypatch.setattr(NpyBackend, "write", write)
    for i in range(1, 4):
        w.append(_device(_block(i)))  # queued, below a batch: nothing written yet
    with pytest.raises(gr.BackgroundWriteError, match=r"leaf 'done' of rows \[16, 64\)") as info:
        w.flush()
    assert info.value.leaf == "done" and isinstance(info.value.__cause__, OSError)
    w.close()
    monkeypatch.setattr(NpyBackend, "write", real)
    _assert_rows(path, [0])


def _segment_rows_on_disk(path: str, first: int) -> int:
    seg = os.path.join(parts_lib.writer_dir(path, "a"), parts_lib.segment_name(first, "npy"))
    meta = NpySegmentBackend.read_metadata(seg)
    return -1 if meta is None else meta.num_records


def test_filled_segments_committed_by_the_thread_before_flush(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background, "WRITE_BATCH_BYTES", 1)  # write each append as it comes
    written = threading.Event()
    real = PartWriter.write

    def write(self: Any, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        written.set()

    monkeypatch.setattr(PartWriter, "write", write)
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path, capacity=1000, writer_id="a", segment_rows=2 * ROWS)
    for i in range(5):  # segments [0, 32) and [32, 64) filled, [64, 96) half
        w.append(_device(_block(i)))
    _wait_until(lambda: _segment_rows_on_disk(path, 2 * ROWS) == 2 * ROWS, "segment 32 commits")
    assert _segment_rows_on_disk(path, 0) == 2 * ROWS
    assert _segment_rows_on_disk(path, 4 * ROWS) == 0  # the open one waits for flush()
    assert w.committed == 0  # the manifest, the commit point, did not move
    assert w.flush() == 5 * ROWS
    # A segment the manifest names already (with 16 rows) is not committed ahead: a
    # crash would leave it saying more rows than the manifest.
    written.clear()
    w.append(_device(_block(5)))
    _wait_until(lambda: len(w) == 6 * ROWS and written.is_set(), "the write")
    time.sleep(0.1)
    assert _segment_rows_on_disk(path, 4 * ROWS) == ROWS
    assert w.flush() == 6 * ROWS
    w.close()
    assert _segment_rows_on_disk(path, 4 * ROWS) == 2 * ROWS
    _assert_rows(path, list(range(6)))


def test_failing_segment_commit_in_the_thread_raised(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background, "WRITE_BATCH_BYTES", 1)
    real = NpySegmentBackend.stage_commit
    armed = {"on": False}
    failed = threading.Event()

    def stage_commit(self: Any, n: int, checksums: Any) -> list[int]:
        if armed["on"] and threading.current_thread().name == "grain_replay-device-syncs":
            failed.set()
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(self, n, checksums)

    monkeypatch.setattr(NpySegmentBackend, "stage_commit", stage_commit)
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path, capacity=1000, writer_id="a", segment_rows=2 * ROWS)
    w.append(_device(_block(0)))
    assert w.flush() == ROWS
    armed["on"] = True
    for i in range(1, 4):  # fills [32, 64): its commit in the thread fails
        w.append(_device(_block(i)))
    # (before the flush: a sync that a waiting flush would find not started leaves the
    # segment to the flush's own commit)
    assert failed.wait(30), "the thread never committed the filled segment"
    with pytest.raises(gr.BackgroundWriteError, match=r"committing the segments filled") as info:
        w.flush()
    assert info.value.leaf == "" and "Input/output error" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(gr.GrainReplayError, match="stopped after a failed background"):
        w.append(_device(_block(4)))
    w.close()
    armed["on"] = False
    _assert_rows(path, [0])


def test_crash_after_filled_segments_committed_keeps_the_flushed_rows(tmp_path: Any) -> None:
    path = str(tmp_path / "s")
    seg = {f: os.path.join(parts_lib.writer_dir(path, "a"), parts_lib.segment_name(f, "npy"))
           for f in (32, 64)}  # fmt: skip
    code = textwrap.dedent(
        f"""
        import os, time, jax.numpy as jnp, grain_replay as gr
        from grain_replay.writers.device import background
        from grain_replay.writers.backends import NpySegmentBackend
        background.WRITE_BATCH_BYTES = 1
        w = gr.ReplayWriter({path!r}, capacity=1000, writer_id="a", segment_rows=32)
        w.append({{"x": jnp.arange(16, dtype=jnp.int32)}})
        w.flush()
        w.append({{"x": jnp.arange(16, 48, dtype=jnp.int32)}})
        w.append({{"x": jnp.arange(48, 100, dtype=jnp.int32)}})  # fills [32, 64), [64, 96)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            meta = NpySegmentBackend.read_metadata({seg[64]!r})
            if meta is not None and meta.num_records == 32:
                os._exit(3)  # a crash once the thread committed the filled segments
            time.sleep(0.01)
        raise SystemExit("segment 64 was never committed")
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert os.path.exists(seg[32]) and os.path.exists(seg[64])
    np.testing.assert_array_equal(read_all(path)["x"], np.arange(16))
    with gr.ReplayWriter(path, capacity=1000, writer_id="a", segment_rows=32) as w:
        assert w.committed == 16
        assert not os.path.exists(seg[32]) and not os.path.exists(seg[64])  # dropped
        w.append({"x": jnp.arange(16, 70, dtype=jnp.int32)})
    np.testing.assert_array_equal(read_all(path)["x"], np.arange(70))


def test_segment_commits_wait_in_their_own_thread_and_flush_waits_for_them(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background, "WRITE_BATCH_BYTES", 1)
    release, started = threading.Event(), threading.Event()
    threads: list[str] = []
    real = NpySegmentBackend.stage_commit

    def stage_commit(self: Any, n: int, checksums: Any) -> list[int]:
        threads.append(threading.current_thread().name)
        if threading.current_thread().name == "grain_replay-device-syncs":
            started.set()
            assert release.wait(30), "the test never released the commit"
        return real(self, n, checksums)

    writes: list[int] = []
    real_write = PartWriter.write

    def write(self: Any, arrays: dict[str, np.ndarray], n: int, **kwargs: Any) -> None:
        real_write(self, arrays, n, **kwargs)
        writes.append(n)

    monkeypatch.setattr(NpySegmentBackend, "stage_commit", stage_commit)
    monkeypatch.setattr(PartWriter, "write", write)
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path, capacity=1000, writer_id="a", segment_rows=2 * ROWS)
    for i in range(2):
        w.append(_device(_block(i)))  # fills [0, 32): its commit blocks
    assert started.wait(30)
    for i in range(2, 5):  # written meanwhile: the commit holds up neither append nor write
        w.append(_device(_block(i)))
    _wait_until(lambda: len(writes) == 5, "the writes behind the blocked commit")
    flushed = threading.Event()
    t = threading.Thread(target=lambda: (w.flush(), flushed.set()))
    t.start()
    time.sleep(0.2)
    assert not flushed.is_set(), "flush returned before the segment commit finished"
    release.set()
    t.join(30)
    assert flushed.is_set() and w.committed == 5 * ROWS
    w.close()
    assert threads[0] == "grain_replay-device-syncs"
    _assert_rows(path, list(range(5)))
