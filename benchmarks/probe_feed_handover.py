# ruff: noqa: E501  (an ad hoc probe: tables printed on the spot)
"""Probe (issue 41): the main thread's cost per batch of the host-fed path, with no step.

The ``bench_feed.py`` MLP workload (its transition store, ``make_data_loader(batch 256,
num_epochs=None, seed=1, worker_count=w)``), iterated with no training step, blocking
only at the end; the per-batch main-thread microseconds of:

- ``loader``: ``next(loader)`` alone (the read, or the hand-over from the workers);
- ``fed``: ``next(sharded_device_put(loader, packed=True))`` read ahead in the caller's
  thread (``put_options.INLINE = True``: what a TPU host runs by default);
- ``ceiling-g{g}``: the same batches already in memory, one packed put + one unpack per
  group of ``g`` (bench_feed's ceiling case): the put/unpack alone;
- ``capture``: ``copy.deepcopy(loader.get_state())`` alone (the per-batch state capture);

then ``fed`` under cProfile, top functions by own time (per batch). ``fed - loader -
ceiling`` is what the feed adds that is neither the read nor the put/unpack.

``pieces`` asks the loader to hand batches over a group at a time (``hand_over``) where
``sharded_device_put`` does (several batches a transfer). ``--cases`` picks the rows.

    JAX_PLATFORMS=cpu python benchmarks/probe_feed_handover.py [--rows N] [--batches K]
        [--workers 0,4] [--cases ceiling,loader,capture,pieces,fed]

Numbers of issue 41's group hand-over (CPU machine, load 2-4, ``--workers 4``, before and
after in turns): ``pieces`` next 70-90 -> 32-45 us a batch; ``fed`` main-thread CPU
182-255 -> 127-147 us a batch (``--batches 1000 --repeats 5``; CHANGELOG).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_device_replay import transitions

import grain_replay as gr
from grain_replay.device import packed as packing
from grain_replay.device import put_options
from grain_replay.device.converter import Converter


def per_batch_us(run: Callable[[int], object], k: int, repeats: int) -> str:
    """Median µs a batch of ``run(k)`` (which blocks at its end): wall, and the main
    thread's CPU time (``thread_time``: what the step's thread pays; on this CPU backend
    jax's own work runs on other threads, so the two differ)."""
    run(max(16, k // 8))  # warm: compiles, worker start-up
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        run(k)
        cpu.append((time.thread_time_ns() - c) / k / 1e3)
        wall.append((time.perf_counter_ns() - t) / k / 1e3)
    return f"wall {statistics.median(wall):7.1f}  main-thread cpu {statistics.median(cpu):7.1f} us/batch"


def pieces(loader: Any, sh: Any, k: int) -> str:
    """The fed path's pieces timed one by one (main-thread CPU µs a batch): the loader's
    next(), the state capture (the feed's per-batch copy before 2026-12; over a loader it now
    computes the state at a checkpoint), the group convert (validate, find the laid-out
    buffer, put, unpack), as ``InlineFeed`` runs them, on a fresh loader."""
    conv = Converter(sh, packed=True)
    it = iter(loader)
    first = next(it)
    g = conv.transfers(first)[0]
    if g > 1 and hasattr(it, "hand_over"):  # as sharded_device_put asks (issue 41)
        it.hand_over(g)
    if getattr(conv, "asks_lanes", conv.lays_out):  # as sharded_device_put asks (before: lays_out)
        it.lay_out_lanes()
    conv.convert_group([first])
    acc = dict.fromkeys(("next", "capture", "convert"), 0)
    outs = []
    clock = time.thread_time_ns
    for n in range(-(-k // g) + 2):
        if n == 2:  # warm: the laid-out batches' layout compiled
            acc = dict.fromkeys(acc, 0)
        batches = []
        for _ in range(g):
            t0 = clock()
            batches.append(next(it))
            t1 = clock()
            copy.deepcopy(it.get_state())
            t2 = clock()
            acc["next"] += t1 - t0
            acc["capture"] += t2 - t1
        t0 = clock()
        outs.append(conv.convert_group(batches))
        acc["convert"] += clock() - t0
        if len(outs) > 4:
            jax.block_until_ready(outs.pop(0))
    jax.block_until_ready(outs)
    it.close()
    nb = (-(-k // g)) * g
    return "  ".join(f"{key} {v / nb / 1e3:6.1f}" for key, v in acc.items()) + f"  (g={g})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", default="0,4")
    p.add_argument("--profile", action="store_true", help="also cProfile the fed loop")
    p.add_argument("--cases", default="ceiling,loader,capture,pieces,fed", help="the rows to time")
    args = p.parse_args(argv)
    cases = set(args.cases.split(","))
    put_options.INLINE = True  # the TPU default: read ahead in the caller's thread
    b, k = args.batch, args.batches
    sh = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
        jax.sharding.PartitionSpec("data"),
    )
    print(f"jax {jax.__version__} {jax.default_backend()}; batch {b}, {k} batches a window")
    with tempfile.TemporaryDirectory() as root:
        gr.write(f"{root}/mlp", transitions(args.rows))
        src = gr.open_source(f"{root}/mlp")
        rng = np.random.default_rng(0)
        hosts = [
            src.read_batch(np.sort(rng.choice(args.rows, b, replace=False))) for _ in range(16)
        ]
        nbytes = sum(v.nbytes for v in hosts[0].values())
        g = max(1, min(packing.MAX_GROUP, packing.GROUP_BYTES // nbytes))
        for gg in (g, packing.MAX_GROUP) if "ceiling" in cases else ():
            group = [a for i in range(gg) for a in jax.tree_util.tree_leaves(hosts[i % 16])]
            lay = packing.plan(group, [sh] * len(group))
            assert lay is not None

            def ceiling(n: int, lay: object = lay, group: list = group, gg: int = gg) -> None:
                outs = [lay.put(group) for _ in range(-(-n // gg))]  # type: ignore[attr-defined]
                jax.block_until_ready(outs)

            print(f"  ceiling-g{gg:<3d} {per_batch_us(ceiling, k, args.repeats)}")
        for w in (int(x) for x in args.workers.split(",")):

            def make(w: int = w) -> object:
                return gr.make_data_loader(
                    src, batch_size=b, num_epochs=None, seed=1, worker_count=w
                )

            it = iter(make())

            def loader(n: int, it: object = it) -> None:
                for _ in range(n):
                    next(it)  # type: ignore[call-overload]

            if "loader" in cases:
                print(f"  w{w} loader     {per_batch_us(loader, k, args.repeats)}")

            def capture(n: int, it: object = it) -> None:
                for _ in range(n):
                    copy.deepcopy(it.get_state())  # type: ignore[attr-defined]

            if "capture" in cases:
                print(f"  w{w} capture    {per_batch_us(capture, k, args.repeats)}")
            it.close()  # type: ignore[attr-defined]
            if "pieces" in cases:
                print(f"  w{w} pieces     {pieces(make(), sh, k)}")
            if "fed" not in cases:
                continue
            fed = gr.sharded_device_put(make(), sh, packed=True)

            def feed(n: int, fed: object = fed) -> None:
                last = None
                for _ in range(n):
                    last = next(fed)  # type: ignore[call-overload]
                jax.block_until_ready(last)

            print(f"  w{w} fed        {per_batch_us(feed, k, args.repeats)}")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                feed(k)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
                print(f"  w{w} fed under cProfile ({k} batches; times are totals):")
                print("\n".join("    " + ln for ln in s.getvalue().splitlines()[4:40]))
            fed.close()


if __name__ == "__main__":
    main()
