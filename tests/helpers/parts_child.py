"""Child process of the many-writer tests: one writer of a bounded store, until done or killed.

    python parts_child.py PATH FORMAT WRITER_ID CAPACITY [--block B] [--flush-every F]
                          [--blocks N] [--hold] [--segment-rows S] [--run R]
                          [--resume-from CHECKPOINT] [--wait]

Appends blocks of ``B`` rows whose values follow from the writer's tag and the
row's sequence number (:func:`make_rows`), flushing every ``F`` blocks, ``N``
blocks in all (0: until killed). CAPACITY 0 means unbounded. ``--run R`` marks
the rows as written by run ``R`` (the high bits of ``tag``: :func:`run_of`);
``--resume-from`` reopens the writer at that replay checkpoint's watermark;
``--wait`` waits for a line on stdin after ``ready``, before the first append.
Markers, one per line on stdout (each one unbuffered ``os.write``):

    ready C         the writer is open; C rows committed before
    F n  /  C n     flush of the first n rows begins / returned
    idle            done (with --hold: sleeps until killed; else exits)

This module imports neither jax nor pytest; tests import :func:`make_rows`,
:func:`check_rows`, :func:`open_writers` (writers in the test's process) and
:func:`spawn_writer` (this module as a writer process).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import zlib
from typing import Any

import numpy as np


def tag_of(writer_id: str) -> int:
    return zlib.crc32(writer_id.encode()) & 0xFFFF


def run_of(tag: np.ndarray) -> np.ndarray:
    """The run (``--run``) that wrote each row, from its ``tag`` leaf."""
    return np.asarray(tag) >> 16


def make_rows(writer_id: str, start: int, n: int, run: int = 0) -> dict[str, np.ndarray]:
    seq = np.arange(start, start + n, dtype=np.int64)
    tag = np.full(n, tag_of(writer_id) + (run << 16), dtype=np.int64)
    vec = (seq[:, None] * np.arange(1, 5) + tag[:, None]).astype(np.float64)
    return {"seq": seq, "tag": tag, "vec": vec}


def check_rows(batch: dict[str, Any]) -> None:
    """Every row is whole: its leaves agree with each other (never a torn or mixed row)."""
    seq, tag, vec = (np.asarray(batch[k]) for k in ("seq", "tag", "vec"))
    want = (seq[:, None] * np.arange(1, 5) + tag[:, None]).astype(np.float64)
    bad = np.flatnonzero((vec != want).any(axis=1))
    assert not len(bad), f"torn rows at {bad[:5]}: seq {seq[bad[:5]]} vec {vec[bad[:5]]}"


def open_writers(
    path: str, fmt: str = "npy", n: int = 2, capacity: int | None = 120, rows: int = 150
) -> list[Any]:
    """``n`` writers ``w0, w1, ...`` of the bounded store at ``path``, each with ``rows`` rows
    (:func:`make_rows`) committed in segments of 20."""
    import grain_replay as gr

    ws = [
        gr.ReplayWriter(path, fmt, capacity=capacity, writer_id=f"w{i}", segment_rows=20)
        for i in range(n)
    ]
    for i, w in enumerate(ws):
        w.append(make_rows(f"w{i}", 0, rows))
        w.flush()
    return ws


def spawn_writer(
    path: str, fmt: str, writer_id: str, capacity: int, *flags: str, stdout: Any = None
) -> subprocess.Popen[bytes]:
    """This module as a writer process (``flags`` as in the usage above); its markers go to
    ``stdout`` (default: dropped; ``subprocess.PIPE`` to read them)."""
    argv = [sys.executable, os.path.abspath(__file__), path, fmt, writer_id, str(capacity)]
    return subprocess.Popen(
        [*argv, *flags],
        stdout=subprocess.DEVNULL if stdout is None else stdout,
        cwd=os.getcwd(),
    )


def wait_for_commit(path: str, writer_id: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Waits until ``writer_id`` has committed once, failing if a writer process exits first."""
    while not os.path.exists(os.path.join(path, "writers", writer_id, "manifest.json")):
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        time.sleep(0.01)


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("format")
    parser.add_argument("writer_id")
    parser.add_argument("capacity", type=int)
    parser.add_argument("--block", type=int, default=7)
    parser.add_argument("--flush-every", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=0)
    parser.add_argument("--segment-rows", type=int, default=None)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--run", type=int, default=0)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--wait", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, os.getcwd())
    import grain_replay as gr

    writer = gr.ReplayWriter(
        args.path,
        args.format,
        capacity=args.capacity or None,
        writer_id=args.writer_id,
        segment_rows=args.segment_rows,
        resume_from=None if args.resume_from is None else gr.read_watermark(args.resume_from),
    )
    _say(f"ready {writer.committed}")
    if args.wait:
        sys.stdin.readline()
    k = 0
    while args.blocks == 0 or k < args.blocks:
        writer.append(make_rows(args.writer_id, len(writer), args.block, args.run))
        k += 1
        if k % args.flush_every == 0:
            _say(f"F {len(writer)}")
            _say(f"C {writer.flush()}")
    _say(f"F {len(writer)}")
    _say(f"C {writer.flush()}")
    _say("idle")
    if args.hold:
        while True:
            time.sleep(1)
    writer.close()


if __name__ == "__main__":
    main()
