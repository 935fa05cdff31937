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

This module imports neither jax nor pytest; tests import :func:`make_rows`
and :func:`check_rows`.
"""

from __future__ import annotations

import argparse
import os
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
