"""RLDSDataSource (no TensorFlow) vs TFDS's own readers on one RLDS dataset, ratios in one run.

Two 128x128 JPEG cameras per step, random steps, batches of 256: our reader through
``make_data_loader`` (``--workers`` processes) against the ``tf.data`` pipeline octo and
openpi use (``as_dataset`` + flat_map to steps + shuffle buffer + batch, images decoded by
TF's own thread pool) and against ``as_data_source()`` random access (ArrayRecord shards of
the same dataset). Also with 16-step action chunks (``SequenceDataSource`` vs octo's
trajectory transform), the index build against a sequential read of the shards, and the
reader's peak RSS. The datasets are written by TFDS itself in the rlds venv. Our side
runs with the decoded-frame cache warm (filled by a pass first), cold (emptied first) and
off (``frame_cache_bytes=0``), each reported apart.

Usage: python benchmarks/bench_rlds.py --peer-python .venv-rlds/bin/python
       [--episodes 40] [--length 50] [--batches 32] [--workers 2] [--repeats 5] [--keep DIR]
Targets (issue 25): >= 5x tf.data, >= 20x as_data_source, >= 5x with action chunks,
index build >= 0.5x sequential read.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
from bench_common import run_peer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


import grain_replay as gr  # noqa: E402
from grain_replay.sources.rlds import index as index_lib  # noqa: E402
from grain_replay.sources.rlds.images import jpeg_decoder  # noqa: E402
from grain_replay.sources.rlds.source import DEFAULT_FRAME_CACHE_BYTES  # noqa: E402

BATCH = 256
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_rlds_peer.py")
KEYS = ["observation/image", "observation/wrist_image", "observation/state", "action"]


def _peer(python: str, *args: str) -> str:
    return run_peer(python, PEER, args, CUDA_VISIBLE_DEVICES="")


def _copied(tree: Any) -> Any:
    """Every leaf copied into fresh memory: what the consumer of a worker loader did to each
    batch before batches viewed the workers' shared memory (the "copied" cases)."""
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    return np.array(tree, copy=True)


def _rate(loader: Any, batches: int, copy: bool = False) -> float:
    it = iter(loader)
    for _ in range(2):  # warm-up: workers started, handles open
        next(it)
    t = time.perf_counter()
    for _ in range(batches):
        if copy:
            _copied(next(it))
        else:
            next(it)
    return batches * BATCH / (time.perf_counter() - t)


def _empty_frame_cache(path: str) -> None:
    for d in index_lib.cache_dirs(path):
        if os.path.isdir(d):
            for name in os.listdir(d):
                if name.startswith("frames-"):
                    os.unlink(os.path.join(d, name))


def _fill_frame_cache(path: str) -> None:
    src = gr.RLDSDataSource(path, keys=KEYS[:2], progress=False)
    for start in range(0, len(src), 512):
        src.read_batch(np.arange(start, min(len(src), start + 512)))
    src.close()


def ours(
    path: str,
    batches: int,
    workers: int,
    chunk: int = 0,
    frames: str = "warm",
    copy: bool = False,
) -> float:
    """Steps/s through make_data_loader. ``frames``: ``"warm"`` (the decoded-frame cache
    filled by a pass over the dataset first), ``"cold"`` (emptied first: the timed batches
    fill it: the batches timed are those of the first epoch after the 2 warm-up ones,
    every step a miss) or ``"off"`` (frame_cache_bytes=0).
    ``copy``: each batch copied out of shared memory, as the loader did before (the
    before/after of batches that view the workers' slots)."""
    if frames == "cold":
        _empty_frame_cache(path)
    elif frames == "warm":
        _fill_frame_cache(path)
    budget = 0 if frames == "off" else DEFAULT_FRAME_CACHE_BYTES
    src: Any = gr.RLDSDataSource(path, keys=KEYS, progress=False, frame_cache_bytes=budget)
    if chunk:
        offsets = {k: [0] for k in KEYS if k != "action"}
        offsets["action"] = list(range(chunk))
        src = gr.SequenceDataSource(src, offsets=offsets, pad="edge")
    loader = gr.make_data_loader(
        src, batch_size=BATCH, shuffle=True, seed=0, num_epochs=None, worker_count=workers
    )
    if frames == "cold":  # the rest of the first epoch: every frame decoded once
        batches = max(1, min(batches, len(src) // BATCH - 2))
    return _rate(loader, batches, copy)


def index_build(path: str, repeats: int = 5, threads: int | None = None) -> tuple[float, float]:
    """Median MB/s of building the index (CRCs checked, no cache) and of a plain sequential
    read of the same shards (4 MiB ``read`` calls), interleaved in one run.

    Both read page-cached shards (dropping the page cache needs root): the comparison
    is with the cost of reading the bytes, not with a cold disk. ``threads``: the
    index build's threads (default: as ``RLDSDataSource`` builds it, one per core up
    to 8 and the shard count).
    """
    src = gr.RLDSDataSource(path, progress=False)
    shards, feats = src.shards, src.features
    total = sum(os.path.getsize(p) for p in shards)
    reads, builds = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        for p in shards:
            with open(p, "rb") as f:
                while f.read(1 << 22):
                    pass
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        index_lib.build_index(path, shards, feats, use_cache=False, progress=False, threads=threads)
        builds.append(time.perf_counter() - t)
    return total / statistics.median(builds) / 1e6, total / statistics.median(reads) / 1e6


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peer-python", required=True)
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--length", type=int, default=50)
    p.add_argument("--batches", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--keep", default=None)
    a = p.parse_args(argv)
    root = a.keep or tempfile.mkdtemp(prefix="bench_rlds_")
    try:
        common = ["--episodes", str(a.episodes), "--length", str(a.length)]
        paths = {}
        for fmt in ("tfrecord", "array_record"):
            target = os.path.join(root, fmt)
            found = os.path.join(target, "bench_rlds", "1.0.0")
            if not os.path.exists(os.path.join(found, "features.json")):
                found = _peer(a.peer_python, "write", target, *common, "--format", fmt)
            paths[fmt] = found
        tfr = paths["tfrecord"]
        gr.RLDSDataSource(tfr, progress=False)  # the index, built once and cached
        b = str(a.batches)
        rows: dict[str, list[float]] = {}
        for _ in range(a.repeats):
            for name, fn in (
                ("ours", lambda: ours(tfr, a.batches, a.workers)),
                ("ours, copied (before)", lambda: ours(tfr, a.batches, a.workers, copy=True)),
                ("ours, cold frames", lambda: ours(tfr, a.batches, a.workers, 0, "cold")),
                ("ours, no frame cache", lambda: ours(tfr, a.batches, a.workers, 0, "off")),
                ("ours, 0 workers", lambda: ours(tfr, a.batches, 0)),
                ("ours, 16-step chunks", lambda: ours(tfr, a.batches, a.workers, 16)),
                (
                    "ours, chunks, copied",
                    lambda: ours(tfr, a.batches, a.workers, 16, copy=True),
                ),
                (
                    "ours, chunks, cold",
                    lambda: ours(tfr, a.batches, a.workers, 16, "cold"),
                ),
                (
                    "tf.data",
                    lambda: json.loads(_peer(a.peer_python, "tfdata", tfr, "--batches", b)),
                ),
                (
                    "tf.data, 16-step chunks",
                    lambda: json.loads(
                        _peer(a.peer_python, "tfdata", tfr, "--batches", b, "--chunk", "16")
                    ),
                ),
                (
                    "as_data_source",
                    lambda: json.loads(
                        _peer(a.peer_python, "datasource", paths["array_record"], "--batches", "1")
                    ),
                ),
            ):
                got = fn()
                rows.setdefault(name, []).append(
                    got["steps_per_s"] if isinstance(got, dict) else got
                )
        med = {k: statistics.median(v) for k, v in rows.items()}
        build, read = index_build(tfr)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        n = a.episodes * a.length
        print(
            f"RLDS, {a.episodes} episodes x {a.length} steps ({n} steps), two 128x128 JPEG "
            f"cameras, batch {BATCH}, {a.workers} workers (ours), medians of {a.repeats}; "
            f"JPEG decoder: {'simplejpeg' if jpeg_decoder() else 'Pillow'}"
        )
        print(f"{'reader':<26}{'steps/s':>10}")
        for k, v in med.items():
            print(f"{k:<26}{v:>10.0f}")
        tfd, ads, tfc = med["tf.data"], med["as_data_source"], med["tf.data, 16-step chunks"]
        print(
            "(ours: decoded frames cached, warm; cold: the cache emptied before the run; "
            "copied: each batch copied out of the workers' shared memory, as the loader did "
            "before batches viewed it)"
        )
        for label, key in (
            ("warm", "ours"),
            ("warm, copied", "ours, copied (before)"),
            ("cold", "ours, cold frames"),
            ("no frame cache", "ours, no frame cache"),
        ):
            print(
                f"ratio ours ({label}) / tf.data: {med[key] / tfd:.2f}x (target 5x); "
                f"/ as_data_source: {med[key] / ads:.1f}x (target 20x)"
            )
        views = med["ours"] / med["ours, copied (before)"]
        chunked = med["ours, 16-step chunks"] / med["ours, chunks, copied"]
        print(f"batches viewing shared memory / copied out: {views:.2f}x (chunks: {chunked:.2f}x)")
        for label, key in (
            ("warm", "ours, 16-step chunks"),
            ("warm, copied", "ours, chunks, copied"),
            ("cold", "ours, chunks, cold"),
        ):
            print(f"ratio with 16-step chunks ({label}): {med[key] / tfc:.2f}x (target 5x)")
        print(
            f"index build {build:.0f} MB/s vs sequential read {read:.0f} MB/s: "
            f"{build / read:.2f}x (target 0.5x)"
        )
        print(f"peak RSS of this process (main side, workers excluded): {rss:.0f} MiB")
    finally:
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
