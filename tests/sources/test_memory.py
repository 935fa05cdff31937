"""An epoch over a store keeps anonymous memory bounded, whatever the store's size.

Pages of memory-mapped files are page cache (``RssFile``), not the process's
own memory (``RssAnon``); decoded chunks are bounded by ``cache_bytes``.
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any

import numpy as np
import pytest

import grain_replay as gr

ROW_SHAPE = (84, 84, 4)  # 28 KB rows, as Atari frame stacks
BLOCK_ROWS = 256
MB = 2**20


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def write_store(path: str, fmt: str, rows: int, compression: str | None) -> str:
    """A store of ``rows`` image records written in blocks (never all in memory)."""
    rng = np.random.default_rng(0)
    # Small compressed chunks: a random batch decodes little more than it reads.
    chunk_rows = 4 if compression else None
    with gr.ReplayWriter(path, format=fmt, compression=compression, chunk_rows=chunk_rows) as w:
        for start in range(0, rows, BLOCK_ROWS):
            k = min(BLOCK_ROWS, rows - start)
            w.append(
                {
                    "obs": rng.integers(0, 255, (k, *ROW_SHAPE), dtype=np.uint8),
                    "step": np.arange(start, start + k, dtype=np.int64),
                }
            )
        w.flush()
    return path


def epoch_growth(src: Any, batch_size: int = 64) -> int:
    """Peak RssAnon above the start while a loader reads every record once (checked)."""
    start = rss_anon_bytes()
    peak = start
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, rss_anon_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seen = np.zeros(len(src), dtype=bool)
    try:
        loader = gr.make_data_loader(src, batch_size=batch_size, drop_remainder=False)
        for batch in loader:
            seen[batch["step"]] = True
            np.testing.assert_array_equal(batch["obs"][:, 0, 0, 0] >= 0, True)
            peak = max(peak, rss_anon_bytes())
    finally:
        done.set()
        sampler.join()
    assert seen.all()
    return peak - start


# name: (format, compression, class, source options, (small, large) record counts)
SOURCES = {
    "npy": ("npy", None, gr.NpyDataSource, {}, (2_000, 8_000)),  # 56 MB, then 226 MB
    "hdf5": ("hdf5", None, gr.HDF5DataSource, {}, (2_000, 8_000)),
    "zarr": ("zarr", None, gr.ZarrDataSource, {}, (2_000, 8_000)),
    # Decoded chunks: the cache bound keeps memory flat (decoding is slow: fewer rows).
    "zarr-zstd": ("zarr", "zstd", gr.ZarrDataSource, {"cache_bytes": 2 * MB}, (500, 2_000)),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_epoch_rss_anon_is_bounded_regardless_of_store_size(tmp_path: Any, name: str) -> None:
    fmt, compression, cls, kwargs, sizes = SOURCES[name]
    suffix = {"npy": "", "hdf5": ".h5", "zarr": ".zarr"}[fmt]
    growth = {}
    try:
        # Small store first: one-time costs (threads, imports) land on it.
        for rows in sizes:
            path = write_store(str(tmp_path / f"s{rows}{suffix}"), fmt, rows, compression)
            with cls(path, **kwargs) as src:
                growth[rows] = epoch_growth(src)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    small, large = sizes
    assert growth[large] < min(32 * MB, large * int(np.prod(ROW_SHAPE)) // 3), growth
    # Four times the data, about the same memory.
    assert growth[large] < growth[small] + 16 * MB, growth


def test_memory_benchmark_quick_reports_peaks_of_every_process(tmp_path: Any) -> None:
    """``benchmarks/run.py --sections memory`` (opt-in, full size: a store > RAM / 2)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(root / "benchmarks" / "run.py"), "--quick", "--sections", "memory"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    memory = json.loads((tmp_path / "results.json").read_text())["sections"]["memory"]["memory"]
    assert [e["worker_count"] for e in memory["epochs"]] == [0, 2]
    for epoch in memory["epochs"]:
        assert 0 < epoch["peak_rss_anon_main_mb"] < memory["target_mb"]
    workers = memory["epochs"][1]["peak_rss_anon_children_mb"]
    assert len(workers) >= 2 and all(0 < mb < memory["target_mb"] for mb in workers[:2])
    assert not list(tmp_path.glob("data/memory-*")), "the store was not deleted"
