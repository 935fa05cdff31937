"""File-system calls of the device writer's threads per segment: what the part store does.

The device_actor loop (``examples/device_actor.py``, 1,024 CartPoles, 41 B a row,
capacity 1 << 20: a segment of 65,536 rows, 64 appends) appends every step's
transitions (``jax.Array``s) with ``flush(wait=False)`` every ``--flush-every`` steps.
This probe wraps the ``os`` functions that reach the file system (and ``open``) with
counters by thread (installed here, none in the library) and prints, per segment
written, the calls each thread group makes: the writer's threads (``grain_replay-device``:
the writing and sync threads), the fsync pool (``grain_replay-fsync``) and the caller.
``os.path.exists``/``isdir``/``lexists``/``islink`` count as the ``stat``/``lstat`` they
make. On a CPU backend ``leaves.on_host`` is patched to say no (the accelerator path, as
``probe_device_append_calls.py``) unless ``--cpu-path``.

``--store-only``: no jax; the part store alone driven as the device writer's threads
drive it (one 65,536-row block of the five CartPole leaves a segment, written leaf by
leaf, ``commit_filled`` after each, ``flush`` every ``--flush-every`` appends' worth),
past eviction; prints the calls a segment and the CPU a segment of this thread and the
fsync pool (``time.thread_time``), medians of ``--repeats``.

Run:  python benchmarks/probe_part_store_syscalls.py [--steps N] [--flush-every N] [--cpu-path]
        [--store-only [--segments N] [--repeats N]]
"""

from __future__ import annotations

import argparse
import builtins
import collections
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import numpy as np
from bench_device_writes import CAPACITY, _example, _thread_cpu

import grain_replay as gr
from grain_replay.writers.device import leaves as device_leaves

# The os functions that make a system call on a path or a descriptor.
WRAPPED = (
    "open", "close", "write", "pwrite", "pread", "read", "fsync", "fdatasync",
    "stat", "lstat", "fstat", "mkdir", "makedirs", "rmdir", "unlink", "remove", "rename",
    "replace", "link", "listdir", "scandir", "truncate", "ftruncate",
)  # fmt: skip
COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()
ON = threading.Event()
CPU: collections.Counter[tuple[str, str]] = collections.Counter()  # seconds in the call
CPU_TIMED = False
TRACE: list[str] = []  # with --trace: the writer threads' calls, in order


def _group() -> str:
    name = threading.current_thread().name
    for prefix in ("grain_replay-device", "grain_replay-fsync"):
        if name.startswith(prefix):
            return prefix
    return "caller" if threading.current_thread() is threading.main_thread() else name


def _wrap(name: str, fn: Any) -> Any:
    def counted(*a: Any, **k: Any) -> Any:
        if ON.is_set() and CPU_TIMED:
            g = _group()
            COUNTS[(g, name)] += 1
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                CPU[(g, name)] += time.thread_time() - t
        if ON.is_set():
            g = _group()
            COUNTS[(g, name)] += 1
            if TRACING and g != "caller":
                TRACE.append(f"{g[13:]:7s} {name}({', '.join(_short(x) for x in a)})")
        return fn(*a, **k)

    return counted


TRACING = False


def _short(x: Any) -> str:
    if isinstance(x, str):
        return repr(os.path.basename(x) or x)
    if isinstance(x, (bytes, memoryview)):
        return f"<{len(x)} B>"
    return repr(x) if isinstance(x, int) else type(x).__name__


def install() -> None:
    for name in WRAPPED:
        setattr(os, name, _wrap(name, getattr(os, name)))
    builtins.open = _wrap("builtins.open", builtins.open)


LEAVES = {"obs": (np.float32, 4), "action": (np.int32, 0), "reward": (np.float32, 0),
          "next_obs": (np.float32, 4), "done": (np.bool_, 0)}  # fmt: skip


def store_only(segments: int, flush_every: int, repeats: int, envs: int) -> dict[str, Any]:
    """The part store alone, as the device writer's threads drive it: calls and CPU a
    segment (this thread and the fsync pool), medians of ``repeats``."""
    from grain_replay.writers.parts_writer import PartWriter

    rows = CAPACITY // 16
    block = {k: np.zeros((rows, w) if w else (rows,), dtype=dt) for k, (dt, w) in LEAVES.items()}
    every = max(1, flush_every * envs // rows)  # segments between flushes
    cpu: list[float] = []
    for r in range(repeats + 1):  # the first counted and timed by call, apart
        root = tempfile.mkdtemp(prefix="probe_part_store_")
        try:
            w = PartWriter(os.path.join(root, "s"), "npy", writer_id="a", capacity=CAPACITY,
                           segment_rows=None, chunk_rows=None, compression=None)  # fmt: skip
            arrays, n = w.check(block)
            for i in range(16 + 4):  # past eviction
                w.write(arrays, n, by_leaf=True)
                w.commit_filled()
                if (i + 1) % every == 0:
                    w.flush()
            pool = _thread_cpu("grain_replay-fsync")
            t = time.thread_time()
            if r == 0:
                ON.set()  # the first repeat counted, its CPU apart from the others'
                global CPU_TIMED
                CPU_TIMED = True
            for i in range(segments):
                w.write(arrays, n, by_leaf=True)
                w.commit_filled()
                if (i + 1) % every == 0:
                    w.flush()
            ON.clear()
            spent = 1e6 * (time.thread_time() - t + _thread_cpu("grain_replay-fsync") - pool)
            w.close()
            if r == 0:
                CPU_TIMED = False
                in_calls = 1e6 * sum(CPU.values()) / segments
                print(
                    f"CPU a segment in the file calls: {in_calls:.0f} us of {spent / segments:.0f}"
                )
                for (g, name), c in sorted(CPU.items(), key=lambda kv: -kv[1])[:8]:
                    print(f"    {g}:{name:12s} {1e6 * c / segments:7.0f} us a segment")
            else:
                cpu.append(spent / segments)
        finally:
            ON.clear()
            shutil.rmtree(root, ignore_errors=True)
    med = statistics.median(cpu)
    print(f"store only: {segments} segments of {rows} rows, a flush every {every}")
    print(f"CPU a segment (this thread + fsync pool): {med:.0f} us  {[round(c) for c in cpu]}")
    print(f"  = {med / (rows / envs):.1f} us an append of {envs} rows")
    return {
        "cpu_us_segment": med,
        "calls": {f"{g}:{n}": c / segments for (g, n), c in COUNTS.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--warm", type=int, default=1216, help="steps before counting (evicting)")
    p.add_argument("--trace", type=int, default=0, help="print the first N calls counted")
    p.add_argument("--envs", type=int, default=1024)
    p.add_argument("--flush-every", type=int, default=500)
    p.add_argument("--cpu-path", action="store_true", help="CPU devices read in place")
    p.add_argument("--store-only", action="store_true", help="the part store alone, no jax")
    p.add_argument("--segments", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.store_only:
        install()
        out = store_only(args.segments, args.flush_every, args.repeats, args.envs)
        for key, c in sorted(out["calls"].items(), key=lambda kv: -kv[1]):
            print(f"  {key:36s} {c:8.2f}")
        print(f"  {'calls a segment':36s} {sum(out['calls'].values()):8.2f}")
        return out
    global TRACING
    TRACING = args.trace > 0
    import jax

    if jax.default_backend() == "cpu" and not args.cpu_path:
        device_leaves.on_host = lambda leaf: False
    da = _example()
    step, carry = da.make_actor(args.envs)
    carry, _ = step(carry)
    root = tempfile.mkdtemp(prefix="probe_part_store_")
    install()
    try:
        store = os.path.join(root, "s")
        # Warm: the store, the writer's part and its first segments made, then counted.
        with gr.ReplayWriter(store, format="npy", capacity=CAPACITY) as w:
            carry, _ = da.run_loop(step, carry, args.warm, w, args.flush_every, wait=False)
            seg_rows = w.segment_rows if hasattr(w, "segment_rows") else None
            ON.set()
            carry, _ = da.run_loop(step, carry, args.steps, w, args.flush_every, wait=False)
            ON.clear()
        rows = args.steps * args.envs
        seg_rows = seg_rows or 65536
        segments = rows / seg_rows
    finally:
        ON.clear()
        shutil.rmtree(root, ignore_errors=True)
    groups = sorted({g for g, _ in COUNTS})
    print(
        f"{args.steps} steps x {args.envs} rows, flush(wait=False) every {args.flush_every}: "
        f"{segments:.1f} segments of {seg_rows} rows"
    )
    for line in TRACE[: args.trace]:
        print(line)
    out: dict[str, Any] = {"segments": segments}
    for g in groups:
        calls = {n: c for (gg, n), c in COUNTS.items() if gg == g}
        total = sum(calls.values())
        out[g] = {n: c / segments for n, c in calls.items()}
        print(f"{g}: {total / segments:.1f} calls a segment")
        for n, c in sorted(calls.items(), key=lambda kv: -kv[1]):
            print(f"  {n:16s} {c / segments:8.2f}")
    return out


if __name__ == "__main__":
    main()
