"""A ReplayWriter nobody closed is closed by its finalizer (commit and unlock, like a file);
when the garbage collector runs that finalizer (a writer in a reference cycle: kept by an
exception's traceback, or by its device thread's queue), the collecting thread may hold
any lock at that moment, e.g. a thread pool's while it submits a commit's fsyncs, and the
close must not wait for it: the close runs on a thread of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import grain_replay as gr
from tests.helpers.store_reads import read_all

REPO = Path(__file__).resolve().parents[2]

# A forgotten writer with pending rows in a reference cycle (only the collector frees it),
# then a collection started inside the fsync pool's submit (an allocation there may start
# one), while this thread holds the pool's locks. The close it runs commits with fsyncs
# through the same pool.
_CHILD = """
import gc, os, sys, threading
import concurrent.futures.thread as pool_thread
import numpy as np
import grain_replay as gr
from grain_replay.writers.backends import durable

gc.disable()  # the test's collection below is the only one
path = sys.argv[1]
w = gr.ReplayWriter(os.path.join(path, "forgotten"))
w.append({"a": np.arange(4), "b": np.ones((4, 2), np.float32)})
cycle = [w]
cycle.append(cycle)
del w, cycle

collected = []

class CollectingWorkItem(pool_thread._WorkItem):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not collected:
            collected.append(True)
            gc.collect()

pool_thread._WorkItem = CollectingWorkItem
fds = [os.open(os.path.join(path, name), os.O_CREAT | os.O_RDWR) for name in "xy"]
durable.fsync_all(fds)
for t in threading.enumerate():
    if t.name == "grain_replay-writer-close":  # the close the collector handed over
        t.join(60)
print("closed" if collected else "not collected")
"""


def _child(code: str, path: Path, hang: str) -> subprocess.CompletedProcess[str]:
    """``code`` run in a fresh interpreter with ``path`` as its argument; ``hang`` is the
    failure's message when it does not end within 90 s."""
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), str(path)],
            capture_output=True, text=True, timeout=90, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise AssertionError(hang) from e


def test_a_writer_closed_by_the_garbage_collector_inside_a_pool_submit_commits(
    tmp_path: Path,
) -> None:
    proc = _child(_CHILD, tmp_path, "the collector's close deadlocked on the pool's lock")
    assert proc.returncode == 0 and proc.stdout.strip() == "closed", proc.stdout + proc.stderr
    got = read_all(str(tmp_path / "forgotten"))
    np.testing.assert_array_equal(got["a"], np.arange(4))


# A forgotten writer with pending rows in a reference cycle, left to the interpreter's last
# collections at exit (as a script that never closes it does): no thread can start then.
_LEFT_AT_EXIT = """
import os, sys
import numpy as np
import grain_replay as gr

w = gr.ReplayWriter(os.path.join(sys.argv[1], "left"))
w.append({"a": np.arange(4)})
cycle = [w]
cycle.append(cycle)
del w, cycle
"""


def test_a_writer_left_in_a_cycle_at_interpreter_exit_commits_and_the_process_ends(
    tmp_path: Path,
) -> None:
    proc = _child(_LEFT_AT_EXIT, tmp_path, "the last collection waited for a thread to start")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(read_all(str(tmp_path / "left"))["a"], np.arange(4))


def test_a_writer_dropped_by_its_caller_is_closed_before_the_drop_returns(
    tmp_path: Path,
) -> None:
    """Not in a collection: the finalizer closes in the caller's thread, as before (the
    path can be opened again right away)."""
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path)
    w.append({"a": np.arange(4)})
    del w
    with gr.ReplayWriter(path) as again:  # the lock was released by the finalizer
        assert again.committed == 4
