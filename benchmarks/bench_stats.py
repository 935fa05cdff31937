"""gr.compute_stats against the read_batch bandwidth of the same store (target >= 0.7x).

For each layout, in the same run, warm (page-cached) and cold (page cache
dropped before each pass): the time of one sequential pass of
``read_batch`` blocks (the same block size compute_stats reads) and the time
of ``gr.compute_stats(..., cache=False)``; medians of ``--repeats``. The ratio
is read time / stats time (1.0: the statistics cost nothing beyond the read).
Also: a second call, served from the cache, and an append of 1% more rows
(only the new rows are read; "nan" where the layout cannot be appended to).

    python benchmarks/bench_stats.py [--records N] [--repeats R] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

import h5py
import numpy as np
from bench_common import drop_page_cache

import grain_replay as gr
from grain_replay.stats import DEFAULT_BLOCK_BYTES, stats_cache_path

TARGET = 0.7


def _tree(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n, 64), dtype=np.float32)
    return {
        "obs": obs,
        "action": rng.integers(0, 18, n),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "next_obs": np.roll(obs, -1, axis=0),
        "done": rng.random(n) < 0.01,
    }


def _write_gzip(path: str, tree: dict[str, np.ndarray]) -> str:
    with h5py.File(path, "w") as f:
        for k, a in tree.items():
            rows = min(len(a), max(1, (64 << 10) // max(1, a[0].nbytes)))
            f.create_dataset(k, data=a, chunks=(rows, *a.shape[1:]), compression="gzip")
    return path


def _median(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _read_pass(src: Any) -> None:
    row = sum(s.dtype.itemsize * int(np.prod(s.shape)) for s in src.spec.values())
    block = max(1, DEFAULT_BLOCK_BYTES // row)
    for a in range(0, len(src), block):
        src.read_batch(np.arange(a, min(a + block, len(src))))


def _measure(name: str, path: str, records: int, repeats: int, mb: float) -> str:
    """One table row: warm and cold ratios, the cached call and an append of 1% more rows."""
    src = gr.open_source(path)
    stats = lambda: gr.compute_stats(src, cache=False)
    _read_pass(src)  # warm the page cache: both warm timings read from memory
    t_read = _median(lambda: _read_pass(src), repeats)
    t_stats = _median(stats, repeats)
    cold_read, cold_stats = [], []
    for _ in range(repeats):
        # From the disk: the page cache dropped before each pass (maps closed first).
        for fn, times in ((lambda: _read_pass(src), cold_read), (stats, cold_stats)):
            src.close()
            drop_page_cache([path])
            times.append(_median(fn, 1))
    t_cold_read, t_cold_stats = statistics.median(cold_read), statistics.median(cold_stats)
    if os.path.exists(stats_cache_path(path)):
        os.remove(stats_cache_path(path))
    gr.compute_stats(src)
    t_cached = _median(lambda: gr.compute_stats(src), repeats)
    t_append = float("nan")
    src.close()
    try:
        with gr.ReplayWriter(path) as w:
            w.append(_tree(max(1, records // 100), seed=1))
    except (gr.InvalidStoreError, gr.WriterBusyError):
        pass  # not appendable (contiguous HDF5 of gr.write, a foreign file)
    else:
        t = time.perf_counter()
        gr.compute_stats(gr.open_source(path))
        t_append = time.perf_counter() - t
    ratio, cold = t_read / t_stats, t_cold_read / t_cold_stats
    return (
        f"{name:<10} {mb / t_read:>10,.0f} {mb / t_stats:>11,.0f} {ratio:>6.2f} | "
        f"{mb / t_cold_read:>9,.0f} {mb / t_cold_stats:>10,.0f} {cold:>6.2f} | "
        f"{t_cached / t_stats:>5.2f}x {t_append / t_stats:>6.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_out/stats")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tree = _tree(args.records)
    row = sum(a[0].nbytes for a in tree.values())
    mb = args.records * row / 1e6
    stores = {
        "npy": lambda d: gr.write(os.path.join(d, "s_npy"), tree, format="npy", overwrite=True),
        "hdf5": lambda d: gr.write(os.path.join(d, "s.h5"), tree, overwrite=True),
        "hdf5-gzip": lambda d: _write_gzip(os.path.join(d, "s_gzip.h5"), tree),
        "zarr": lambda d: gr.write(os.path.join(d, "s.zarr"), tree, overwrite=True),
    }
    print(
        f"compute_stats vs read_batch: {args.records:,} records of {row} B ({mb:.0f} MB), "
        f"median of {args.repeats}; ratio = read time / stats time, target >= {TARGET}"
    )
    print(
        f"{'layout':<10} {'read MB/s':>10} {'stats MB/s':>11} {'ratio':>6} | {'cold read':>9} "
        f"{'cold stats':>10} {'ratio':>6} | cached  append 1%"
    )
    for name, make in stores.items():
        path = make(args.out)
        print(_measure(name, path, args.records, args.repeats, mb))
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    print(
        "warm: page-cached (read_batch is a memory copy, the pass is compute-bound); cold: "
        "page cache dropped before each pass. cached / append: time relative to a full warm "
        f"pass without cache. Target: ratio >= {TARGET}."
    )


if __name__ == "__main__":
    main()
