"""A whole run (actors and learner) restarts from one checkpoint (sheeprl #273).

Real processes: two actors (``tests/helpers/parts_child.py``) fill a bounded
many-writer store past its capacity; a learner (``tests/helpers/restart_learner.py``)
draws, checkpoints, and records what it draws next (the uninterrupted run). The
actors are killed and reopened without ``resume_from`` (the first run going on after
the checkpoint): they write rows of run 1 and are killed at a random moment, with the
learner. The restarted actors reopen with ``resume_from=gr.read_watermark(ckpt)``,
which cuts their parts back; the restored learner draws exactly what the uninterrupted
run drew, and no row of run 1 is ever seen, also after the restarted actors append.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr

HELPERS = Path(__file__).parent.parent / "helpers"
sys.path.insert(0, str(HELPERS))
from parts_child import check_rows, run_of  # noqa: E402
from restart_learner import checkpoint_manager, make_batches, rows_of  # noqa: E402

pytest.importorskip("orbax.checkpoint")  # in the test extra

CAPACITY, SEGMENT_ROWS, BLOCK = 60, 16, 5
ACTORS = ("actor-0", "actor-1")
K, M = 5, 6  # batches before the checkpoint, and compared after it


class _Proc:
    """A child process, its own process group (killed with every grain worker it has)."""

    def __init__(self, args: list[str], *, stdin: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            cwd=os.getcwd(),
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.decode().strip())

    def wait_for(self, marker: str, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.lines if line.startswith(marker)]
            if found:
                return found[-1]
            assert self.proc.poll() is None, f"child died ({self.proc.returncode}): {self.lines}"
            assert time.monotonic() < deadline, f"no {marker!r} within {timeout} s: {self.lines}"
            time.sleep(0.01)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._thread.join(timeout=10)


def _actor(path: str, fmt: str, writer_id: str, *extra: str) -> _Proc:
    return _Proc(
        [str(HELPERS / "parts_child.py"), path, fmt, writer_id, str(CAPACITY),
         "--block", str(BLOCK), "--segment-rows", str(SEGMENT_ROWS), *extra],
        stdin="--wait" in extra,
    )  # fmt: skip


def _store_rows(path: str) -> np.ndarray:
    src = gr.open_source(path, keys=["seq", "tag", "vec"])
    batch = src.read_batch(np.arange(len(src)))
    check_rows(batch)
    src.close()
    return rows_of(batch)


@pytest.mark.parametrize(
    ("fmt", "workers"),
    [
        ("npy", 0),
        pytest.param("npy", 2, marks=pytest.mark.slow),
        pytest.param("hdf5", 0, marks=pytest.mark.slow),
        ("hdf5", 2),
        ("zarr", 0),
        pytest.param("zarr", 2, marks=pytest.mark.slow),
    ],
)
def test_whole_run_restart_never_mixes_in_rows_written_after_the_checkpoint(
    tmp_path: Path, fmt: str, workers: int
) -> None:
    if fmt == "zarr":
        pytest.importorskip("zarr")
    path = str(tmp_path / "store")
    ckpt = str(tmp_path / "ckpt")
    reference = str(tmp_path / "reference.npy")
    procs: list[_Proc] = []
    try:
        # Run 0: 100 rows per actor, 40 of them evicted; the actors stay alive.
        first = [_actor(path, fmt, a, "--blocks", "20", "--hold") for a in ACTORS]
        procs += first
        for p in first:
            p.wait_for("idle")
        at_checkpoint = _store_rows(path)
        learner = _Proc([str(HELPERS / "restart_learner.py"), path, ckpt, str(workers),
                         str(K), str(M), reference])  # fmt: skip
        procs.append(learner)
        learner.wait_for("reference")
        # The first run goes on after the checkpoint: the actors (reopened, as after a
        # crash, without resume_from) write rows of run 1, and are killed mid-run.
        for p in first:
            p.kill()
        later = [_actor(path, fmt, a, "--blocks", "3", "--hold", "--run", "1") for a in ACTORS]
        procs += later
        for p in later:
            p.wait_for("C ")  # a first commit of run 1, then a kill at a random moment
        time.sleep(random.uniform(0.0, 0.05))
        for p in [*later, learner]:
            p.kill()
        written = _store_rows(path)
        assert (run_of(written[:, 1]) == 1).any() and (run_of(written[:, 1]) <= 1).all()

        # The restart: every actor reopens at the checkpoint's watermark, then waits.
        mark = gr.read_watermark(os.path.join(ckpt, str(K), "data"))
        assert mark.writers == {a: 100 for a in ACTORS}
        restarted = [
            _actor(path, fmt, a, "--blocks", "4", "--run", "2", "--hold", "--wait",
                   "--resume-from", os.path.join(ckpt, str(K), "data"))
            for a in ACTORS
        ]  # fmt: skip
        procs += restarted
        for p in restarted:
            assert p.wait_for("ready") == "ready 100"
        np.testing.assert_array_equal(_store_rows(path), at_checkpoint)  # run 1 is gone

        it = make_batches(path, workers)
        with checkpoint_manager(ckpt) as mgr:
            import grain
            import orbax.checkpoint as ocp

            mgr.restore(K, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it)))
        assert gr.read_watermark(it).writers == mark.writers  # the restored iterator's own
        want = np.load(reference)
        got = np.stack([rows_of(next(it)) for _ in range(M)])
        np.testing.assert_array_equal(got, want)  # what the uninterrupted run drew

        for p in restarted:  # the restarted run appends: its rows, never run 1's
            p.send("go")
        for p in restarted:
            p.wait_for("idle")
        seen = [got.reshape(-1, 2)]
        deadline = time.monotonic() + 120
        while not (run_of(np.concatenate(seen)[:, 1]) == 2).any():
            assert time.monotonic() < deadline, "the restarted run's rows are never drawn"
            seen.append(rows_of(next(it)))
        runs = run_of(np.concatenate(seen)[:, 1])
        assert set(np.unique(runs)) <= {0, 2}
        after = _store_rows(path)
        assert (run_of(after[:, 1]) != 1).all()
        assert len(after) == len(ACTORS) * CAPACITY  # 120 rows each, the newest 60 live
        it.close()
    finally:
        for p in procs:
            p.kill()
