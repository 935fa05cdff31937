"""Thread pools used by a non-daemon thread while the interpreter exits.

threading's exit hooks run before the non-daemon threads are joined, and the one of
``concurrent.futures`` shuts every thread pool: each ``submit`` is refused ("cannot
schedule new futures after interpreter shutdown"), and a first import of the pool module
then is refused too ("can't register atexit after shutdown"). A thread still at work
(an actor flushing its writer, a thread reading batches) when the main thread ends met
these errors, or hung waiting for a pool's result that never came. Each script below
runs in a fresh interpreter: its non-daemon thread waits until the main thread has
ended (``threading.main_thread().join()`` returns once those hooks ran), then uses the
component; the pool's work runs in that thread instead, once.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from grain_replay.pipeline import shutdown

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120.0  # a deadline for a hang, not a timing

_SCRIPT = """\
import sys, threading
import numpy as np
import grain_replay as gr

path = sys.argv[1]
{setup}

def at_exit():
    threading.main_thread().join()  # returns once threading's exit hooks shut every pool
{body}
    print("ok", flush=True)

threading.Thread(target=at_exit).start()
"""


def _run_at_exit(path: Path, setup: str, body: str) -> None:
    script = _SCRIPT.format(
        setup=textwrap.dedent(setup), body=textwrap.indent(textwrap.dedent(body), "    ")
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=str(path.parent),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[-1:] == ["ok"], proc.stdout + proc.stderr


def test_a_writer_first_flushed_at_interpreter_exit_commits(tmp_path: Path) -> None:
    """The actor of the README whose first flush comes after the main thread ended: the
    fsync pool, first needed then, could not even be made."""
    _run_at_exit(
        tmp_path / "s",
        """
        w = gr.ReplayWriter(path, writer_id="a", capacity=100)
        w.append({"x": np.arange(10, dtype=np.float32).reshape(5, 2)})
        """,
        """
        w.flush()
        w.append({"x": np.arange(10, 20, dtype=np.float32).reshape(5, 2)})
        w.close()
        got = gr.open_source(path).read_batch(np.arange(10))["x"]
        assert (got == np.arange(20, dtype=np.float32).reshape(10, 2)).all(), got
        """,
    )


def test_a_compressed_read_at_interpreter_exit_decodes_every_chunk(tmp_path: Path) -> None:
    """Chunks are decoded on the shared decode pool: a read before the exit made it, the
    read after (of chunks not cached) finds it shut."""
    _run_at_exit(
        tmp_path / "s.zarr",
        """
        x = np.arange(4000, dtype=np.int64).reshape(1000, 4)
        gr.write(path, {"x": x}, format="zarr", chunk_rows=50, compression="zstd")
        source = gr.open_source(path)
        assert (source.read_batch(np.arange(200))["x"] == x[:200]).all()  # 4 chunks
        """,
        """
        idx = np.arange(999, 199, -3)
        assert (source.read_batch(idx)["x"] == x[idx]).all()
        """,
    )


def test_a_loader_reading_ahead_at_interpreter_exit_hands_out_every_batch(
    tmp_path: Path,
) -> None:
    """``read_options`` threads read ahead on the loader's pool, in this process."""
    _run_at_exit(
        tmp_path / "s.npy",
        """
        import grain
        x = np.arange(64, dtype=np.int64)
        gr.write(path, {"x": x}, format="npy")
        loader = gr.make_data_loader(
            gr.open_source(path), batch_size=4, shuffle=False, num_epochs=1,
            read_options=grain.ReadOptions(num_threads=2, prefetch_buffer_size=3),
        )
        it = iter(loader)
        first = next(it)["x"]
        """,
        """
        rest = [b["x"] for b in it]
        assert (np.concatenate([first, *rest]) == x).all()
        """,
    )


def test_a_device_put_with_put_threads_at_interpreter_exit_hands_out_every_batch(
    tmp_path: Path,
) -> None:
    """``sharded_device_put``'s producer converts on put threads when a batch is large:
    its refused submit ended the producer and left the consumer waiting for ever."""
    _run_at_exit(
        tmp_path / "unused",
        """
        import concurrent.futures.thread  # as an earlier pool would have: submit refuses
        from grain_replay.device.prefetch import Prefetcher

        def batches():
            threading.main_thread().join()
            yield from range(6)

        p = Prefetcher(
            batches(), lambda group: [b * 10 for b in group], depth=2,
            capture_state=False, moves=(1, 2),
        )
        """,
        """
        got = []
        while True:
            try:
                got.append(p.next()[0])
            except StopIteration:
                break
        assert got == [0, 10, 20, 30, 40, 50], got
        """,
    )


def test_stats_computed_at_interpreter_exit(tmp_path: Path) -> None:
    _run_at_exit(
        tmp_path / "s.npy",
        """
        x = np.arange(3000, dtype=np.float32).reshape(1000, 3)
        gr.write(path, {"x": x}, format="npy")
        source = gr.open_source(path)
        """,
        """
        stats = gr.compute_stats(source)
        assert np.allclose(stats["x"]["mean"], x.mean(axis=0)), stats
        """,
    )


def test_an_rlds_dataset_indexed_at_interpreter_exit(tmp_path: Path) -> None:
    """Its shards are indexed on a pool of their own, at the first look at its length."""
    from rlds_fixture import write_rlds

    write_rlds(tmp_path / "d", lengths=(5, 3, 7, 4), shards=2)
    _run_at_exit(
        tmp_path / "d",
        "",
        """
        source = gr.RLDSDataSource(path, progress=False)
        assert len(source) == 19, len(source)
        """,
    )


# -- the mechanism --------------------------------------------------------------------


def _shut_pool() -> concurrent.futures.ThreadPoolExecutor:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.shutdown()
    return pool


def test_a_refused_task_runs_in_the_calling_thread_once() -> None:
    import threading

    calls: list[tuple[int, str]] = []

    def task(n: int) -> int:
        calls.append((n, threading.current_thread().name))
        return 2 * n

    future = shutdown.submit(_shut_pool(), task, 21)
    assert future.result() == 42
    assert calls == [(21, threading.current_thread().name)]

    def fail() -> None:
        raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk"):
        shutdown.submit(_shut_pool(), fail).result()


def test_a_task_a_live_pool_takes_runs_there() -> None:
    with concurrent.futures.ThreadPoolExecutor(1, "grain_replay-test") as pool:
        import threading

        name = shutdown.submit(pool, lambda: threading.current_thread().name).result()
    assert name.startswith("grain_replay-test")


def test_other_refusals_are_raised() -> None:
    class Broken(concurrent.futures.Executor):
        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise concurrent.futures.BrokenExecutor("an initializer failed")

    with pytest.raises(concurrent.futures.BrokenExecutor):
        shutdown.submit(Broken(), print)


def test_a_pool_first_needed_at_interpreter_exit_runs_its_tasks_here(tmp_path: Path) -> None:
    """The pool module first imported after threading's exit hooks ran: thread_pool()
    hands out an executor running each task in the calling thread."""
    _run_at_exit(
        tmp_path / "unused",
        "",
        """
        from grain_replay.pipeline import shutdown  # imported now, at exit
        pool = shutdown.thread_pool(2, "grain_replay-test")
        assert shutdown.submit(pool, sum, [1, 2, 3]).result() == 6
        assert pool.submit(threading.current_thread).result() is threading.current_thread()
        """,
    )


# -- pools shut by a close() while another thread reads --------------------------------


class _Remote:
    def call(self, fn, what):  # type: ignore[no-untyped-def]
        return fn()


def test_a_remote_zarr_read_racing_its_handles_close_still_reads() -> None:
    """``ZarrHandle.close()`` (a ``refresh()`` of a remote store reopens its handle) shuts
    its chunk-fetch pool under a read in flight on another thread."""
    from grain_replay.sources.zarr import remote as zarr_remote

    arr = np.arange(40).reshape(20, 2)
    read = zarr_remote.remote_block_reader(arr, 5, 20, _Remote(), _shut_pool(), "x")
    got = read([3, 0, 2])
    assert [b.tolist() for b in got] == [
        arr[15:20].tolist(),
        arr[0:5].tolist(),
        arr[10:15].tolist(),
    ]


def test_a_zarr_metadata_fetch_at_interpreter_exit(tmp_path: Path) -> None:
    """A remote store's handle, first opened at exit (a new process's first read), fetches
    its arrays' metadata on a pool of its own."""
    _run_at_exit(
        tmp_path / "unused",
        "",
        """
        from grain_replay.sources.zarr import remote as zarr_remote
        group = {"a": 1, "b": 2}
        assert zarr_remote.fetch_arrays(group, ["a", "b"]) == group
        """,
    )


def test_a_zarr_read_racing_its_handles_close_reads_every_leaf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote store's reads take each leaf on the handle's pool, which ``close()`` shuts
    down under a read in flight on another thread: those leaves are read here."""
    import types

    import grain_replay as gr

    path = str(tmp_path / "s.zarr")
    tree = {"a": np.arange(20).reshape(10, 2), "b": np.arange(10, dtype=np.float32)}
    gr.write(path, tree, format="zarr")
    source = gr.open_source(path)
    handle = source._get_handle()
    closed = types.SimpleNamespace(pool=_shut_pool(), readers=handle.readers)
    monkeypatch.setattr(source, "_get_handle", lambda: closed)
    got = source.read_flat(np.array([7, 2]))
    assert got["a"].tolist() == tree["a"][[7, 2]].tolist()
    assert got["b"].tolist() == tree["b"][[7, 2]].tolist()
