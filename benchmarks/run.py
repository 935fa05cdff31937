"""Benchmarks of grain_replay: rates and same-run ratios against the limit and the baselines.

Usage: ``python benchmarks/run.py [--quick] [--out DIR] [--data DIR] [--only SUBSTR]
[--sections formats,pipeline,cold,write,sequences,device,startup,online]``.
See benchmarks/README.md.
"""

from __future__ import annotations

import os
import sys

# Before anything imports jax: 8 fake CPU devices, as the test suite uses.
_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

# The bench modules (and baselines.py, which grain's spawned workers unpickle
# sources from) import by name; spawned processes inherit sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

SECTIONS = (
    "formats",
    "formats_extra",
    "pipeline",
    "cold",
    "write",
    "sequences",
    "device",
    "memory",
    "startup",
    "store",
    "online",
)
# "memory" writes a store larger than half of RAM, "startup" spawns ~40 worker
# processes (seconds to the first batch), "store" (bounded, many-writer replay stores:
# bench_replay_store.py) starts writer processes: run them only when asked for.
# "online" (bench_online.py: writer processes, Reverb and torchrl in their own venvs when
# `make bench-online-peers` has built them) runs by default.
DEFAULT_SECTIONS = (
    "formats", "formats_extra", "pipeline", "cold", "write", "sequences", "device", "online",
)  # fmt: skip


def _parse(argv: list[str] | None) -> object:
    import argparse

    p = argparse.ArgumentParser(
        description="grain_replay benchmarks: medians of repeats, ratios measured in the same run."
    )
    p.add_argument("--quick", action="store_true", help="tiny datasets, a few seconds per section")
    p.add_argument("--out", default="bench_out", help="results directory (default bench_out)")
    p.add_argument(
        "--data", default=None, help="dataset directory, reused across runs (default OUT/data)"
    )
    p.add_argument("--only", default=None, help="run only cases whose name contains SUBSTR")
    p.add_argument(
        "--sections",
        nargs="+",
        default=None,
        help=f"sections to run, space- or comma-separated, among {', '.join(SECTIONS)} "
        "(default: all but memory)",
    )
    p.add_argument("--transitions", type=int, default=None, help="transition records N")
    p.add_argument("--image-records", type=int, default=None, help="image records")
    p.add_argument(
        "--batch-size", type=int, default=None, help="records per batch (256; 64 with --quick)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per case (>= 1)")
    p.add_argument(
        "--target-s", type=float, default=None, help="seconds per timed repeat (sets batch count)"
    )
    p.add_argument(
        "--memory-format", choices=("npy", "hdf5", "zarr"), default="npy",
        help="store format of the memory section (default npy)",
    )  # fmt: skip
    args = p.parse_args(argv)
    chosen = []
    for item in args.sections or [",".join(DEFAULT_SECTIONS)]:
        for s in item.split(","):
            if s and s not in SECTIONS:
                p.error(f"unknown section {s!r}; choose among {', '.join(SECTIONS)}")
            if s and s not in chosen:
                chosen.append(s)
    args.sections = tuple(s for s in SECTIONS if s in chosen)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def _versions() -> dict[str, str]:
    import importlib.metadata as md
    import platform

    out = {"python": platform.python_version()}
    for pkg in ("numpy", "grain", "h5py", "zarr", "jax", "array_record", "grain-replay"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "?"
    return out


def main(argv: list[str] | None = None) -> int:
    import functools
    import time

    t_start = time.perf_counter()
    args = _parse(argv)

    import bench_common as common
    import bench_data
    import bench_report
    from bench_cold import run_cold
    from bench_device import run_device
    from bench_formats import run_formats
    from bench_formats_extra import run_formats_extra
    from bench_memory import run_memory
    from bench_online import run_online
    from bench_pipeline import run_pipeline
    from bench_replay_store import run_store
    from bench_sequences import run_sequences
    from bench_startup import run_startup
    from bench_write import run_write

    quick = args.quick
    out_dir = os.path.abspath(args.out)
    data_dir = os.path.abspath(args.data or os.path.join(out_dir, "data"))
    os.makedirs(out_dir, exist_ok=True)
    cfg = common.Config(
        quick=quick,
        data_dir=data_dir,
        out_dir=out_dir,
        only=args.only,
        sections=args.sections,
        transitions=args.transitions or (20_000 if quick else 1_000_000),
        image_records=args.image_records or (2_000 if quick else 100_000),
        repeats=args.repeats,
        batch_size=args.batch_size or (64 if quick else 256),
        target_s=args.target_s or (0.01 if quick else 0.25),
        max_batches=20 if quick else 400,
        # --quick: one spawned grain pipeline of one worker (each worker's start-up takes
        # seconds); the full run times 2 workers.
        loader_workers=(0, 1) if quick else (0, 2),
        case_budget_s=None if quick else 25.0,
    )

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    sampler = common.RssSampler()
    log(f"sections={','.join(cfg.sections)} out={out_dir} data={data_dir}")
    datasets = bench_data.dataset_specs(cfg.transitions, cfg.image_records, cfg.seed)
    t0 = time.perf_counter()
    sampler.reset()
    # The memory and sequences sections write their own stores.
    needs_stores = set(cfg.sections) - {
        "memory", "sequences", "startup", "formats_extra", "store", "online",
    }  # fmt: skip
    # The device section reads the .npy stores only.
    only = ("npy",) if needs_stores == {"device"} else None
    stores = bench_data.ensure_stores(datasets, data_dir, quick, log, only) if needs_stores else {}
    data_s = time.perf_counter() - t0
    common.PAGE_CACHE.track(
        {s.path: s.nbytes for layouts in stores.values() for s in layouts.values()}
    )
    data_rss = sampler.peak()
    log(f"datasets ready in {data_s:.1f}s")

    meta: dict[str, object] = {
        "mode": "quick" if quick else "full",
        "argv": sys.argv[1:] if argv is None else argv,
        "datasets": [f"{d.name} N={d.n:,} ({d.record_bytes:,} B/record)" for d in datasets],
        "stores": {
            ds: {lay: {"path": s.path, "bytes": s.nbytes} for lay, s in layouts.items()}
            for ds, layouts in stores.items()
        },
        "batch_size": cfg.batch_size,
        "repeats": cfg.repeats,
        "target_s_per_repeat": cfg.target_s,
        "only": cfg.only,
        "sections_run": list(cfg.sections),
        "cpu_count": os.cpu_count(),
        "versions": _versions(),
        "data_prep_s": data_s,
        "data_prep_peak_rss_anon_mb": data_rss,
    }
    runners = {
        "formats": run_formats,
        "formats_extra": run_formats_extra,
        "pipeline": run_pipeline,
        "cold": run_cold,
        "write": run_write,
        "sequences": run_sequences,
        "device": run_device,
        "memory": functools.partial(run_memory, fmt=args.memory_format),
        "startup": run_startup,
        "store": run_store,
        "online": run_online,
    }
    results: list[common.SectionResult] = []
    json_path = os.path.join(out_dir, "results.json")
    for name in cfg.sections:
        res = common.SectionResult(name, log=log)
        log(f"section {name}")
        sampler.reset()
        t0 = time.perf_counter()
        runners[name](cfg, stores, res, log)
        res.wall_s = time.perf_counter() - t0
        res.peak_rss_anon_mb = sampler.peak()
        results.append(res)
        log(
            f"section {name} done in {res.wall_s:.1f}s, peak RssAnon {res.peak_rss_anon_mb:,.0f} MB"
        )
        meta["elapsed_s"] = time.perf_counter() - t_start
        bench_report.write_json(json_path, results, meta)  # partial results survive a crash
    sampler.stop()

    meta["elapsed_s"] = time.perf_counter() - t_start
    text = bench_report.markdown(results, meta)
    print()
    print(text)
    bench_report.write_json(json_path, results, meta)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    try:
        plots = bench_report.write_plots(os.path.join(out_dir, "plot.png"), results, meta)
    except ImportError as e:  # a machine without matplotlib (the GPU check's) still reports
        plots = (f"no plots ({e.name} is not installed)",)
    print(f"wrote {json_path}, {', '.join(plots)}")
    print(f"elapsed {time.perf_counter() - t_start:.1f}s (data preparation {data_s:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
