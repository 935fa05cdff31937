"""Checkpoint save time of a replay iterator at 1M and 10M live rows (issue 23, item 5).

The store is never copied into a checkpoint: what is saved is the iterator's
position, the store's commit watermark and, with prioritized replay, this
process's priorities (8 B a row for the sum tree's leaves, 1 bit for "drawn",
as base64 text: grain's Orbax handler writes a state as text). So a uniform
checkpoint does not grow with the store, and a prioritized one grows with the
priorities (~11 B a row), not with the data (525 B a row here).

The stores are .npy directories of 525-byte rows (obs float32[128], reward
float32, action int64, done bool) created sparse: the checkpoint reads none of
their bytes, so the rows need not be written. Each case times an Orbax
``CheckpointManager.save`` of ``grain.checkpoint.CheckpointSave(iterator)``
(median of ``--repeats``), and the restore into a fresh iterator.

Standalone: ``python benchmarks/bench_checkpoint.py [--rows 1000000,10000000] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

__all__ = ["run_checkpoint"]

_LEAVES = {
    "obs": (np.float32, (128,)),
    "reward": (np.float32, ()),
    "action": (np.int64, ()),
    "done": (np.bool_, ()),
}
ROW_BYTES = sum(np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for d, s in _LEAVES.values())


def _sparse_store(root: str, rows: int) -> str:
    path = os.path.join(root, f"store_{rows}")
    if not os.path.exists(path):
        os.makedirs(path)
        for key, (dtype, shape) in _LEAVES.items():
            # open_memmap writes the header and sizes the file: a sparse file, no data.
            arr = np.lib.format.open_memmap(
                os.path.join(path, key + ".npy"), mode="w+", dtype=dtype, shape=(rows, *shape)
            )
            del arr
    return path


def _time_case(path: str, mode: str, root: str, repeats: int) -> dict[str, Any]:
    import grain
    import orbax.checkpoint as ocp

    import grain_replay as gr

    sampling = gr.UniformReplay() if mode == "uniform" else gr.PrioritizedReplay()
    loader = gr.make_data_loader(gr.NpyDataSource(path), batch_size=256, sampling=sampling)
    it = iter(loader)
    for _ in range(8):
        batch = next(it)
        if mode == "prioritized":
            it.update_priorities(batch.index, np.abs(np.random.default_rng(0).normal(size=256)))
    ckpt = os.path.join(root, f"ckpt_{mode}")
    saves, size = [], 0
    for step in range(repeats):
        shutil.rmtree(ckpt, ignore_errors=True)
        with ocp.CheckpointManager(ckpt, item_names=("data",)) as mgr:
            t0 = time.perf_counter()
            mgr.save(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
            mgr.wait_until_finished()
            saves.append(time.perf_counter() - t0)
        item = os.path.join(ckpt, str(step), "data")
        size = sum(os.path.getsize(os.path.join(item, f)) for f in os.listdir(item))
    fresh = iter(loader)
    with ocp.CheckpointManager(ckpt, item_names=("data",)) as mgr:
        t0 = time.perf_counter()
        mgr.restore(
            repeats - 1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh))
        )
        restore = time.perf_counter() - t0
    same = np.array_equal(np.asarray(_index(next(fresh))), np.asarray(_index(next(it))))
    shutil.rmtree(ckpt, ignore_errors=True)
    return {"save_s": statistics.median(saves), "restore_s": restore, "bytes": size, "same": same}


def _index(batch: Any) -> Any:
    return batch.index if hasattr(batch, "index") and hasattr(batch, "weight") else batch["obs"]


def run_checkpoint(rows: list[int], repeats: int, root: str | None = None) -> list[dict[str, Any]]:
    """Times each mode's checkpoint save and restore at each live-row count; prints a table."""
    root = root or tempfile.mkdtemp(prefix="bench_ckpt_")
    results = []
    for mode in ("uniform", "prioritized"):
        for n in rows:
            path = _sparse_store(root, n)
            r = {"mode": mode, "rows": n, **_time_case(path, mode, root, repeats)}
            results.append(r)
            print(
                f"{mode:12s} {n:>11,d} live rows ({n * ROW_BYTES / 2**30:5.2f} GiB of data): "
                f"save {r['save_s'] * 1e3:8.1f} ms, restore {r['restore_s'] * 1e3:8.1f} ms, "
                f"item {r['bytes'] / 2**20:7.2f} MiB ({r['bytes'] / n:5.2f} B/row), "
                f"resumes identically: {r['same']}",
                flush=True,
            )
    for mode in ("uniform", "prioritized"):
        by = {r["rows"]: r for r in results if r["mode"] == mode}
        lo, hi = min(by), max(by)
        ratio = by[hi]["save_s"] / by[lo]["save_s"]
        print(
            f"{mode}: save time {hi:,} / {lo:,} rows = {ratio:.2f}x (target <= 1.5; data "
            f"{hi // lo}x: no row is copied)",
            flush=True,
        )
    shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,10000000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    run_checkpoint([int(x) for x in args.rows.split(",")], args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
