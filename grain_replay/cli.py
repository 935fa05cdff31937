"""Command line: ``grain-replay info|convert|verify|demo``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["main"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _size_on_disk(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def cmd_info(args: argparse.Namespace) -> int:
    import grain_replay as gr

    src = gr.open_source(args.path)
    info: dict[str, Any] = {
        "path": src.path,
        "format": type(src).__name__.replace("DataSource", "").lower(),
        "num_records": len(src),
        "leaves": {k: {"dtype": str(s.dtype), "shape": list(s.shape)} for k, s in src.spec.items()},
    }
    if not src.path.startswith(("s3://", "gs://", "http")):
        info["size_on_disk"] = _size_on_disk(src.path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['path']}")
    print(f"  format:  {info['format']}")
    print(f"  records: {info['num_records']:,}")
    if "size_on_disk" in info:
        print(f"  size:    {_fmt_bytes(info['size_on_disk'])}")
    width = max(len(k) for k in info["leaves"]) if info["leaves"] else 0
    print("  leaves:")
    for k, v in info["leaves"].items():
        print(f"    {k or '<root>':<{width}}  {v['dtype']:<8} {tuple(v['shape'])}")
    return 0


def _demo_tree(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n, 17), dtype=np.float32)
    return {
        "obs": obs,
        "action": rng.uniform(-1, 1, (n, 6)).astype(np.float32),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "next_obs": np.roll(obs, -1, axis=0),
        "done": rng.random(n) < 0.001,
    }


def cmd_demo(args: argparse.Namespace) -> int:
    """Writes a synthetic replay in each format and streams shuffled batches back."""
    import grain_replay as gr

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    n, b = args.records, args.batch_size
    tree = _demo_tree(n)
    row_bytes = sum(a.itemsize * int(np.prod(a.shape[1:])) for a in tree.values())
    print(f"grain_replay {gr.__version__} demo: {n:,} transitions of {row_bytes} B, batch {b}")
    print(f"writing to {out}")
    paths = {}
    for fmt, name in (("hdf5", "replay.h5"), ("npy", "replay_npy"), ("zarr", "replay.zarr")):
        t = time.perf_counter()
        paths[fmt] = gr.write(os.path.join(out, name), tree, overwrite=True)
        dt = time.perf_counter() - t
        print(f"  wrote {fmt:<5} {_fmt_bytes(_size_on_disk(paths[fmt])):>10} in {dt:.2f} s")

    import jax

    from grain_replay.pipeline.device_put import sharded_device_put
    from grain_replay.pipeline.loader import make_data_loader

    print(
        f"streaming 1 shuffled epoch per format through grain.DataLoader "
        f"(worker_count={args.workers}) -> sharded_device_put over {jax.device_count()} "
        f"{jax.devices()[0].platform} device(s)"
    )
    for fmt, path in paths.items():
        src = gr.open_source(path)
        t = time.perf_counter()
        raw = src.read_batch(np.random.default_rng(0).integers(0, n, b * 200))
        read_rate = b * 200 / (time.perf_counter() - t)
        loader = make_data_loader(
            src, batch_size=b, seed=0, num_epochs=1, worker_count=args.workers
        )
        t = time.perf_counter()
        seen = 0
        first = 0.0
        with sharded_device_put(loader, prefetch=2) as batches:
            for batch in batches:
                if not seen:
                    jax.block_until_ready(batch)
                    first = time.perf_counter() - t
                seen += batch["reward"].shape[0]
            jax.block_until_ready(batch)
        dt = time.perf_counter() - t
        assert raw["obs"].shape == (b * 200, 17)
        expected = (n // b) * b
        status = "ok" if seen == expected else f"MISMATCH (expected {expected})"
        steady = (seen - b) / max(dt - first, 1e-9)
        print(
            f"  {fmt:<5} read_batch {read_rate:>11,.0f} rec/s | loader+device_put "
            f"{steady:>9,.0f} rec/s after a first batch in {first:.1f} s "
            f"(workers starting); {seen:,} records [{status}]"
        )
        if seen != expected:
            return 1
    print("done: every record of every format was delivered once as sharded jax.Arrays")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grain-replay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="format, records, leaves, dtypes, shapes, size")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("demo", help="write a synthetic replay in each format and stream it back")
    p.add_argument("--out", default="demo_out")
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from grain_replay.errors import GrainReplayError

    try:
        return int(args.func(args))
    except GrainReplayError as e:
        print(f"grain-replay: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
