"""ReplayWriter.flush(wait=False): a commit queued behind the appended rows, run in the
background; visible once it completes, its failure raised by the next call, waited for by
flush() and close(), with capacity and eviction, on npy, hdf5 and zarr, and under SIGKILL."""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.store import parts as parts_lib
from grain_replay.store import progress as learners_lib
from grain_replay.writers.backends import HDF5Backend, NpyBackend, NpySegmentBackend, ZarrBackend
from grain_replay.writers.parts_writer import PartWriter
from grain_replay.writers.store_writer import StoreWriter
from tests.helpers.store_reads import read_all

SUFFIXES = {"npy": "s", "hdf5": "s.h5", "zarr": "s.zarr"}
PLAIN_BACKENDS = {"npy": NpyBackend, "hdf5": HDF5Backend, "zarr": ZarrBackend}
SEGMENT_BACKENDS = {"npy": NpySegmentBackend, "hdf5": HDF5Backend, "zarr": ZarrBackend}
BOUNDED = {"capacity": 1000, "writer_id": "actor-0"}
THREAD = "grain_replay-device-writes"
ROWS = 16


def _path(tmp_path: Any, fmt: str) -> str:
    return str(tmp_path / SUFFIXES[fmt])


def _block(i: int, rows: int = ROWS) -> dict[str, np.ndarray]:
    base = i * rows + np.arange(rows)
    return {
        "obs": (base[:, None] * np.ones(3)).astype(np.float32),
        "action": base.astype(np.int32),
        "done": base % 3 == 0,
    }


def _device(block: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: jnp.asarray(v) for k, v in block.items()}


def _expected(blocks: range | list[int]) -> dict[str, np.ndarray]:
    parts = [_block(i) for i in blocks]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _assert_rows(got: dict[str, np.ndarray], blocks: range | list[int]) -> None:
    want = _expected(blocks)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The writer thread's commits (the store's flush, run for flush(wait=False)) wait
    for ``release``; ``entered`` is set once one has begun. Flushes of the caller's
    thread (flush(), close()) are not held."""
    state: dict[str, Any] = {"release": threading.Event(), "entered": threading.Event()}
    for cls in (StoreWriter, PartWriter):
        real = cls.flush

        def flush(self: Any, _real: Any = real) -> int:
            if threading.current_thread().name == THREAD:
                state["entered"].set()
                assert state["release"].wait(30), "the test never released the commit"
            return _real(self)

        monkeypatch.setattr(cls, "flush", flush)
    yield state
    state["release"].set()


def _reader_rows(src: Any) -> dict[str, np.ndarray]:
    return src.read_batch(np.arange(len(src)))


# -- visibility ------------------------------------------------------------------------


@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
@pytest.mark.parametrize("fmt", list(SUFFIXES))
def test_background_commit_visible_to_a_refreshed_reader_once_complete(
    tmp_path: Any, held: dict[str, Any], fmt: str, bounded: bool
) -> None:
    path = _path(tmp_path, fmt)
    w = gr.ReplayWriter(path, format=fmt, **(BOUNDED if bounded else {}))
    w.append(_device(_block(0)))
    assert w.flush() == ROWS  # blocking: not held
    src = gr.open_source(path)
    assert len(src) == ROWS
    w.append(_device(_block(1)))
    w.append(_block(2))  # a host block queued behind the device one
    assert w.flush(wait=False) == 3 * ROWS  # returns while the commit is held
    assert held["entered"].wait(30)
    w.append(_device(_block(3)))  # appends go on while the commit runs
    assert w.committed == ROWS and len(w) == 4 * ROWS
    assert src.refresh() == ROWS, "a reader saw rows of a commit not yet complete"
    held["release"].set()
    _wait_until(lambda: w.committed == 3 * ROWS, "the background commit completes")
    assert src.refresh() == 3 * ROWS
    _assert_rows(_reader_rows(src), range(3))
    src.close()
    w.close()
    assert w.committed == 4 * ROWS
    _assert_rows(read_all(path), range(4))


def test_host_only_writer_commits_in_the_background(tmp_path: Any, held: dict[str, Any]) -> None:
    path = _path(tmp_path, "npy")
    with gr.ReplayWriter(path) as w:
        w.append(_block(0))
        assert THREAD not in _threads()  # host appends to an idle writer: in the caller
        assert w.flush(wait=False) == ROWS
        assert held["entered"].wait(30)
        buf = _block(1)
        w.append(buf)  # queued behind the commit (its arrays copied): the caller goes on
        buf["action"][:] = -1
        assert w.committed == 0 and len(w) == 2 * ROWS
        held["release"].set()
        _wait_until(lambda: w.committed == ROWS, "the background commit completes")
        assert len(gr.open_source(path)) == ROWS
    _assert_rows(read_all(path), range(2))


def test_several_background_commits_in_order(tmp_path: Any, held: dict[str, Any]) -> None:
    path = _path(tmp_path, "zarr")
    with gr.ReplayWriter(path, **BOUNDED) as w:
        for i in range(4):
            w.append(_device(_block(i)))
            assert w.flush(wait=False) == (i + 1) * ROWS
        assert held["entered"].wait(30) and w.committed == 0
        held["release"].set()
        _wait_until(lambda: w.committed == 4 * ROWS, "the queued commits complete")
        assert len(gr.open_source(path)) == 4 * ROWS
    _assert_rows(read_all(path), range(4))


def test_background_flush_with_nothing_new_queues_nothing(tmp_path: Any) -> None:
    path = _path(tmp_path, "npy")
    w = gr.ReplayWriter(path)
    assert w.flush(wait=False) == 0  # nothing appended
    w.append(_block(0))
    assert w.flush() == ROWS
    assert w.flush(wait=False) == ROWS  # nothing since that flush
    assert THREAD not in _threads(), "a commit of nothing started the thread"
    w.close()
    assert w.flush(wait=False) == ROWS and w.flush() == ROWS  # closed: the committed N
    assert w.committed == ROWS


# -- waiting for it ----------------------------------------------------------------------


@pytest.mark.parametrize("waits_by", ["flush", "close"])
@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_flush_and_close_wait_for_a_background_commit(
    tmp_path: Any, held: dict[str, Any], bounded: bool, waits_by: str
) -> None:
    path = _path(tmp_path, "hdf5")
    w = gr.ReplayWriter(path, **(BOUNDED if bounded else {}))
    w.append(_device(_block(0)))
    w.flush(wait=False)
    w.append(_device(_block(1)))
    assert held["entered"].wait(30)
    returned = threading.Event()
    t = threading.Thread(target=lambda: (getattr(w, waits_by)(), returned.set()))
    t.start()
    time.sleep(0.3)
    assert not returned.is_set(), f"{waits_by}() returned before the background commit"
    held["release"].set()
    t.join(30)
    assert returned.is_set() and w.committed == 2 * ROWS
    w.close()
    _assert_rows(read_all(path), range(2))


# -- failures ----------------------------------------------------------------------------


def _fail_commits(monkeypatch: pytest.MonkeyPatch, fmt: str, bounded: bool) -> dict[str, bool]:
    """The store's commit step fails with EIO once ``armed`` (a plain store's commit, a
    writer part's segment staging): the disk failing under the commit's fsync rounds."""
    state = {"armed": False}
    cls = SEGMENT_BACKENDS[fmt] if bounded else PLAIN_BACKENDS[fmt]
    name = "stage_commit" if bounded else "commit"
    real = getattr(cls, name)

    def commit(self: Any, n: int, checksums: Any) -> Any:
        if state["armed"]:
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(self, n, checksums)

    monkeypatch.setattr(cls, name, commit)
    return state


@pytest.mark.parametrize("raised_by", ["append", "flush", "close"])
@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
@pytest.mark.parametrize("fmt", list(SUFFIXES))
def test_failing_background_commit_raised_by_the_next_call(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fmt: str, bounded: bool, raised_by: str
) -> None:
    path = _path(tmp_path, fmt)
    kwargs = BOUNDED if bounded else {}
    inject = _fail_commits(monkeypatch, fmt, bounded)
    w = gr.ReplayWriter(path, format=fmt, **kwargs)
    w.append(_device(_block(0)))
    w.append(_device(_block(1)))
    assert w.flush(wait=False) == 2 * ROWS
    _wait_until(lambda: w.committed == 2 * ROWS, "the first background commit completes")
    inject["armed"] = True
    w.append(_device(_block(2)))
    assert w.flush(wait=False) == 3 * ROWS
    _wait_until(lambda: THREAD not in _threads(), "the thread stops at the failure")
    call = {
        "append": lambda: w.append(_device(_block(3))),
        "flush": w.flush,
        "close": w.close,
    }[raised_by]
    with pytest.raises(gr.BackgroundWriteError) as info:
        call()
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err.__cause__, OSError)
    assert err.leaf == ""  # a commit syncs every leaf at once
    msg = str(err)
    assert path in msg and "background commit (flush(wait=False)) of rows [32, 48)" in msg
    assert "every leaf" in msg and "Input/output error" in msg
    assert "(32 rows) is intact" in msg and "reopen" in msg
    inject["armed"] = False
    if raised_by != "close":
        with pytest.raises(gr.GrainReplayError, match="stopped after a failed background"):
            w.append(_block(3))
        with pytest.raises(gr.GrainReplayError, match="stopped after a failed background"):
            w.flush(wait=False)
    w.close()  # releases the store; the error was raised already
    assert w.committed == 2 * ROWS
    # What the completed background commit committed is intact, and the store reopens.
    _assert_rows(read_all(path), range(2))
    with gr.ReplayWriter(path, format=fmt, **kwargs) as again:
        assert again.committed == 2 * ROWS
        again.append(_device(_block(2)))
        again.flush(wait=False)
    _assert_rows(read_all(path), range(3))


def test_failing_write_before_a_background_commit_names_the_leaf(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _path(tmp_path, "npy")
    real = NpySegmentBackend.write
    armed = {"on": False}

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        if armed["on"] and "done" in arrays:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(self, arrays, start)

    monkeypatch.setattr(NpySegmentBackend, "write", write)
    w = gr.ReplayWriter(path, **BOUNDED)
    w.append(_device(_block(0)))
    w.flush()
    armed["on"] = True
    w.append(_device(_block(1)))
    w.flush(wait=False)  # the thread writes the queued rows, fails: no commit
    with pytest.raises(gr.BackgroundWriteError, match="failed for leaf 'done'") as info:
        w.flush()
    assert info.value.leaf == "done" and "rows [16, 32)" in str(info.value)
    w.close()
    _assert_rows(read_all(path), [0])


def _publish_blocking_learner(path: str) -> None:
    """A live learner (another host, fresh heartbeat) that has drawn nothing and could draw
    its next batch: a writer of this store is ahead past 8 rows (samples_per_insert 1,
    tolerance 8)."""
    learners_lib.publish(
        os.path.join(path, "learners"),
        learners_lib.Progress(
            name="process-0-of-1.json",
            sampled=0,
            drawn=0,
            batch=4,
            samples_per_insert=1.0,
            tolerance=8.0,
            min_size=0,
            heartbeat=time.time(),
            stale_after=600.0,
            pid=1,
            host=socket.gethostname() + "-other",
        ),
    )


def test_background_flush_keeps_the_rate_limit_wait(tmp_path: Any) -> None:
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path, "npy", writer_id="w", rate_limit_timeout=0.2)
    w.append(_device(_block(0, rows=4)))
    assert w.flush() == 4
    _publish_blocking_learner(path)
    w.append(_device(_block(1, rows=20)))
    with pytest.raises(gr.RateLimitTimeoutError, match="4 rows inserted and 20 more pending"):
        w.flush(wait=False)
    assert w.committed == 4 and len(w) == 24  # nothing queued: the rows stay pending
    os.unlink(os.path.join(path, "learners", "process-0-of-1.json"))  # the learner goes
    assert w.flush(wait=False) == 24
    w.close()
    assert len(gr.open_source(path)) == 24


# -- capacity and eviction ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(SUFFIXES))
def test_background_commits_evict_and_a_reader_keeps_its_snapshot(tmp_path: Any, fmt: str) -> None:
    path = _path(tmp_path, fmt)
    capacity = 4 * ROWS
    w = gr.ReplayWriter(path, format=fmt, capacity=capacity, writer_id="a", segment_rows=ROWS)
    blocks = 12
    src = None
    snapshot: dict[str, np.ndarray] = {}
    for i in range(blocks):
        w.append(_device(_block(i)))
        upto = w.flush(wait=False)
        if i == 4:
            _wait_until(lambda upto=upto: w.committed == upto, "the commit completes")
            src = gr.open_source(path)
            snapshot = _reader_rows(src)
            _assert_rows(snapshot, range(1, 5))  # the newest 4 blocks
    assert w.flush() == blocks * ROWS
    assert w.live == capacity
    assert src is not None
    # Evicted since, and still readable as the reader's snapshot had them.
    _assert_rows(_reader_rows(src), range(1, 5))
    assert src.refresh() == capacity
    _assert_rows(_reader_rows(src), range(blocks - 4, blocks))
    src.close()
    w.close()
    on_disk = [n for n in os.listdir(parts_lib.writer_dir(path, "a")) if n.startswith("seg")]
    assert len(on_disk) <= capacity // ROWS + parts_lib.RETAIN_SEGMENTS + 1, on_disk
    _assert_rows(read_all(path), range(blocks - 4, blocks))


# -- SIGKILL -----------------------------------------------------------------------------

_CHILD = """
import sys, jax.numpy as jnp, numpy as np, grain_replay as gr
path, bounded = sys.argv[1], sys.argv[2] == "1"
kwargs = {"capacity": 100_000, "writer_id": "a", "segment_rows": 64} if bounded else {}
w = gr.ReplayWriter(path, format="npy", **kwargs)
seen, i = 0, 0
while True:
    w.append({"x": jnp.arange(i * 16, i * 16 + 16, dtype=jnp.int32)})
    i += 1
    if i % 3 == 0:
        print("Q", len(w), flush=True)  # before the call: a kill may follow it at once
        w.flush(wait=False)
    if w.committed != seen:
        seen = w.committed
        print("C", seen, flush=True)
"""


@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_sigkill_loses_only_rows_after_the_last_completed_commit(
    tmp_path: Any, bounded: bool
) -> None:
    rng = random.Random(0 if bounded else 1)
    for kill in range(2):
        path = str(tmp_path / f"s{kill}")
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_CHILD), path, "1" if bounded else "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        lines: list[str] = []

        def read(proc: Any = proc, lines: list[str] = lines) -> None:
            for line in proc.stdout:
                # Only whole lines: the child's print can reach the pipe in two writes (its
                # buffer fills between "C " and the number) and the kill can fall between.
                if line.endswith(b"\n"):
                    lines.append(line.decode()[:-1])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        want = 2 + kill
        while sum(x.startswith("C ") for x in lines) < want:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the child committed too slowly"
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))  # somewhere in appends, writes and commits
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        reader.join(10)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
        completed = max(int(x.split()[1]) for x in lines if x.startswith("C "))
        queued = max((int(x.split()[1]) for x in lines if x.startswith("Q ")), default=0)
        got = read_all(path)["x"]
        # Every row of the last completed commit, whole, and nothing past the last queued.
        assert completed <= len(got) <= max(queued, completed), (completed, len(got), queued)
        np.testing.assert_array_equal(got, np.arange(len(got)))
        kwargs = {"capacity": 100_000, "writer_id": "a", "segment_rows": 64} if bounded else {}
        with gr.ReplayWriter(path, format="npy", **kwargs) as w:  # continues after them
            assert w.committed == len(got)
            w.append({"x": jnp.arange(len(got), len(got) + 5, dtype=jnp.int32)})
            w.flush(wait=False)
        np.testing.assert_array_equal(read_all(path)["x"], np.arange(len(got) + 5))
