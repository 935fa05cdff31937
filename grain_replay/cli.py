"""Command line: ``grain-replay info|convert|verify|stats|demo``."""

from __future__ import annotations

import argparse
import contextlib
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
    info["checksums"] = getattr(src, "checksums", None) is not None
    episodes = _episodes(src)
    if episodes is not None:
        info["episodes"] = episodes
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['path']}")
    print(f"  format:  {info['format']}")
    print(f"  records: {info['num_records']:,}")
    if "size_on_disk" in info:
        print(f"  size:    {_fmt_bytes(info['size_on_disk'])}")
    if "episodes" in info:
        e = info["episodes"]
        print(
            f"  episodes: {e['count']:,} (length min/mean/max {e['min_length']}/"
            f"{e['mean_length']:.1f}/{e['max_length']}; flags {', '.join(e['flags'])})"
        )
    print(f"  checksums: {'recorded' if info['checksums'] else 'none'}")
    width = max(len(k) for k in info["leaves"]) if info["leaves"] else 0
    print("  leaves:")
    for k, v in info["leaves"].items():
        print(f"    {k or '<root>':<{width}}  {v['dtype']:<8} {tuple(v['shape'])}")
    return 0


def _open(path: str) -> Any:
    """Opens any store: Minari datasets and D4RL files as transitions, LeRobot datasets as
    frames (cameras decoded), else gr.open_source."""
    import grain_replay as gr

    if os.path.isfile(os.path.join(path, "meta", "info.json")):
        return gr.LeRobotDataSource(path)
    if os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, "data", f)) for f in ("main_data.hdf5", "metadata.json")
    ):
        return gr.MinariDataSource(path)
    if path.endswith("main_data.hdf5"):
        return gr.MinariDataSource(path)
    src = gr.open_source(path) if _is_plain(path) else None
    if src is not None:
        return src
    return gr.D4RLDataSource(path)


def _is_plain(path: str) -> bool:
    """False for a D4RL-layout HDF5 file without grain_replay metadata."""
    from grain_replay.formats import format_from_path, import_h5py
    from grain_replay.layout import METADATA_ATTR

    if format_from_path(path) != "hdf5" or not os.path.isfile(path):
        return True
    h5py = import_h5py()

    with h5py.File(path, "r", locking=False) as f:
        d4rl = {"observations", "actions", "rewards", "terminals"} <= set(f.keys())
        return METADATA_ATTR in f.attrs or not d4rl


def _episodes(src: Any) -> dict[str, Any] | None:
    from grain_replay.errors import GrainReplayError
    from grain_replay.rl import build_episode_index
    from grain_replay.rl.episodes import EpisodeFlags

    try:
        flags = EpisodeFlags().resolve(src.spec, src.path)
        index = getattr(src, "episodes", None) or build_episode_index(src)
    except (GrainReplayError, AttributeError, TypeError):
        return None
    lengths = np.asarray(index.lengths)
    if not len(lengths):
        return None
    return {
        "count": int(index.num_episodes),
        "min_length": int(lengths.min()),
        "mean_length": float(lengths.mean()),
        "max_length": int(lengths.max()),
        "flags": list(flags.keys),
    }


def _progress(total: int, desc: str, enabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # the cli extra is optional
        enabled = False
    if not enabled:
        return contextlib.nullcontext(type("_P", (), {"update": staticmethod(lambda n: None)})())
    return tqdm(total=total, desc=desc, unit="rec", unit_scale=True, file=sys.stderr)


def cmd_convert(args: argparse.Namespace) -> int:
    """Streams SRC into a new store at DST, bit-exactly, in bounded memory."""
    from grain_replay import layout as layout_lib
    from grain_replay import tree as tree_lib
    from grain_replay.formats import format_from_path
    from grain_replay.writers.oneshot import write_blocks

    src = _open(args.src)
    n = len(src)
    fmt = args.format or format_from_path(args.dst)
    leaves = {k: layout_lib.LeafSpec(v.dtype, tuple(v.shape)) for k, v in src.spec.items()}
    row_bytes = sum(
        s.dtype.itemsize * int(np.prod(s.shape, dtype=np.int64)) for s in leaves.values()
    )
    block = max(1, args.block_bytes // max(1, row_bytes))
    probe = src.read_batch(np.arange(min(n, 1)))
    treedef = tree_lib.flatten(probe)[1]
    meta = layout_lib.StoreMetadata(n, leaves, treedef)
    t = time.perf_counter()
    with _progress(n, f"convert -> {fmt}", not args.quiet) as bar:

        def blocks() -> Any:
            for start in range(0, n, block):
                rows = src.read_batch(np.arange(start, min(start + block, n)))
                flat = tree_lib.flatten(rows)[0]
                bar.update(min(block, n - start))
                yield start, {k: np.asarray(v) for k, v in flat.items()}

        try:
            out = write_blocks(
                args.dst, meta, blocks(), format=fmt, chunk_rows=args.chunk_rows,
                compression=args.compression, overwrite=args.overwrite,
            )  # fmt: skip
        except KeyboardInterrupt:
            print(
                f"\ninterrupted: {args.dst} was not written (no partial store left)",
                file=sys.stderr,
            )
            return 130
    dt = time.perf_counter() - t
    print(f"wrote {out}: {n:,} records, {fmt}, {_fmt_bytes(n * row_bytes / max(dt, 1e-9))}/s")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Checks metadata, lengths and every leaf's recorded checksums."""
    from grain_replay.integrity import verify_source

    src = _open(args.path)
    with _progress(len(src) * max(1, len(src.spec)), "verify", not args.quiet) as bar:
        report = verify_source(src, getattr(src, "checksums", None), progress=bar.update)
    if report.ok:
        what = "checksums match" if report.has_checksums else "readable (no checksums recorded)"
        print(
            f"OK {report.path}: {report.num_records:,} records, {len(src.spec)} leaves, "
            f"{report.blocks_checked} blocks, {what}"
        )
        return 0
    print(f"CORRUPT {report.path}: {report.problem}", file=sys.stderr)
    return 1


def cmd_stats(args: argparse.Namespace) -> int:
    """Per-leaf count, mean, std, min, max and quantiles (cached beside the store)."""
    from grain_replay.stats import compute_stats, iter_json

    src = _open(args.path)
    with _progress(len(src), "stats", not (args.quiet or args.json)) as bar:
        stats = compute_stats(
            src, keys=args.keys, quantiles=args.quantiles, cache=not args.no_cache,
            progress=bar.update,
        )  # fmt: skip
    leaves = dict(iter_json(stats))
    if args.json:
        # Strict JSON: NaN and infinities (a NaN in the data propagates) become null.
        def strict(v: Any) -> Any:
            if isinstance(v, list):
                return [strict(x) for x in v]
            return v if not isinstance(v, float) or np.isfinite(v) else None

        out = {
            "path": src.path,
            "num_records": len(src),
            "leaves": {k: {n: strict(v) for n, v in d.items()} for k, d in leaves.items()},
        }
        print(json.dumps(out, indent=2))  # fmt: skip
        return 0
    print(f"{src.path}: {len(src):,} records")
    with np.printoptions(precision=4, threshold=8, edgeitems=3, linewidth=1000):
        for key, d in leaves.items():
            spec = src.spec[key]
            print(f"  {key or '<root>'}  {spec.dtype} {tuple(spec.shape)}")
            for name, value in d.items():
                if name != "count":
                    print(f"    {name:<5} {np.asarray(value).ravel()}")
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

    p = sub.add_parser("convert", help="copy a store into another format, bit-exactly")
    p.add_argument("src", help="any store, a Minari or LeRobot dataset, or a D4RL file")
    p.add_argument("dst", help="destination; its suffix picks the format as in gr.write")
    p.add_argument("--format", choices=["hdf5", "npy", "zarr"])
    p.add_argument("--chunk-rows", type=int)
    p.add_argument("--compression")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--block-bytes", type=int, default=64 << 20, help="memory per block")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("verify", help="check metadata, lengths and checksums")
    p.add_argument("path")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("stats", help="per-leaf count, mean, std, min, max, quantiles")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output (NaN -> null)")
    p.add_argument("--keys", nargs="+", help="leaves or groups (default all)")
    p.add_argument("--quantiles", nargs="+", type=float, default=[0.01, 0.1, 0.5, 0.9, 0.99])
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_stats)

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
