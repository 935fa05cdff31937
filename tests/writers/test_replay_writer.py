"""Tests of gr.ReplayWriter: append/flush/commit semantics, readers while writing, user errors."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from typing import Any, NamedTuple

import h5py
import numpy as np
import pytest
import zarr
from conformance import assert_same_tree

import grain_replay as gr
from grain_replay import tree as tree_lib

SUFFIXES = {"hdf5": "x.h5", "npy": "x", "zarr": "x.zarr"}
FORMATS = tuple(SUFFIXES)
KINDS = ("dict", "tuple", "namedtuple", "nested", "bare")
SOURCE_CLASSES = {"hdf5": gr.HDF5DataSource, "npy": gr.NpyDataSource, "zarr": gr.ZarrDataSource}


class Transition(NamedTuple):
    obs: Any
    action: Any
    reward: Any


class Step(NamedTuple):
    action: Any
    reward: Any


def _store(tmp_path: Any, fmt: str) -> str:
    return str(tmp_path / SUFFIXES[fmt])


def _block(kind: str, start: int, n: int) -> Any:
    """Rows ``[start, start + n)`` of a tree of ``kind``; values follow from the row index."""
    i = np.arange(start, start + n)
    obs = np.repeat(i.astype(np.float32)[:, None], 3, axis=1)
    action = i.astype(np.int64)
    reward = i * 0.5
    if kind == "dict":
        return {"obs": obs, "action": action, "reward": reward}
    if kind == "tuple":
        return (obs, action, reward)
    if kind == "namedtuple":
        return Transition(obs, action, reward)
    if kind == "nested":
        pixels = (i[:, None, None] + np.arange(4).reshape(1, 2, 2)).astype(np.uint8)
        return {
            "obs": {"pixels": pixels, "vec": obs},
            "steps": [Step(action.astype(np.int32), reward.astype(np.float32))],
            "done": i % 3 == 0,
        }
    if kind == "bare":
        return obs
    raise AssertionError(kind)


def _concat(blocks: list[Any]) -> Any:
    flat = [tree_lib.flatten(b) for b in blocks]
    treedef = flat[0][1]
    return tree_lib.unflatten(
        treedef, {k: np.concatenate([leaves[k] for leaves, _ in flat]) for k in flat[0][0]}
    )


def _read_all(path: str) -> tuple[int, Any]:
    src = gr.open_source(path)
    try:
        return len(src), src.read_batch(np.arange(len(src)))
    finally:
        src.close()


def _reader_types(src: gr.ReplaySource) -> dict[str, str]:
    return {k: type(r).__name__ for k, r in src._get_handle().readers.items()}


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- round trips --------------------------------------------------------------------------


def _assert_lock_free(path: str) -> None:
    """The writer lock is released (the lock file itself stays, by design)."""
    import fcntl

    lock = path + ".lock"
    if not os.path.exists(lock):
        return
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if still held
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_blocks_round_trip_equal_concatenation(tmp_path, fmt, kind):
    path = _store(tmp_path, fmt)
    sizes = [0, 1, 5, 0, 1, 33, 2]
    blocks, start = [], 0
    with gr.ReplayWriter(path) as w:
        for j, n in enumerate(sizes):
            blocks.append(_block(kind, start, n))
            w.append(blocks[-1])
            start += n
            if j % 3 == 2:
                w.flush()
    want = _concat(blocks)
    n, got = _read_all(path)
    assert n == sum(sizes)
    assert_same_tree(got, want)
    src = gr.open_source(path)
    assert type(src) is SOURCE_CLASSES[fmt]
    for i in (0, 1, n // 2, n - 1, -1):
        leaves, treedef = tree_lib.flatten(want)
        row = tree_lib.unflatten(treedef, {k: np.asarray(v)[i] for k, v in leaves.items()})
        got_row = src[i]
        assert tree_lib.flatten(got_row)[1] == treedef
        for key, value in tree_lib.flatten(got_row)[0].items():
            np.testing.assert_array_equal(value, tree_lib.flatten(row)[0][key])
    if kind == "namedtuple":
        assert type(src[0]) is Transition
    if kind == "nested":
        assert type(src[0]["steps"][0]) is Step


@pytest.mark.parametrize("fmt", FORMATS)
def test_first_append_of_zero_rows_creates_empty_store(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path) as w:
        w.append(_block("dict", 0, 0))
        assert os.path.exists(path)
        assert (len(w), w.committed) == (0, 0)
        src = gr.open_source(path)
        assert len(src) == 0
        assert src.spec["obs"].shape == (3,)
        with pytest.raises(IndexError):
            src[0]
        w.append(_block("dict", 0, 4))
    assert src.refresh() == 4
    assert_same_tree(src.read_batch([3, 0]), _concat([_block("dict", 3, 1), _block("dict", 0, 1)]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_append_accepts_jax_arrays(tmp_path, fmt):
    import jax.numpy as jnp

    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path) as w:
        w.append({"obs": jnp.arange(12, dtype=jnp.float32).reshape(4, 3), "a": jnp.arange(4)})
        w.append({"obs": np.ones((2, 3), np.float32), "a": np.arange(4, 6, dtype=np.int32)})
    n, got = _read_all(path)
    assert n == 6
    assert isinstance(got["obs"], np.ndarray) and got["a"].dtype == np.int32
    np.testing.assert_array_equal(got["a"], np.arange(6))
    np.testing.assert_array_equal(got["obs"][:4].ravel(), np.arange(12, dtype=np.float32))


@pytest.mark.parametrize(
    "fmt",
    [
        "hdf5",
        "npy",
        "zarr",
    ],
)
def test_append_big_endian_leaf_round_trips(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path) as w:
        w.append({"be": np.arange(5).astype(">f4"), "le": np.arange(5).astype("<i4")})
        w.flush()
        w.append({"be": np.arange(5, 8).astype(">f4"), "le": np.arange(5, 8).astype("<i4")})
    _, got = _read_all(path)
    np.testing.assert_array_equal(got["be"], np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(got["le"], np.arange(8))


@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param(
            "hdf5",
        ),
        "npy",
        "zarr",
    ],
)
def test_append_zero_size_row_leaf_round_trips(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path) as w:
        w.append({"empty": np.zeros((3, 0), np.float32), "a": np.arange(3)})
        w.append({"empty": np.zeros((2, 0), np.float32), "a": np.arange(3, 5)})
    n, got = _read_all(path)
    assert n == 5 and got["empty"].shape == (5, 0)
    np.testing.assert_array_equal(got["a"], np.arange(5))


# -- len / committed / flush / close -----------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_len_counts_pending_rows_committed_counts_flushed(tmp_path, fmt):
    w = gr.ReplayWriter(_store(tmp_path, fmt))
    assert (len(w), w.committed) == (0, 0)
    w.append(_block("dict", 0, 3))
    assert (len(w), w.committed) == (3, 0)
    w.append(_block("dict", 3, 1))
    w.append(_block("dict", 4, 0))
    assert (len(w), w.committed) == (4, 0)
    assert w.flush() == 4
    assert (len(w), w.committed) == (4, 4)
    assert w.flush() == 4  # nothing pending: no-op
    w.append(_block("dict", 4, 2))
    assert (len(w), w.committed) == (6, 4)
    assert "committed=4" in repr(w) and "pending=2" in repr(w) and repr(fmt) in repr(w)
    w.close()
    assert len(gr.open_source(w.path)) == 6


@pytest.mark.parametrize("fmt", FORMATS)
def test_close_commits_pending_rows_and_is_idempotent(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    w = gr.ReplayWriter(path)
    w.append(_block("dict", 0, 7))
    w.close()
    w.close()
    n, got = _read_all(path)
    assert n == 7
    assert_same_tree(got, _block("dict", 0, 7))
    with pytest.raises(gr.GrainReplayError, match="closed"):
        w.append(_block("dict", 7, 1))


@pytest.mark.parametrize("writer_id", [None, "a"])
def test_close_whose_commit_fails_still_closes_files_and_releases_lock(
    tmp_path, monkeypatch, writer_id
):
    path = _store(tmp_path, "npy")
    w = gr.ReplayWriter(path, writer_id=writer_id)
    w.append(_block("dict", 0, 3))
    w.flush()
    w.append(_block("dict", 3, 2))
    store = w._store
    closed = []
    if writer_id is not None:  # a part closes its segment files even when the commit fails
        backend = store._open.backend
        real = backend.close
        monkeypatch.setattr(backend, "close", lambda: closed.append(1) or real())

    def fail() -> int:
        raise OSError("disk full")

    monkeypatch.setattr(store, "flush", fail)
    with pytest.raises(OSError, match="disk full"):
        w.close()
    assert store.closed and w._store.closed
    assert closed == ([] if writer_id is None else [1])
    w.close()  # closed: nothing more to do
    with pytest.raises(gr.GrainReplayError, match="the ReplayWriter is closed"):
        w.append(_block("dict", 5, 1))
    with gr.ReplayWriter(path, writer_id=writer_id) as again:  # the lock was released
        assert again.committed == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_context_manager_commits_and_releases_lock(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path) as w:
        w.append(_block("dict", 0, 2))
        assert os.path.exists(path + ".lock")
    _assert_lock_free(path)
    assert _read_all(path)[0] == 2
    # The writer's __exit__ on an exception is the point: it spans the block.
    with pytest.raises(RuntimeError, match="boom"), gr.ReplayWriter(path) as w:  # noqa: PT012
        w.append(_block("dict", 2, 1))
        raise RuntimeError("boom")
    with gr.ReplayWriter(path) as w:  # the lock was released
        assert w.committed == 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_flush_every_commits_automatically(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path, flush_every=10) as w:
        w.append(_block("dict", 0, 4))
        assert w.committed == 0
        w.append(_block("dict", 4, 5))
        assert w.committed == 0
        w.append(_block("dict", 9, 3))
        assert (w.committed, len(w)) == (12, 12)
        assert len(gr.open_source(path)) == 12
        w.append(_block("dict", 12, 25))  # one block over the threshold commits at once
        assert w.committed == 37
        w.append(_block("dict", 37, 1))
        assert w.committed == 37


@pytest.mark.parametrize("flush_every", [0, -3])
def test_flush_every_non_positive_raises_value_error_and_leaves_no_lock(tmp_path, flush_every):
    path = _store(tmp_path, "zarr")
    with pytest.raises(ValueError, match="flush_every"):
        gr.ReplayWriter(path, flush_every=flush_every)
    _assert_lock_free(path)
    gr.ReplayWriter(path).close()


# -- readers while writing -------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_reader_opened_during_appends_sees_only_committed_rows(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    w = gr.ReplayWriter(path)
    w.append(_block("namedtuple", 0, 10))
    w.flush()
    w.append(_block("namedtuple", 10, 6))  # pending
    src = gr.open_source(path)
    assert len(src) == 10
    got = src.read_batch(np.arange(10))
    assert_same_tree(got, _block("namedtuple", 0, 10))
    for leaf in tree_lib.flatten(got)[0].values():
        assert len(leaf) == 10
    with pytest.raises(IndexError, match="10"):
        src[10]
    with pytest.raises(IndexError):
        src.read_batch([10])
    w.flush()
    assert len(src) == 10  # a source is a snapshot until refresh()
    assert_same_tree(src.read_batch(np.arange(10)), _block("namedtuple", 0, 10))
    fresh = gr.open_source(path)
    assert len(fresh) == 16
    assert_same_tree(fresh.read_batch(np.arange(16)), _block("namedtuple", 0, 16))
    w.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_refresh_picks_up_newly_committed_rows(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path) as w:
        w.append(_block("dict", 0, 3))
        w.flush()
        src = gr.open_source(path)
        np.testing.assert_array_equal(src[2]["obs"], np.full(3, 2, np.float32))
        assert int(src[2]["action"]) == 2
        before = repr(src)
        w.append(_block("dict", 3, 40))
        assert src.refresh() == 3
        w.flush()
        assert src.refresh() == 43
        assert repr(src) != before and "43" in repr(src)
        assert_same_tree(src.read_batch(np.arange(43)), _block("dict", 0, 43))
        np.testing.assert_array_equal(src[-1]["obs"], np.full(3, 42, np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_readers_of_replay_writer_stores_are_memory_mapped(tmp_path, fmt):
    """Several default-size chunks per leaf, all mapped into one array per leaf."""
    path = _store(tmp_path, fmt)
    n = 10_000
    with gr.ReplayWriter(path) as w:
        for start in range(0, n, 2500):
            i = np.arange(start, start + 2500)
            w.append({"obs": np.repeat(i[:, None], 64, 1).astype(np.float32), "i": i})
        w.flush()
        src = gr.open_source(path)
        assert set(_reader_types(src).values()) == {"ArrayReader"}, _reader_types(src)
        got = src.read_batch([n - 1, 0, 4097, 4097])
        np.testing.assert_array_equal(got["i"], [n - 1, 0, 4097, 4097])
        np.testing.assert_array_equal(got["obs"][:, 63], [n - 1, 0, 4097, 4097])


def test_zarr_all_zero_leaf_is_memory_mapped(tmp_path):
    path = _store(tmp_path, "zarr")
    with gr.ReplayWriter(path) as w:
        w.append({"done": np.zeros(10, bool), "i": np.arange(10)})
    src = gr.open_source(path)
    assert _reader_types(src) == {"done": "ArrayReader", "i": "ArrayReader"}


@pytest.mark.parametrize("case", ["rows", "empty", "many_chunks"])
def test_hdf5_reader_opened_before_writer_in_same_process_does_not_block_it(tmp_path, case):
    path = _store(tmp_path, "hdf5")
    rows = {"rows": 50, "empty": 0, "many_chunks": 4100}[case]
    with gr.ReplayWriter(path, chunk_rows=1 if case == "many_chunks" else None) as w:
        w.append({"i": np.arange(rows)})
    src = gr.open_source(path)
    assert len(src.read_batch(np.arange(min(rows, 3)))["i"]) == min(rows, 3)  # opens handle
    with gr.ReplayWriter(path) as w:
        w.append({"i": np.arange(rows, rows + 5)})
        w.flush()
        assert src.refresh() == rows + 5
        np.testing.assert_array_equal(src.read_batch(np.arange(rows + 5))["i"], np.arange(rows + 5))


def test_hdf5_writer_blocked_by_an_open_read_handle_says_to_close_it(tmp_path):
    import h5py

    path = _store(tmp_path, "hdf5")
    with gr.ReplayWriter(path) as w:
        w.append({"i": np.arange(5)})
    for locking in (True, False):  # HDF5 words the two refusals differently
        with h5py.File(path, "r", locking=locking):
            with pytest.raises(gr.WriterBusyError, match=r"read-only in this process.*close"):
                gr.ReplayWriter(path)
    with gr.ReplayWriter(path) as w:  # the refusal left nothing behind: the lock is free
        w.append({"i": np.arange(5, 7)})
    assert len(gr.open_source(path)) == 7


# -- reopening ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_reopen_continues_after_committed_rows(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path) as w:
        w.append(_block("namedtuple", 0, 5))
    with gr.ReplayWriter(path) as w:
        assert (w.committed, len(w)) == (5, 5)
        w.append(_block("namedtuple", 5, 1))
        w.append(_block("namedtuple", 6, 8))
    n, got = _read_all(path)
    assert n == 14
    assert_same_tree(got, _block("namedtuple", 0, 14))


_ABANDON = """
import os, sys
import numpy as np
import grain_replay as gr
path = sys.argv[1]
def block(start, n):
    i = np.arange(start, start + n)
    return {"obs": np.repeat(i[:, None], 3, 1).astype(np.float32), "i": i}
w = gr.ReplayWriter(path)
w.append(block(0, 5))
w.flush()
w.append(block(5, 7000))   # written to the store, never committed
sys.stdout.write(f"{w.committed} {len(w)}\\n")
sys.stdout.flush()
os._exit(0)                # no close(), no __del__, no atexit
"""


@pytest.mark.parametrize("fmt", FORMATS)
def test_reopen_drops_uncommitted_rows_of_abandoned_writer(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    out = _run_python(_ABANDON, path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "7005"]
    n, got = _read_all(path)
    assert n == 5
    np.testing.assert_array_equal(got["i"], np.arange(5))
    with gr.ReplayWriter(path) as w:  # the dead writer's lock is gone with its process
        assert (w.committed, len(w)) == (5, 5)
        w.append({"obs": np.full((3, 3), -1, np.float32), "i": np.arange(-3, 0)})
    n, got = _read_all(path)
    assert n == 8
    np.testing.assert_array_equal(got["i"], [0, 1, 2, 3, 4, -3, -2, -1])
    np.testing.assert_array_equal(got["obs"][5:], np.full((3, 3), -1, np.float32))
    if fmt == "npy":  # uncommitted bytes are cut off, not only hidden
        assert os.path.getsize(os.path.join(path, "i.npy")) < 7000 * 8


# -- one writer per store ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_second_writer_raises_writer_busy_error(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    first = gr.ReplayWriter(path)
    first.append(_block("dict", 0, 2))
    with pytest.raises(gr.WriterBusyError, match="Fix") as info:
        gr.ReplayWriter(path)
    assert isinstance(info.value, BlockingIOError)
    assert isinstance(info.value, gr.GrainReplayError)
    assert path in str(info.value)
    first.append(_block("dict", 2, 1))  # the refused writer did not disturb the first
    first.close()
    with gr.ReplayWriter(path) as w:
        assert w.committed == 3


def test_writer_in_other_process_raises_writer_busy_error(tmp_path):
    path = _store(tmp_path, "npy")
    code = """
    import sys
    import grain_replay as gr
    try:
        gr.ReplayWriter(sys.argv[1])
    except gr.WriterBusyError as e:
        print("busy", isinstance(e, BlockingIOError))
    """
    with gr.ReplayWriter(path) as w:
        w.append(_block("dict", 0, 1))
        out = _run_python(code, path)
    assert out.stdout.split() == ["busy", "True"], out.stderr


def test_writer_lock_holds_when_release_races_with_next_acquire(tmp_path, monkeypatch):
    path = _store(tmp_path, "zarr")
    first = gr.ReplayWriter(path)
    real_flock = fcntl.flock

    def flock_after_first_closes(fd, op):
        # The second writer has opened the lock file; the first closes right now.
        first.close()
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_first_closes)
    second = gr.ReplayWriter(path)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    try:
        with pytest.raises(gr.WriterBusyError):
            gr.ReplayWriter(path).close()
    finally:
        second.close()


# -- user errors ---------------------------------------------------------------------------------


def _mismatches() -> dict[str, tuple[Any, str]]:
    good = _block("dict", 0, 2)
    return {
        "missing_leaf": ({"obs": good["obs"], "action": good["action"]}, "reward"),
        "extra_leaf": ({**good, "done": np.zeros(2, bool)}, "done"),
        "container": ((good["obs"], good["action"], good["reward"]), "obs"),
        "dtype": ({**good, "action": good["action"].astype(np.int32)}, "action"),
        "row_shape": ({**good, "obs": np.zeros((2, 4), np.float32)}, "obs"),
        "row_rank": ({**good, "reward": good["reward"][:, None]}, "reward"),
    }


@pytest.mark.parametrize("case", list(_mismatches()))
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_mismatched_tree_raises_invalid_tree_error(tmp_path, fmt, case):
    path = _store(tmp_path, fmt)
    tree, leaf = _mismatches()[case]
    with gr.ReplayWriter(path) as w:
        w.append(_block("dict", 0, 3))
        w.flush()
        w.append(_block("dict", 3, 1))
        with pytest.raises(gr.InvalidTreeError) as info:
            w.append(tree)
        message = str(info.value)
        assert repr(leaf) in message and "Fix" in message and path in message, message
        assert isinstance(info.value, TypeError)
        assert (w.committed, len(w)) == (3, 4)  # nothing of the bad block was taken
        w.append(_block("dict", 4, 2))
    n, got = _read_all(path)
    assert n == 6
    assert_same_tree(got, _block("dict", 0, 6))


@pytest.mark.parametrize("fmt", FORMATS)
def test_append_leaves_of_different_lengths_raises_invalid_tree_error(tmp_path, fmt):
    with gr.ReplayWriter(_store(tmp_path, fmt)) as w:
        with pytest.raises(gr.InvalidTreeError, match=r"'obs' has 3, 'action' has 2.*Fix"):
            w.append({"obs": np.zeros((3, 2)), "action": np.zeros(2)})
        assert len(w) == 0


def _write_foreign(path: str, fmt: str) -> None:
    data = np.arange(10)
    if fmt == "hdf5":
        with h5py.File(path, "w") as f:
            f.create_dataset("a", data=data, chunks=(4,), maxshape=(None,))
    elif fmt == "npy":
        os.makedirs(path)
        np.save(os.path.join(path, "a.npy"), data)
    else:
        zarr.open_group(path, mode="w").create_array("a", data=data)


@pytest.mark.parametrize("fmt", FORMATS)
def test_append_to_foreign_store_raises_invalid_store_error(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    _write_foreign(path, fmt)
    for _ in range(2):  # the refused writer released its lock: the same error again
        with pytest.raises(gr.InvalidStoreError, match="Fix") as info:
            gr.ReplayWriter(path)
        assert path in str(info.value) and "metadata" in str(info.value)
    _assert_lock_free(path)
    src = gr.open_source(path)
    np.testing.assert_array_equal(src.read_batch(np.arange(10))["a"], np.arange(10))


@pytest.mark.parametrize("fmt", FORMATS)
def test_metadata_growing_with_checksums_stays_readable(tmp_path, monkeypatch, fmt):
    """Many leaves and many checksum blocks: the committed metadata outgrows its first size."""
    integrity = pytest.importorskip("grain_replay.store.integrity")
    monkeypatch.setattr(integrity, "CHECKSUM_BLOCK_BYTES", 16)
    path = _store(tmp_path, fmt)
    leaves = {f"leaf_with_a_long_name_{j}": np.arange(j, j + 10) for j in range(8)}
    with gr.ReplayWriter(path) as w:
        for start in range(0, 400, 10):
            w.append({k: v + start for k, v in leaves.items()})
            w.flush()
    with gr.ReplayWriter(path) as w:  # reopens (and resumes the checksums)
        w.append({k: v + 400 for k, v in leaves.items()})
    n, got = _read_all(path)
    assert n == 410 and list(got) == list(leaves)
    for j, key in enumerate(leaves):
        np.testing.assert_array_equal(got[key], np.arange(j, j + 410))
    src = gr.open_source(path)
    assert integrity.verify_source(src, getattr(src, "checksums", None)).ok


@pytest.mark.parametrize("fmt", ["npy", "zarr"])
def test_append_to_one_shot_store_continues_it(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    gr.write(path, _block("nested", 0, 9))
    with gr.ReplayWriter(path) as w:
        assert (w.committed, len(w)) == (9, 9)
        w.append(_block("nested", 9, 4))
    n, got = _read_all(path)
    assert n == 13
    assert_same_tree(got, _block("nested", 0, 13))
    with gr.ReplayWriter(path) as w:
        w.append(_block("nested", 13, 1))
    assert _read_all(path)[0] == 14


def test_append_to_one_shot_contiguous_hdf5_raises_invalid_store_error(tmp_path):
    path = _store(tmp_path, "hdf5")
    gr.write(path, _block("dict", 0, 4))
    with pytest.raises(gr.InvalidStoreError, match="Fix") as info:
        gr.ReplayWriter(path)
    message = str(info.value)
    assert path in message and "gr.write" in message and "'obs'" in message
    _assert_lock_free(path)
    n, got = _read_all(path)
    assert n == 4
    assert_same_tree(got, _block("dict", 0, 4))


def test_append_to_one_shot_chunked_hdf5_continues_it(tmp_path):
    path = _store(tmp_path, "hdf5")
    gr.write(path, _block("dict", 0, 10), chunk_rows=4)
    with gr.ReplayWriter(path) as w:
        w.append(_block("dict", 10, 7))
    n, got = _read_all(path)
    assert n == 17
    assert_same_tree(got, _block("dict", 0, 17))


def test_append_to_one_shot_compressed_hdf5_is_refused_like_create(tmp_path):
    path = _store(tmp_path, "hdf5")
    gr.write(path, _block("dict", 0, 10), compression="gzip")
    with pytest.raises(gr.InvalidStoreError, match="Fix"):
        gr.ReplayWriter(path).close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_argument_not_matching_store_raises_invalid_store_error(tmp_path, fmt):
    path = _store(tmp_path, fmt)
    with gr.ReplayWriter(path) as w:
        w.append(_block("dict", 0, 1))
    other = next(f for f in FORMATS if f != fmt)
    with pytest.raises(gr.InvalidStoreError, match=f"format={fmt!r}") as info:
        gr.ReplayWriter(path, format=other)
    assert "Fix" in str(info.value) and path in str(info.value)
    with gr.ReplayWriter(path, format=fmt) as w:
        assert w.committed == 1


def test_unknown_format_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="parquet"):
        gr.ReplayWriter(str(tmp_path / "x.h5"), format="parquet")
    _assert_lock_free(str(tmp_path / "x.h5"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_argument_overrides_suffix_of_new_store(tmp_path, fmt):
    path = str(tmp_path / "store.bin")
    with gr.ReplayWriter(path, format=fmt) as w:
        w.append(_block("dict", 0, 3))
    src = gr.open_source(path)
    assert type(src) is SOURCE_CLASSES[fmt]
    assert len(src) == 3


def test_hdf5_compression_raises_value_error_and_creates_nothing(tmp_path):
    path = _store(tmp_path, "hdf5")
    with gr.ReplayWriter(path, compression="gzip") as w:
        with pytest.raises(ValueError, match="Fix"):
            w.append(_block("dict", 0, 3))
    assert not os.path.exists(path)


def test_npy_compression_raises_value_error(tmp_path):
    path = _store(tmp_path, "npy")
    with gr.ReplayWriter(path, compression="zstd") as w:
        with pytest.raises(ValueError, match="Fix"):
            w.append(_block("dict", 0, 3))
    assert not os.path.exists(path)


def test_zarr_compression_zstd_round_trips(tmp_path):
    path = _store(tmp_path, "zarr")
    with gr.ReplayWriter(path, compression="zstd", chunk_rows=8) as w:
        for start in range(0, 50, 10):
            w.append(_block("nested", start, 10))
            w.flush()
    codecs = [c.to_dict()["name"] for c in zarr.open_group(path)["obs/vec"].metadata.codecs]
    assert "zstd" in codecs
    n, got = _read_all(path)
    assert n == 50
    assert_same_tree(got, _block("nested", 0, 50))
