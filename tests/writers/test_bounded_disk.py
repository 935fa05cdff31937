"""Capacity bounds a bounded store's disk in bytes, in every format (docs/replay_store.md).

The report: one writer, capacity 50,000, 100 flushes of 5,000 rows of 80 B (4.0 MB live)
took 4.65 MB as ``.npy`` but 53.8 MB as HDF5 and 53.5 MB as Zarr: each 3,125-row segment
had chunks sized for ~1 MiB a leaf (14,336 rows of the 64-B leaf), allocated whole. Here
the same ratios, scaled down (capacity C, flushes of C / 10 rows, 30 of them), for rows
of 80 B and of 28 KB; both ``st_size`` and allocated blocks (``st_blocks * 512``, what
``du`` counts) must stay within 1.1x the live bytes plus the documented slack.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.store.parts import RETAIN_SEGMENTS
from grain_replay.writers.backends.base import APPEND_CHUNK_BYTES, chunk_rows_within
from grain_replay.writers.layouts import chunk_rows_for

KIB = 1024
# The slack docs/replay_store.md states, past 1.1x the live bytes.
PER_LEAF_SEGMENT = 12 * KIB  # a leaf's metadata / header and block rounding, each segment
PER_CHUNK_FILE = 4 * KIB  # block rounding of each further chunk (Zarr: a file each)
PER_SEGMENT = 16 * KIB  # a segment's own metadata (HDF5 superblock, group, JSON)
FIXED = 64 * KIB  # the store's files: replay_store.json, ordinals/, manifest, lock, owner
# The report's 100 flushes turn the capacity over 10 times; 30 turn it over 3 times, well
# past the first eviction (after 10), in a third of the time.
FLUSHES = 30


def _rows(kind: str, start: int, n: int) -> dict[str, np.ndarray]:
    seq = np.arange(start, start + n, dtype=np.int64)
    if kind == "80B":  # 64 + 8 + 8 bytes
        obs = np.broadcast_to(seq[:, None].astype(np.float32), (n, 16)).copy()
        return {"obs": obs, "seq": seq, "tag": seq * 3}
    frames = np.broadcast_to((seq % 251).astype(np.uint8)[:, None, None, None], (n, 84, 84, 4))
    return {"obs": frames.copy(), "seq": seq}  # 28,224 + 8 bytes


def _disk(path: str) -> tuple[int, int]:
    """(sum of st_size, sum of st_blocks * 512) of every file under ``path``."""
    size = blocks = 0
    for folder, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(folder, name))
            size += st.st_size
            blocks += st.st_blocks * 512
    return size, blocks


def _slack(fmt: str, leaves: dict[str, np.ndarray], segment_rows: int, segments: int) -> int:
    """The documented slack: the oldest segment's evicted head, the retained evicted
    segments and the tail's rows not yet written (allocated by HDF5), whole; chunks
    splitting a segment evenly (fewer than ``k`` rows past it, ``k`` chunks a leaf);
    per-file overhead."""
    row = sum(a[0].nbytes for a in leaves.values())
    slack = (2 + RETAIN_SEGMENTS) * segment_rows * row + FIXED + PER_SEGMENT * segments
    for a in leaves.values():
        chunks = 1
        if fmt != "npy":
            c0 = chunk_rows_for(a.shape, a.dtype.itemsize, APPEND_CHUNK_BYTES, page_aligned=True)
            chunks = -(-segment_rows // chunk_rows_within(c0, segment_rows))
        per = PER_LEAF_SEGMENT + (chunks - 1) * (a[0].nbytes + PER_CHUNK_FILE)
        slack += per * segments
    return slack


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
@pytest.mark.parametrize(("kind", "capacity"), [("80B", 2_000), ("28KB", 160)])
def test_capacity_bounds_the_disk_in_bytes(
    tmp_path: Path, fmt: str, kind: str, capacity: int
) -> None:
    path = str(tmp_path / "store")
    w = gr.ReplayWriter(path, fmt, capacity=capacity, writer_id="w0")
    block = capacity // 10
    for i in range(FLUSHES):
        w.append(_rows(kind, i * block, block))
        w.flush()
    segment_rows = gr.open_source(path).writers[0].segment_rows
    w.close()
    leaves = _rows(kind, 0, 1)
    live = capacity * sum(a[0].nbytes for a in leaves.values())
    wdir = os.path.join(path, "writers", "w0")
    segments = sum(1 for name in os.listdir(wdir) if name.startswith("seg-"))
    bound = 1.1 * live + _slack(fmt, leaves, segment_rows, segments)
    size, blocks = _disk(path)
    where = f"{fmt} {kind}: live {live:,} B, {segments} segments of {segment_rows} rows"
    assert size <= bound, f"{where}: st_size {size:,} > {bound:,.0f} ({size / live:.2f}x)"
    assert blocks <= bound, f"{where}: blocks {blocks:,} > {bound:,.0f} ({blocks / live:.2f}x)"
