"""Command line: grain-replay info | convert | verify | stats | demo."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
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
    episodes = _episodes(src, cache=args.cache_episodes)
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


def _episodes(src: Any, cache: bool) -> dict[str, Any] | None:
    """Episode counts, or None for a store without episode flags.

    ``info`` is read-only: the index is built in memory and the cache file that the
    RL views keep beside a store is written only when ``cache`` is true.
    """
    from grain_replay.errors import GrainReplayError
    from grain_replay.rl import build_episode_index
    from grain_replay.rl.episodes import EpisodeFlags

    try:
        flags = EpisodeFlags().resolve(src.spec, src.path)
        index = getattr(src, "episodes", None) or build_episode_index(src, cache=cache)
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


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool, unit: str = "records") -> Any:
    """A tqdm bar on stderr counting ``unit`` (``"B"``: bytes, shown as KiB/MiB)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the cli extra is optional
        enabled = False
    if not enabled:
        return _NoBar()
    if unit == "B":
        return tqdm(
            total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
        )
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, file=sys.stderr)


def cmd_convert(args: argparse.Namespace) -> int:
    """Streams SRC into a new store at DST, bit-exactly, in bounded memory."""
    from grain_replay import layout as layout_lib
    from grain_replay import tree as tree_lib
    from grain_replay.errors import StoreExistsError
    from grain_replay.formats import format_from_path
    from grain_replay.writers.oneshot import write_blocks

    if os.path.lexists(args.dst) and not args.overwrite:
        raise StoreExistsError(
            f"{os.path.abspath(args.dst)} exists. Fix: pass --overwrite to replace it, or "
            "choose another destination."
        )
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
    bar: Any = None  # drawn with the first block: the writer checks its options before that

    def blocks() -> Any:
        nonlocal bar
        bar = _progress(n, f"convert to {fmt}", not args.quiet, "records")
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
    finally:
        if bar is not None:
            bar.close()
    dt = time.perf_counter() - t
    print(f"wrote {out}: {n:,} records, {fmt}, {_fmt_bytes(n * row_bytes / max(dt, 1e-9))}/s")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Checks metadata, lengths and every leaf's recorded checksums."""
    from grain_replay.integrity import verify_source

    src = _open(args.path)
    n = len(src)
    # verify_source checks the leaves one after another, reporting rows: count bytes.
    leaf_bytes = [
        s.dtype.itemsize * int(np.prod(s.shape, dtype=np.int64)) for s in src.spec.values()
    ]
    bar = _progress(n * sum(leaf_bytes), "verify (bytes read)", not args.quiet, "B")
    done = [0]  # rows checked over all leaves

    def progress(rows: int) -> None:
        leaf = min(done[0] // max(n, 1), len(leaf_bytes) - 1)
        done[0] += rows
        bar.update(rows * leaf_bytes[leaf])

    try:
        report = verify_source(src, getattr(src, "checksums", None), progress=progress)
    finally:
        bar.close()
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

    devices = jax.devices()
    expected = (n // b) * b
    print(
        f"streaming 1 shuffled epoch per format through grain.DataLoader "
        f"(worker_count={args.workers}) -> sharded_device_put over {len(devices)} "
        f"{devices[0].platform} device(s)"
    )
    if expected != n:
        print(
            f"  {n - expected} of the {n:,} records do not fill a last batch of {b}: "
            f"drop_remainder=True (the default) drops them, so {expected:,} are expected"
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
        status = "ok" if seen == expected else f"MISMATCH (expected {expected:,})"
        steady = (seen - b) / max(dt - first, 1e-9)
        print(
            f"  {fmt:<5} read_batch {read_rate:>11,.0f} rec/s | loader+device_put "
            f"{steady:>9,.0f} rec/s after a first batch in {first:.1f} s"
            f"{' (workers starting)' if args.workers else ''}; {seen:,} records [{status}]"
        )
        if seen != expected:
            return 1
    notes = [
        "read_batch: one vectorized read of random records into host memory. "
        "loader+device_put: the whole pipeline (shuffled batches, read in the loader's "
        "workers, put on every device as one sharded jax.Array per leaf)."
    ]
    if devices[0].platform == "cpu":
        notes.append(
            f"The {len(devices)} devices are fake CPU devices (XLA_FLAGS="
            "--xla_force_host_platform_device_count): each device put is a host-to-host "
            "copy on the same cores that the workers read with, so here the pipeline runs "
            "far below read_batch. On GPUs and TPUs the copies go to the devices and "
            "overlap with the reads."
        )
    dropped = f" (the {n - expected} that do not fill a batch dropped)" if expected != n else ""
    notes.append(
        f"done: each format delivered one shuffled epoch of {expected:,} records{dropped} "
        "as sharded jax.Arrays."
    )
    for note in notes:
        print(textwrap.fill(note, width=100))
    return 0


_VERIFY_EPILOG = """\
exit status:
  0  the store is readable and every recorded checksum matches
  1  the store is corrupt: the first damaged leaf and row range are named
  2  the store cannot be opened or an argument is wrong (one error line)
"""


# Descriptions and epilogs are wrapped by hand (RawDescriptionHelpFormatter keeps
# the exit-status table); defaults are written into the help strings with
# %(default)s where an argument has one, rather than ArgumentDefaultsHelpFormatter's
# "(default: None)" after every flag.
_HelpFormatter = argparse.RawDescriptionHelpFormatter


def _add_info(sub: Any) -> None:
    p = sub.add_parser(
        "info",
        help="show format, records, leaves, episodes and size (writes nothing)",
        description="Shows a store's format, records, leaves (dtype, shape), episodes and\n"
        "size on disk. Read-only: it works on a read-only store and writes nothing\n"
        "unless --cache-episodes is given.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("path", help="a store: .h5/.hdf5 file, .zarr group or .npy directory/file")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument(
        "--cache-episodes",
        action="store_true",
        help="also write the episode index beside the store, where the RL views reuse it",
    )
    p.set_defaults(func=cmd_info)


def _add_convert(sub: Any) -> None:
    from grain_replay.writers.oneshot import HDF5_COMPRESSIONS, ZARR_COMPRESSIONS

    compressions = sorted({*HDF5_COMPRESSIONS, *ZARR_COMPRESSIONS})
    p = sub.add_parser(
        "convert",
        help="copy a store into another format, bit-exactly",
        description="Copies SRC into a new store at DST, bit-exactly, streaming in bounded\n"
        "memory. An interrupted convert leaves nothing behind.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("src", help="any store, a Minari or LeRobot dataset, or a D4RL .hdf5 file")
    p.add_argument(
        "dst", help="destination: .h5/.hdf5 writes HDF5, .zarr writes Zarr, else .npy directory"
    )
    p.add_argument(
        "--format", choices=["hdf5", "npy", "zarr"], help="format of DST (default: from its name)"
    )
    p.add_argument(
        "--chunk-rows", type=int, metavar="ROWS", help="rows per chunk (default: contiguous)"
    )
    p.add_argument(
        "--compression",
        choices=compressions,
        help=f"HDF5: {', '.join(HDF5_COMPRESSIONS)}; Zarr: {', '.join(ZARR_COMPRESSIONS)}; "
        ".npy: none (default: uncompressed)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument(
        "--block-bytes",
        type=int,
        default=64 << 20,
        metavar="BYTES",
        help="bytes of records read and written at a time, which bounds the memory used "
        "(default: %(default)s = 64 MiB)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)


def _add_verify(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="check metadata, lengths and checksums; exit 0 ok, 1 corrupt, 2 error",
        description="Reads every leaf of a store and checks its metadata, lengths and\n"
        "recorded checksums.",
        epilog=_VERIFY_EPILOG,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("path", help="a store, a Minari or LeRobot dataset, or a D4RL .hdf5 file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)


def _add_stats(sub: Any) -> None:
    p = sub.add_parser(
        "stats",
        help="per-leaf count, mean, std, min, max, quantiles",
        description="Per-leaf count, mean, std, min, max and quantiles, in one streaming\n"
        "pass; cached beside the store unless --no-cache.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("path", help="a store, a Minari or LeRobot dataset, or a D4RL .hdf5 file")
    p.add_argument("--json", action="store_true", help="machine-readable output (NaN -> null)")
    p.add_argument("--keys", nargs="+", help="leaves or groups (default: all)")
    p.add_argument(
        "--quantiles",
        nargs="+",
        type=float,
        default=[0.01, 0.1, 0.5, 0.9, 0.99],
        metavar="Q",
        help="quantiles in [0, 1] (default: %(default)s)",
    )
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_stats)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="write a synthetic replay in each format and stream it back",
        description="Writes a synthetic replay of transitions as HDF5, .npy and Zarr, then\n"
        "streams one shuffled epoch of each through make_data_loader and\n"
        "sharded_device_put, and prints the rates.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--out", default="demo_out", help="directory the stores go to (default: %(default)s)"
    )
    p.add_argument(
        "--records", type=int, default=200_000, help="transitions per store (default: %(default)s)"
    )
    p.add_argument(
        "--batch-size", type=int, default=256, help="records per batch (default: %(default)s)"
    )
    p.add_argument(
        "--workers", type=int, default=2, help="loader worker processes (default: %(default)s)"
    )
    p.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    """The ``grain-replay`` parser: one ``_add_<command>`` per subcommand."""
    from grain_replay import __version__

    parser = argparse.ArgumentParser(
        prog="grain-replay",
        description="Inspect, convert, verify, describe and demo grain_replay stores (HDF5, .npy,\n"
        "Zarr).",
        epilog="Run 'grain-replay COMMAND --help' for a command's arguments. Expected\n"
        "failures print one 'grain-replay: error: ...' line and exit with status 2.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_info(sub)
    _add_convert(sub)
    _add_verify(sub)
    _add_stats(sub)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``grain-replay``; returns the exit status (2 for every expected failure)."""
    args = build_parser().parse_args(argv)
    from grain_replay.errors import GrainReplayError

    try:
        return int(args.func(args))
    except (GrainReplayError, OSError) as e:
        # Expected failures (bad input, missing or unwritable paths): one line, argparse's form.
        print(f"grain-replay: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
