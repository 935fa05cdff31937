"""Sampling benchmarks: prioritized replay vs torchrl and flashbax, mixtures, uniform replay.

One invocation measures everything and prints ratios of medians from that run:

- prioritized sample + read of ``--batch`` transitions from ``--rows`` rows, and a
  priority update of ``--batch`` rows: grain_replay (this process) against torchrl's
  ``PrioritizedReplayBuffer`` over ``LazyMemmapStorage`` and flashbax's prioritized
  flat buffer on the CPU backend (``bench_sampling_peers.py``, run in the separate
  peers venv on the same ``.npy`` data, in the same invocation);
- a two-source mixture's batch against the sum of its parts' ``read_batch``;
- uniform replay over a growing store (a ``ReplayWriter`` appends between repeats,
  the loader looks for new rows every 16 batches) against ``read_batch`` of the
  same indices.

Usage::

    python benchmarks/bench_sampling.py                  # 1M rows; peers if their venv exists
    python benchmarks/bench_sampling.py --quick          # 20k rows, short
    python benchmarks/bench_sampling.py --peers-python .venv-peers/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import run_peer, time_calls, transitions

import grain_replay as gr
from grain_replay.sampling.mixture import MixtureSampler
from grain_replay.sampling.priority import PrioritySampler
from grain_replay.sampling.replay import UniformSampler

HERE = Path(__file__).resolve().parent
# The repo-local venv `make bench-peers` builds.
DEFAULT_PEERS = str(HERE.parent / ".venv-peers" / "bin" / "python")


def _write(path: Path, n: int, *, growing: str | None = None) -> None:
    done = Path(str(path) + ".done")
    if done.exists():
        return
    chunk = 100_000
    if growing:
        with gr.ReplayWriter(path, format=growing) as writer:
            for i in range(0, n, chunk):
                writer.append(transitions(min(chunk, n - i), i + 7))
                writer.flush()
    else:
        gr.write_npy(path, transitions(n), overwrite=True)
    done.touch()


def _warm(path: Path) -> None:
    """Reads every file of a store once: the cases compare reads from the page cache."""
    for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int, per_repeat: int) -> dict:
    """Times each function in turn, repeat by repeat, so load changes hit them alike."""
    for fn in fns.values():
        for _ in range(max(3, per_repeat // 4)):
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(per_repeat):
                fn()
            out[name].append((time.perf_counter() - start) / per_repeat)
    return out


def bench_prioritized(data: Path, args: argparse.Namespace) -> dict[str, Any]:
    src = gr.NpyDataSource(data)
    loader = gr.make_data_loader(
        src, batch_size=args.batch, sampling=gr.PrioritizedReplay(0.6, 0.4, 1e-6)
    )
    it = iter(loader)
    rng = np.random.default_rng(0)
    last: dict[str, Any] = {}

    def sample() -> None:
        last["b"] = next(it)

    # The update alone: checks, queue, and the tree write it causes (a loader applies it
    # at its next draw; here the sampler applies it at once).
    sampler = PrioritySampler(src, gr.PrioritizedReplay(0.6, 0.4, 1e-6), args.batch, seed=0, lag=0)
    drawn, _ = sampler.draw(0)
    step = [1]

    def update() -> None:
        sampler.update(drawn, rng.random(args.batch) + 0.01, step[0])
        sampler.apply_updates(step[0])
        step[0] += 1

    sample()
    assert last["b"].data["obs"].shape == (args.batch, 64)
    return {
        "sample_read_s": time_calls(sample, args.repeats, args.per_repeat),
        "update_s": time_calls(update, args.repeats, args.per_repeat),
    }


def _timed(fn: Callable[[], Any], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - start) / count


def bench_mixture(data: Path, other: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The mixture's batches against ``read_batch`` of the same rows of each source."""
    a, b = gr.NpyDataSource(data), gr.NpyDataSource(other)
    weights = {"a": 0.5, "b": 0.5}
    it = iter(gr.make_data_loader({"a": a, "b": b}, weights=weights, batch_size=args.batch))
    # A twin sampler (another seed) draws rows like the loader's, not the same ones:
    # whichever read a row second would find it in the CPU caches.
    twin = MixtureSampler({"a": len(a), "b": len(b)}, weights, args.batch, seed=1, shuffle=True)
    out: dict[str, list[float]] = {"mixture_s": [], "parts_s": []}
    for r in range(args.repeats + 1):
        tasks = iter([twin.draw() for _ in range(args.per_repeat)])

        def parts(tasks: Any = tasks) -> None:
            task = next(tasks)
            a.read_batch(task["a"])
            b.read_batch(task["b"])

        # Whichever runs second finds the rows in the CPU caches: alternate the order.
        first, second = ("mixture", "parts") if r % 2 else ("parts", "mixture")
        fns = {"mixture": lambda: next(it), "parts": parts}
        t1, t2 = _timed(fns[first], args.per_repeat), _timed(fns[second], args.per_repeat)
        if r:  # the first repeat warms up
            out[f"{first}_s"].append(t1)
            out[f"{second}_s"].append(t2)
    return out


def bench_uniform(store: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Uniform replay over a store that grows between repeats, against ``read_batch``.

    Each repeat starts with a commit; both readers then refresh once (when a row
    past their end is drawn; a ``.npy`` reader maps the new rows in place), and
    the loader also looks at the store's metadata on its schedule. Each repeat is
    ``4 * per_repeat`` batches; the ratio of per-batch medians (no refresh) is
    reported too.
    """
    src = gr.open_source(store)
    plain = gr.open_source(store)
    sampling = gr.UniformReplay(refresh_every=16)
    it = iter(gr.make_data_loader(src, batch_size=args.batch, sampling=sampling))
    twin = UniformSampler(gr.open_source(store), sampling, args.batch, seed=1)
    count = 4 * args.per_repeat
    out: dict[str, list[float]] = {
        "uniform_s": [],
        "read_batch_s": [],
        "uniform_median_s": [],
        "read_batch_median_s": [],
    }
    with gr.ReplayWriter(store, format=args.growing_format) as writer:
        for r in range(args.repeats + 1):
            writer.append(transitions(args.batch, 10_000 + r))  # the store grows
            writer.flush()
            ids = iter([twin.draw() for _ in range(count)])  # rows like the loader's

            def read(ids: Any = ids) -> None:
                rows = next(ids)
                if rows.max() >= len(plain):  # a plain reader must look for new rows too
                    plain.refresh()
                plain.read_batch(rows)

            fns = {"uniform": lambda: next(it), "read_batch": read}
            order = list(fns) if r % 2 else list(fns)[::-1]
            for name in order:
                each = []
                for _ in range(count):
                    start = time.perf_counter()
                    fns[name]()
                    each.append(time.perf_counter() - start)
                if r:  # the first repeat warms up
                    out[f"{name}_s"].append(sum(each) / count)
                    out[f"{name}_median_s"].append(statistics.median(each))
    out["rows_at_end"] = [float(len(src))]
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--per-repeat", type=int, default=50)
    parser.add_argument("--out", default="bench_out/sampling")
    parser.add_argument("--quick", action="store_true", help="20k rows, 3 repeats of 20")
    parser.add_argument(
        "--peers-python",
        default=DEFAULT_PEERS if os.path.exists(DEFAULT_PEERS) else None,
        help="python of the venv with torchrl and flashbax (make bench-peers builds it)",
    )
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--growing-format",
        choices=("npy", "hdf5", "zarr"),
        default="npy",
        help="format of the store uniform replay reads while it grows",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.repeats, args.per_repeat = 20_000, 3, 20
    out = Path(args.out)
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    main_store = data_dir / f"transitions_{args.rows}"
    other_store = data_dir / f"transitions_b_{args.rows // 4}"
    suffix = {"npy": "", "hdf5": ".h5", "zarr": ".zarr"}[args.growing_format]
    growing = data_dir / f"growing_{args.rows}{suffix}"
    _write(main_store, args.rows)
    _write(other_store, max(args.rows // 4, args.batch))
    if growing.exists():  # start each run from the same size
        import shutil

        shutil.rmtree(growing) if growing.is_dir() else growing.unlink()
        Path(str(growing) + ".done").unlink(missing_ok=True)
    _write(growing, args.rows, growing=args.growing_format)
    for store in (main_store, other_store, growing):
        _warm(store)
    print(f"data ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    peers: dict[str, Any] = {}
    peers_proc = None
    peers_json = out / "peers.json"
    if args.peers_python and not args.no_peers:
        cmd = [
            args.peers_python,
            str(HERE / "bench_sampling_peers.py"),
            f"--data={main_store}",
            f"--out={peers_json}",
            f"--batch={args.batch}",
            f"--repeats={args.repeats}",
            f"--per-repeat={args.per_repeat}",
            f"--scratch={data_dir}",
        ]
        peers_proc = cmd
    ours = {
        "prioritized": bench_prioritized(main_store, args),
        "mixture": bench_mixture(main_store, other_store, args),
        "uniform": bench_uniform(growing, args),
    }
    if peers_proc is not None:  # after ours: two processes on 2 cores would time each other
        run_peer(peers_proc[0], peers_proc[1], peers_proc[2:])
        peers = json.loads(peers_json.read_text())

    rows = []
    per = ours["prioritized"]
    ours_sample, ours_update = _med(per["sample_read_s"]), _med(per["update_s"])
    for name, target_sample, target_update in (("torchrl", 3.0, 1.0), ("flashbax", 1.0, None)):
        peer = peers.get(name, {})
        if "sample_read_s" not in peer:
            why = peer.get("skipped", "peers not run (make bench-peers)")
            rows.append((f"PER sample+read vs {name}", None, target_sample, why))
            continue
        rows.append(
            (
                f"PER sample+read {args.batch} of {args.rows} vs {name}",
                _med(peer["sample_read_s"]) / ours_sample,
                target_sample,
                f"ours {ours_sample * 1e6:.0f} us, {name} "
                f"{_med(peer['sample_read_s']) * 1e6:.0f} us",
            )
        )
        rows.append(
            (
                f"PER update {args.batch} vs {name}",
                _med(peer["update_s"]) / ours_update,
                target_update,
                f"ours {ours_update * 1e6:.0f} us, {name} {_med(peer['update_s']) * 1e6:.0f} us",
            )
        )
    mix = ours["mixture"]
    rows.append(
        (
            "mixture / sum of parts' read_batch (lower is better)",
            _med(mix["mixture_s"]) / _med(mix["parts_s"]),
            1.15,
            f"mixture {_med(mix['mixture_s']) * 1e6:.0f} us, "
            f"parts {_med(mix['parts_s']) * 1e6:.0f} us",
        )
    )
    uni = ours["uniform"]
    rows.append(
        (
            f"uniform replay (growing {args.growing_format}) / read_batch speed",
            _med(uni["read_batch_s"]) / _med(uni["uniform_s"]),
            0.8,
            f"uniform {_med(uni['uniform_s']) * 1e6:.0f} us, read_batch "
            f"{_med(uni['read_batch_s']) * 1e6:.0f} us (means, one commit per repeat)",
        )
    )
    rows.append(
        (
            "uniform replay / read_batch speed, per-batch medians",
            _med(uni["read_batch_median_s"]) / _med(uni["uniform_median_s"]),
            0.8,
            f"uniform {_med(uni['uniform_median_s']) * 1e6:.0f} us, read_batch "
            f"{_med(uni['read_batch_median_s']) * 1e6:.0f} us",
        )
    )
    lines = [
        "| comparison | ratio | target | passes | medians |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, ratio, target, note in rows:
        if ratio is None:
            lines.append(f"| {name} | - | {target} | - | {note} |")
            continue
        lower = "lower is better" in name
        ok = None if target is None else (ratio <= target if lower else ratio >= target)
        mark = "-" if ok is None else ("yes" if ok else "NO")
        tgt = "-" if target is None else (f"<= {target}" if lower else f">= {target}x")
        lines.append(f"| {name} | {ratio:.2f} | {tgt} | {mark} | {note} |")
    table = "\n".join(lines)
    print(table)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"ours": ours, "peers": peers}, indent=1))
    print(f"total {time.perf_counter() - t0:.0f} s; results in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
