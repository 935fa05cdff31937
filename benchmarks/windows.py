"""Windowed reads (WindowDataSource, NStepDataSource) against plain read_batch on the same store.

Prints, per store format, the median over repeats of records/s and steps/s for:
plain ``read_batch`` of B random records, ``WindowDataSource.read_batch`` of B
random windows of T steps (B*T rows per leaf), ``NStepDataSource`` (n=3) and
the in-memory numpy gather of the same B*T rows (the limit), plus the time to
build the episode index cold and from its cache.

Run: python benchmarks/windows.py [--steps 200000] [--length 8] [--batch 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import grain_replay as gr
from grain_replay.rl import NStepDataSource, WindowDataSource, build_episode_index


def make_tree(n: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 1000, n // 20 + 1)
    ends = np.cumsum(lengths)
    ends = ends[ends < n]
    done = np.zeros(n, bool)
    done[ends - 1] = True
    done[-1] = True
    return {
        "obs": rng.standard_normal((n, 17)).astype(np.float32),
        "action": rng.standard_normal((n, 6)).astype(np.float32),
        "reward": rng.standard_normal(n).astype(np.float32),
        "terminated": done & (rng.random(n) < 0.5),
        "truncated": done,
    }


def median_rate(fn: Callable[[np.ndarray], Any], ids: list[np.ndarray], repeats: int) -> float:
    """Median over repeats of batches per second, each repeat reading every batch in ``ids``."""
    fn(ids[0])  # open handles, build indices
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in ids:
            fn(batch)
        rates.append(len(ids) / (time.perf_counter() - start))
    return statistics.median(rates)


def run(fmt: str, tree: dict[str, Any], args: argparse.Namespace, root: str) -> None:
    suffix = {"hdf5": ".h5", "hdf5-gzip": ".h5", "npy": "", "zarr": ".zarr"}[fmt]
    path = os.path.join(root, f"store-{fmt}{suffix}")
    if fmt == "hdf5-gzip":
        gr.write_hdf5(path, tree, compression="gzip", chunk_rows=4096)
    else:
        gr.write(path, tree, format=fmt)
    src = gr.open_source(path)
    t0 = time.perf_counter()
    build_episode_index(src, cache=True)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = build_episode_index(gr.open_source(path), cache=True)
    cached = time.perf_counter() - t0
    windows = WindowDataSource(src, length=args.length)
    nstep = NStepDataSource(src, n=3, gamma=0.99)
    rng = np.random.default_rng(1)
    b, t = args.batch, args.length
    plain_ids = [rng.integers(0, len(src), b) for _ in range(args.batches)]
    window_ids = [rng.integers(0, len(windows), b) for _ in range(args.batches)]
    nstep_ids = [rng.integers(0, len(nstep), b) for _ in range(args.batches)]
    mem = {k: np.asarray(v) for k, v in tree.items()}
    steps = [windows.window_steps(i)[0] for i in window_ids]
    flat_steps = [s.reshape(-1) for s in steps]
    limit = median_rate(lambda s: {k: v[s] for k, v in mem.items()}, flat_steps, args.repeats)
    plain = median_rate(src.read_batch, plain_ids, args.repeats)
    win = median_rate(windows.read_batch, window_ids, args.repeats)
    ns = median_rate(nstep.read_batch, nstep_ids, args.repeats)
    print(
        f"\n[{fmt}] {len(src)} steps, {index.num_episodes} episodes, {len(windows)} windows; "
        f"episode index: {cold * 1e3:.1f} ms cold, {cached * 1e3:.1f} ms from cache"
    )
    rows = [
        ("plain read_batch", plain, b, b),
        (f"windows T={t}", win, b, b * t),
        ("n-step n=3 (records)", ns, b, b),
        ("numpy gather of B*T rows (limit)", limit, b, b * t),
    ]
    for name, rate, records, rows_per in rows:
        print(
            f"  {name:34s} {rate:8.1f} batches/s  {rate * records:11.0f} records/s  "
            f"{rate * rows_per:11.0f} rows/s"
        )
    print(
        f"  windows/plain: {win / plain:.2f}x batches/s, {win * t / plain:.2f}x rows/s; "
        f"windows/limit: {win / limit:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--length", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=200, help="batches per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", default="hdf5,hdf5-gzip,npy,zarr")
    args = parser.parse_args()
    tree = make_tree(args.steps)
    print(
        f"steps={args.steps} T={args.length} batch={args.batch} batches/repeat={args.batches} "
        f"repeats={args.repeats} (median)"
    )
    with tempfile.TemporaryDirectory() as root:
        for fmt in args.formats.split(","):
            run(fmt, tree, args, root)


if __name__ == "__main__":
    main()
