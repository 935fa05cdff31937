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
       python benchmarks/bench_rlds.py --index-only --episodes 800 [--shards 8] [--keep DIR]
       (only the index build, against the disk and the page cache; no TensorFlow needed)
Targets (issue 25): >= 5x tf.data, >= 20x as_data_source, >= 5x with action chunks,
index build >= 0.5x the disk's sequential read (reported against the disk, the shards'
pages dropped, and apart against the page cache; with the Python parser and the
compiled scan, in the same rounds).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import io
import json
import mmap
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
from page_cache import drop_page_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))  # the layout writers

import rlds_fixture as fx  # noqa: E402

import grain_replay as gr  # noqa: E402
from grain_replay.datasets.rlds import index as index_lib  # noqa: E402
from grain_replay.datasets.rlds.images import jpeg_decoder  # noqa: E402
from grain_replay.datasets.rlds.source import DEFAULT_FRAME_CACHE_BYTES  # noqa: E402

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


def _resident(paths: list[str]) -> float:
    """The fraction of the files' pages in the page cache (``mincore`` over a map of each)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    held = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "rb") as f:
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        view = np.frombuffer(m, np.uint8)
        vec = np.zeros((size + page - 1) // page, np.uint8)
        addr, out = ctypes.c_void_p(view.ctypes.data), vec.ctypes.data_as(ctypes.c_void_p)
        rc = libc.mincore(addr, ctypes.c_size_t(size), out)
        del view
        m.close()
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"mincore failed on {p}")
        held += int(np.count_nonzero(vec & 1))
        total += len(vec)
    return held / max(1, total)


def _drop(paths: list[str]) -> float:
    """Drops the files' clean pages (``POSIX_FADV_DONTNEED``, no root needed); returns the
    fraction still resident after it (0 when the drop worked)."""
    gc.collect()  # the index build's maps: pages a live map holds are not dropped
    for p in paths:  # dirty pages (a dataset just written) are not dropped either
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    drop_page_cache(paths)
    return _resident(paths)


def _read(paths: list[str]) -> float:
    """Seconds of a plain sequential read of the files (4 MiB ``readinto`` calls)."""
    buf = bytearray(1 << 22)
    t = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


def _build(path: str, shards: list[str], feats: Any, threads: int | None, parser: str) -> float:
    t = time.perf_counter()
    index_lib.build_index(
        path, shards, feats, use_cache=False, progress=False, threads=threads, **_PARSERS[parser]
    )
    return time.perf_counter() - t


# The parsers the index build is timed with (keyword arguments of build_index): the
# Python parser (before) and the compiled scan (after; the Python parser without numba).
_PARSERS: dict[str, dict[str, Any]] = {
    "python": {"compiled_scan": False},
    "compiled": {"compiled_scan": True},
}


def index_build(
    path: str, repeats: int = 5, threads: int | None = None, cold: bool = True
) -> dict[str, float]:
    """Median MB/s of building the index (CRCs checked, no cache) and of a plain sequential
    read of the same shards, interleaved in one run, with each parser of ``_PARSERS``.

    Warm: the shards page-cached (the build against the cost of reading the bytes from
    memory). Cold (``cold=True``): before each timed read and each timed build the shards'
    pages are dropped (``POSIX_FADV_DONTNEED``), so both read the disk; ``mincore`` checks
    the drop (``"resident after drop"``: the largest fraction of pages still cached after a
    drop, 0 when every drop worked; ``"resident after read"``: the smallest after a read).
    ``threads``: the index build's threads (default: as ``RLDSDataSource`` builds it, one
    per core up to 8 and the shard count).
    """
    src = gr.RLDSDataSource(path, progress=False)
    shards, feats = src.shards, src.features
    src.close()
    total = sum(os.path.getsize(p) for p in shards)
    times: dict[str, list[float]] = collections.defaultdict(list)
    after_drop, after_read = [], []
    for name in _PARSERS:  # warm-up: compiled code loaded, shards cached
        _build(path, shards, feats, threads, name)
    for _ in range(repeats):
        if cold:
            after_drop.append(_drop(shards))
            times["read, disk"].append(_read(shards))
            after_read.append(_resident(shards))
            for name in _PARSERS:
                after_drop.append(_drop(shards))
                times[f"build ({name}), disk"].append(_build(path, shards, feats, threads, name))
        _read(shards)  # cached again
        times["read, page cache"].append(_read(shards))
        for name in _PARSERS:
            times[f"build ({name}), page cache"].append(_build(path, shards, feats, threads, name))
    out = {k: total / statistics.median(v) / 1e6 for k, v in times.items()}
    out["bytes"] = total
    out["read, disk s"] = statistics.median(times["read, disk"]) if cold else 0.0
    out["resident after drop"] = max(after_drop, default=0.0)
    out["resident after read"] = min(after_read, default=1.0)
    return out


def print_index_build(r: dict[str, float]) -> None:
    print(
        f"index build: {r['bytes'] / 1e6:.0f} MB of shards, medians; page cache dropped with "
        f"POSIX_FADV_DONTNEED before each disk case (mincore: at most "
        f"{r['resident after drop']:.1%} of pages resident after a drop, at least "
        f"{r['resident after read']:.1%} after a disk read); disk read "
        f"{r['read, disk s']:.2f} s"
    )
    for where in ("disk", "page cache"):
        read = r.get(f"read, {where}")
        if read is None:
            continue
        print(f"  sequential read ({where}): {read:.0f} MB/s")
        for name in _PARSERS:
            build = r[f"build ({name}), {where}"]
            print(
                f"  index build ({name}, {where}) {build:.0f} MB/s: {build / read:.2f}x the "
                f"sequential read ({where}) (target 0.5x)"
            )


def write_index_dataset(root: str, episodes: int, length: int, shards: int, size: int = 128) -> str:
    """An RLDS dataset laid out as the TFDS one of ``bench_rlds_peer.py write`` (two smooth
    ``size``-pixel JPEG cameras, 8 floats of state, 7 of action, the RLDS flags, text), written
    without TensorFlow (tests/helpers/rlds_fixture.py), for ``--index-only`` without a peer.

    The frames come from a pool of 64 per camera (encoding every one would take minutes):
    the index build reads every byte and every value alike whatever the frames hold."""
    from PIL import Image

    yy, xx = np.mgrid[0:size, 0:size]
    pool = []
    for t in range(64):
        base = (np.sin(xx / 9 + t / 5) + np.cos(yy / 7 - t / 3)) * 60 + 128
        img = np.stack([base, base[::-1], base[:, ::-1]], -1).astype(np.uint8)
        frames = []
        for im in (img, img[::-1].copy()):
            buf = io.BytesIO()
            Image.fromarray(im).save(buf, format="JPEG", quality=95)
            frames.append(buf.getvalue())
        pool.append(frames)
    rng = np.random.default_rng(0)
    records = []
    for e in range(episodes):
        t = np.arange(length)
        feats = {
            "steps/observation/image": fx.feature_bytes([pool[(e + i) % 64][0] for i in t]),
            "steps/observation/wrist_image": fx.feature_bytes([pool[(e + i) % 64][1] for i in t]),
            "steps/observation/state": fx.feature_floats(rng.standard_normal((length, 8))),
            "steps/action": fx.feature_floats(rng.standard_normal((length, 7))),
            "steps/reward": fx.feature_floats((t == length - 1).astype(np.float32)),
            "steps/discount": fx.feature_floats(np.ones(length, np.float32)),
            "steps/is_first": fx.feature_ints(t == 0),
            "steps/is_last": fx.feature_ints(t == length - 1),
            "steps/is_terminal": fx.feature_ints(t == length - 1),
            "steps/language_instruction": fx.feature_bytes([b"pick up the block"] * length),
        }
        records.append(fx.example(feats))
    cam = fx.image(size, "jpeg")
    obs = {"image": cam, "wrist_image": cam, "state": fx.tensor("float32", (8,))}
    steps = {
        "observation": fx.fdict(obs),
        "action": fx.tensor("float32", (7,)),
        "reward": fx.tensor("float32"),
        "discount": fx.tensor("float32"),
        "is_first": fx.tensor("bool"),
        "is_last": fx.tensor("bool"),
        "is_terminal": fx.tensor("bool"),
        "language_instruction": fx.text(),
    }
    os.makedirs(root, exist_ok=True)
    bounds = np.linspace(0, episodes, shards + 1).round().astype(int)
    lengths = []
    for i in range(shards):
        part = records[bounds[i] : bounds[i + 1]]
        lengths.append(str(len(part)))
        name = f"bench_rlds-train.tfrecord-{i:05d}-of-{shards:05d}"
        with open(os.path.join(root, name), "wb") as f:
            f.write(fx.tfrecord(part))
    with open(os.path.join(root, "features.json"), "w") as f:
        json.dump(fx.features_json(steps), f)
    info = {"fileFormat": "tfrecord", "name": "bench_rlds", "version": "1.0.0"}
    info["splits"] = [{"name": "train", "shardLengths": lengths}]
    with open(os.path.join(root, "dataset_info.json"), "w") as f:
        json.dump(info, f)
    return root


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--peer-python", default=None)
    p.add_argument(
        "--index-only",
        action="store_true",
        help="only the index build against the disk's and the page cache's sequential read "
        "(without --peer-python the dataset is written without TensorFlow)",
    )
    p.add_argument("--shards", type=int, default=8, help="--index-only without a peer: shards")
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--length", type=int, default=50)
    p.add_argument("--batches", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--keep", default=None)
    a = p.parse_args(argv)
    if a.peer_python is None and not a.index_only:
        p.error("--peer-python is needed (or --index-only)")
    root = a.keep or tempfile.mkdtemp(prefix="bench_rlds_")
    try:
        if a.index_only:
            _index_only(a, root)
            return
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
        built = index_build(tfr, a.repeats)
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
        print_index_build(built)
        print(f"peak RSS of this process (main side, workers excluded): {rss:.0f} MiB")
    finally:
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)


def _index_only(a: argparse.Namespace, root: str) -> None:
    target = os.path.join(root, "index_only")
    if a.peer_python is not None:
        found = os.path.join(target, "bench_rlds", "1.0.0")
        if not os.path.exists(os.path.join(found, "features.json")):
            common = ["--episodes", str(a.episodes), "--length", str(a.length)]
            found = _peer(a.peer_python, "write", target, *common, "--format", "tfrecord")
        writer = "TFDS"
    else:
        found = target
        if not os.path.exists(os.path.join(found, "features.json")):
            write_index_dataset(found, a.episodes, a.length, a.shards)
        writer = "tests/helpers/rlds_fixture.py"
    gr.RLDSDataSource(found, progress=False).close()  # the index, built once and cached
    built = index_build(found, a.repeats)
    print(
        f"RLDS index build, {a.episodes} episodes x {a.length} steps, two 128x128 JPEG "
        f"cameras (written by {writer}), {len(os.sched_getaffinity(0))} cores, "
        f"{a.repeats} rounds interleaved"
    )
    print_index_build(built)


if __name__ == "__main__":
    main(sys.argv[1:])
