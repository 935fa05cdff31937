"""SIGKILL of writers of a bounded, many-writer store: at most the rows since a flush are lost.

Each child (``tests/helpers/parts_child.py``) writes blocks and flushes after
each, with a capacity of a few segments, so a kill lands in appends, segment
creations, commits and evictions alike. After a kill, what a reader sees of
that writer is exactly the newest ``min(committed, capacity)`` rows, whole,
where ``committed`` is at least what the last finished flush returned; the
other writer goes on; a reopened writer continues after its last committed row.
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from parts_child import check_rows, make_rows, spawn_writer, tag_of

import grain_replay as gr

CAPACITY = 60
SEGMENT_ROWS = 16


class _Child:
    """A writer process and the markers it printed."""

    def __init__(self, path: str, fmt: str, writer_id: str) -> None:
        self.writer_id = writer_id
        flags = ("--block", "5", "--segment-rows", str(SEGMENT_ROWS))
        self.proc = spawn_writer(path, fmt, writer_id, CAPACITY, *flags, stdout=subprocess.PIPE)
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.decode().strip())

    def wait_for(self, flushes: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while sum(line.startswith("C ") for line in self.lines) < flushes:
            assert self.proc.poll() is None, f"child died: {self.lines[-3:]}"
            assert time.monotonic() < deadline, "child too slow"
            time.sleep(0.01)

    def kill(self) -> tuple[int, int]:
        """SIGKILL; returns (rows the last finished flush committed, of the last one begun)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._thread.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        done = [int(x.split()[1]) for x in self.lines if x.startswith("C ")]
        begun = [int(x.split()[1]) for x in self.lines if x.startswith("F ")]
        first = int(self.lines[0].split()[1]) if self.lines else 0
        return max(done, default=first), max(begun, default=first)


def _check_writer(path: str, writer_id: str, low: int, high: int) -> int:
    """What a reader sees of ``writer_id``: the newest rows of a commit in [low, high]."""
    src = gr.open_source(path, keys=["seq", "tag", "vec", "_writer"])
    batch = src.read_batch(np.arange(len(src)))
    check_rows(batch)
    mine = batch["_writer"] == src.writer_ordinals[writer_id]
    assert (batch["tag"][mine] == tag_of(writer_id)).all()
    seq = batch["seq"][mine]
    committed = int(seq[-1]) + 1 if len(seq) else 0
    assert low <= committed <= high, (low, committed, high)
    np.testing.assert_array_equal(seq, np.arange(committed - min(committed, CAPACITY), committed))
    return committed


def _reopen_continues(path: str, fmt: str, writer_id: str, committed: int) -> None:
    with gr.ReplayWriter(
        path, fmt, capacity=CAPACITY, writer_id=writer_id, segment_rows=SEGMENT_ROWS
    ) as w:
        assert w.committed == committed
        w.append(make_rows(writer_id, committed, 3))
    _check_writer(path, writer_id, committed + 3, committed + 3)


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_kill_a_bounded_writer_at_random_moments(tmp_path: Path, fmt: str) -> None:
    path = str(tmp_path / "store")
    rng = random.Random(fmt)
    committed = 0
    for round_ in range(3):
        child = _Child(path, fmt, "a")
        child.wait_for(3 + round_)  # past the capacity: every flush evicts
        time.sleep(rng.uniform(0, 0.3))
        low, high = child.kill()
        assert low >= committed
        committed = _check_writer(path, "a", low, high)
    _reopen_continues(path, fmt, "a", committed)


def test_two_writers_killed_at_random_the_other_goes_on(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    rng = random.Random(7)
    a, b = _Child(path, "npy", "a"), _Child(path, "npy", "b")
    a.wait_for(4)
    b.wait_for(4)
    time.sleep(rng.uniform(0, 0.2))
    low_a, high_a = a.kill()
    before = sum(line.startswith("C ") for line in b.lines)
    b.wait_for(before + 3)  # b commits on after a died
    committed_a = _check_writer(path, "a", low_a, high_a)
    time.sleep(rng.uniform(0, 0.2))
    low_b, high_b = b.kill()
    committed_b = _check_writer(path, "b", low_b, high_b)
    assert _check_writer(path, "a", committed_a, committed_a) == committed_a
    _reopen_continues(path, "npy", "a", committed_a)
    _reopen_continues(path, "npy", "b", committed_b)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_soak_two_writers_killed_and_restarted_many_times(tmp_path: Path, fmt: str) -> None:
    path = str(tmp_path / "store")
    rng = random.Random(fmt + "soak")
    committed = {"a": 0, "b": 0}
    children = {w: _Child(path, fmt, w) for w in committed}
    for _ in range(12):
        victim = rng.choice(sorted(committed))
        children[victim].wait_for(2)
        time.sleep(rng.uniform(0, 0.4))
        low, high = children[victim].kill()
        assert low >= committed[victim]
        committed[victim] = _check_writer(path, victim, low, high)
        children[victim] = _Child(path, fmt, victim)
    for w, child in children.items():
        child.wait_for(1)
        low, high = child.kill()
        committed[w] = _check_writer(path, w, low, high)
        _reopen_continues(path, fmt, w, committed[w])
