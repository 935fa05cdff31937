"""The crash campaign on S3 (issue 43 point 3): writers SIGKILLed at random moments.

Writer processes (tests/helpers/s3_parts_child.py, ``loop``: append 1..8 rows, flush,
print the committed count, again) of one bounded store on a moto S3 server in its own
process are killed at random moments, which fall while they append, upload a piece,
create a manifest version, delete evicted pieces (``evict_grace_s`` of 1 s and a small
capacity make them evict and delete all the time) and renew their lease (every 0.25 s,
``lease_s=1``). Each killed writer's id is taken over by a new process once its lease has
run out. A reader refreshes and reads every live row meanwhile. Checked:

* 0 committed rows lost: every count a writer printed (its ``flush()`` returned) is at
  most the committed count its next holder opened with, and the final store holds
  each writer's newest ``capacity`` rows of it, exactly;
* no torn row: every row read, meanwhile and at the end, equals the row its writer
  appended at that sequence number (leaves agree, ``tag`` names the writer);
* the ids are taken over after the lease (each new process opens within its deadline).

The counts, and what each killed process was doing (the last ``phase`` line it printed:
``append``, ``piece`` upload, ``commit``, ``evict``, ``lease`` renewal, or ``committed``:
between a flush's end and the next append), are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from parts_child import check_rows, tag_of
from s3_server import S3Server, moto_unavailable_reason

import grain_replay as gr

_reason = moto_unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

BUCKET = "replay-crash"
CHILD = os.path.join(os.path.dirname(__file__), "..", "helpers", "s3_parts_child.py")
CAPACITY = 60


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    try:
        server = S3Server(subprocess=True).start()
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"cannot start moto's S3 server on 127.0.0.1: {type(e).__name__}: {e}")
    server.create_bucket(BUCKET)
    yield server
    server.stop()


class _Writer:
    """One writer id's current process and what its processes printed."""

    def __init__(self, s3: S3Server, url: str, writer_id: str) -> None:
        self.s3, self.url, self.id = s3, url, writer_id
        self.acked = 0  # the largest committed count a flush() of this id returned
        self.opened: list[int] = []  # the committed count each process opened with
        self.proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self.open_event = threading.Event()
        self.lost: list[tuple[int, int]] = []  # (opened at, acknowledged before)
        self.phase = "open"  # what the process printed it was doing last

    def spawn(self) -> None:
        self.open_event.clear()
        self.phase = "open"
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, self.s3.endpoint_url, self.url, self.id,
             str(CAPACITY), "1", "loop", "8"],
            stdout=subprocess.PIPE,
            env={**os.environ, "EVICT_GRACE_S": "1"},
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            if not raw.endswith(b"\n"):
                break  # a line cut by the kill
            word, *rest = raw.decode().split()
            if word == "open":
                self.opened.append(int(rest[0]))
                # A takeover never loses a commit: it opens at or after the last one.
                if int(rest[0]) < self.acked:
                    self.lost.append((int(rest[0]), self.acked))
                self.open_event.set()
            elif word == "committed":
                self.acked = max(self.acked, int(rest[0]))
                self.phase = "committed"
            elif word == "phase":
                self.phase = rest[0]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        assert self._reader is not None
        self._reader.join()

    def check_alive(self) -> None:
        assert self.proc is not None
        assert self.proc.poll() is None, f"writer {self.id} exited with {self.proc.returncode}"


def _check_snapshot(src: Any, ordinals: dict[int, str]) -> int:
    """Every live row of ``src``'s snapshot is whole and its writer's, each writer's rows
    contiguous; the rows checked."""
    n = len(src)
    if not n:
        return 0
    got = src.read_batch(np.arange(n))
    check_rows(got)
    for m, start in zip(src.writers, src.writer_starts(), strict=True):
        seq = got["seq"][start : start + m.live]
        np.testing.assert_array_equal(seq, np.arange(m.live_start, m.committed))
        assert (got["tag"][start : start + m.live] == tag_of(m.writer_id)).all()
        assert (got["_writer"][start : start + m.live] == m.ordinal).all()
        ordinals[m.ordinal] = m.writer_id
    return n


def _campaign(s3: S3Server, kills: int, writers: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    url = f"s3://{BUCKET}/campaign-{seed}-{kills}"
    opts = s3.storage_options()
    ws = [_Writer(s3, url, f"actor-{i}") for i in range(writers)]
    for w in ws:
        w.spawn()
    for w in ws:
        assert w.open_event.wait(120), f"{w.id} did not open"
    counts = {"kills": 0, "rows_checked": 0, "rows_lost": 0, "reads": 0, "late_reads": 0}
    stop = threading.Event()
    failures: list[BaseException] = []
    phases: dict[str, int] = {}  # what the killed process was doing (its last phase line)

    def read_meanwhile() -> None:
        src = gr.open_source(url, storage_options=opts, keys=["seq", "tag", "vec", "_writer"])
        ordinals: dict[int, str] = {}
        while not stop.is_set():
            try:
                src.refresh()
                counts["rows_checked"] += _check_snapshot(src, ordinals)
                counts["reads"] += 1
            except gr.EvictedRowError:
                counts["late_reads"] += 1  # read past the 1-s grace on a loaded machine
            except BaseException as e:
                failures.append(e)
                return

    reader = threading.Thread(target=read_meanwhile, daemon=True)
    reader.start()
    try:
        for _ in range(kills):
            # A random writer whose process has opened (the others are taking over).
            w = rng.choice([w for w in ws if w.open_event.is_set()] or ws)
            assert w.open_event.wait(120), f"{w.id}: the lease was not taken over"
            w.check_alive()
            time.sleep(rng.uniform(0.05, 1.0))  # a random moment of its work
            w.kill()
            counts["kills"] += 1
            phases[w.phase] = phases.get(w.phase, 0) + 1
            w.spawn()
            assert not failures, failures
        for w in ws:
            assert w.open_event.wait(120), f"{w.id}: the lease was not taken over"
    finally:
        stop.set()
        reader.join()
        for w in ws:
            if w.proc is not None and w.proc.poll() is None:
                w.kill()
    assert not failures, failures
    # The final state: each id taken over once more, in this process.
    final = []
    deadline = time.monotonic() + 60
    for w in ws:
        while True:
            try:
                final.append(
                    gr.ReplayWriter(url, capacity=CAPACITY, writer_id=w.id, storage_options=opts,
                                    lease_s=1, evict_grace_s=1)
                )  # fmt: skip
                break
            except gr.WriterBusyError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    for w, fw in zip(ws, final, strict=True):
        counts["rows_lost"] += max(0, w.acked - fw.committed)
        counts["rows_lost"] += sum(acked - at for at, acked in w.lost)
    src = gr.open_source(url, storage_options=opts, keys=["seq", "tag", "vec", "_writer"])
    counts["rows_checked"] += _check_snapshot(src, {})
    for w, m in zip(ws, sorted(src.writers, key=lambda m: m.writer_id), strict=True):
        assert m.committed >= w.acked and m.live == min(m.committed, CAPACITY)
        counts["rows_committed"] = counts.get("rows_committed", 0) + m.committed
    counts["takeovers"] = sum(len(w.opened) for w in ws) - len(ws)
    for fw in final:
        fw.close()
    print(f"s3 crash campaign (seed {seed}): {counts}; kills by phase: {phases}")
    return counts


def test_sigkilled_writers_on_s3_lose_no_committed_row(s3: S3Server) -> None:
    counts = _campaign(s3, kills=2, writers=2, seed=1)
    assert counts["kills"] == 2 and counts["rows_lost"] == 0 and counts["rows_checked"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sigkilled_writers_on_s3_lose_no_committed_row_many_kills(s3: S3Server) -> None:
    counts = _campaign(s3, kills=40, writers=3, seed=2)
    assert counts["kills"] == 40 and counts["rows_lost"] == 0 and counts["rows_checked"] > 0
