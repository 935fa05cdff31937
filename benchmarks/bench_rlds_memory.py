"""RSS of RLDSDataSource over an RLDS dataset many times the memory it is given (issue 25).

Writes an RLDS dataset in TFDS's layout (two 128x128 cameras, JPEG and PNG, 50-step
episodes; tests/helpers/rlds_fixture.py, no TensorFlow) of ``--ratio`` times
``--limit-mib``, then reads every step ``--epochs`` times in random batches through
``make_data_loader`` and samples, after each batch, the RSS of this process and of grain's
worker processes (psutil). The frame cache is given the limit (``frame_cache_bytes``: a
camera's frames do not fit, so they are decoded on every read), turned off, or given
room (frames on local disk, read back with ``pread``). No cgroup limits the page cache:
the reader maps nothing (shards and frames are read with ``pread``), so the page cache
is not in its RSS, and what is measured is the reader's own memory.

Usage: python benchmarks/bench_rlds_memory.py [--limit-mib 64] [--ratio 10] [--epochs 2]
       [--batch 64] [--workers 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))  # the layout writers

from rlds_fixture import write_rlds  # noqa: E402
from rlds_memory import dataset_bytes, measure_rss  # noqa: E402

STEP_BYTES = 33_000  # on disk per step of the fixture's two 128x128 frames (JPEG + PNG), measured
EPISODE = 50


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit-mib", type=float, default=64)
    p.add_argument("--ratio", type=float, default=10)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--keep", default=None)
    a = p.parse_args(argv)
    limit = int(a.limit_mib * 2**20)
    root = a.keep or tempfile.mkdtemp(prefix="bench_rlds_memory_")
    try:
        episodes = max(4, int(a.ratio * limit / (STEP_BYTES * EPISODE)) + 1)
        if not os.path.exists(os.path.join(root, "features.json")):
            t = time.perf_counter()
            write_rlds(root, lengths=[EPISODE] * episodes, shards=8, size=128, cameras=2)
            print(f"wrote {episodes} episodes in {time.perf_counter() - t:.0f}s")
        size = dataset_bytes(root)
        batch_mib = a.batch * 2 * 128 * 128 * 3 / 2**20
        print(
            f"RLDS dataset {size / 2**20:.0f} MiB ({episodes * EPISODE} steps, two 128x128 "
            f"cameras) = {size / limit:.1f}x the limit of {a.limit_mib:.0f} MiB; batch "
            f"{a.batch} ({batch_mib:.1f} MiB decoded), {a.epochs} epochs, random order"
        )
        print(f"{'case':<44}{'start':>8}{'warm':>8}{'peak':>8}{'growth':>8}  MiB")
        for name, workers, frames in (
            ("0 workers, frame cache = limit", 0, limit),
            ("0 workers, no frame cache", 0, 0),
            ("0 workers, frames on disk (cache has room)", 0, 4 * size),
            (f"{a.workers} workers, frame cache = limit", a.workers, limit),
        ):
            got = measure_rss(
                root,
                batch_size=a.batch,
                epochs=a.epochs,
                workers=workers,
                warmup=8,
                frame_cache_bytes=frames,
            )
            share = got["growth"] / a.limit_mib
            print(
                f"{name:<44}{got['start']:>8.0f}{got['warm']:>8.0f}{got['peak']:>8.0f}"
                f"{got['growth']:>8.1f}  ({got['steps']} steps; growth {share:.3f}x the limit)"
            )
        print(
            "start: this process once the source and its index exist; warm: the largest "
            "process after 8 batches; peak/growth: the largest process over the run."
        )
    finally:
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
