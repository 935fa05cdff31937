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

Run:  python benchmarks/probe_part_store_syscalls.py [--steps N] [--flush-every N] [--cpu-path]
"""

from __future__ import annotations

import argparse
import builtins
import collections
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_device_writes import CAPACITY, _example

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
TRACE: list[str] = []  # with --trace: the writer threads' calls, in order


def _group() -> str:
    name = threading.current_thread().name
    for prefix in ("grain_replay-device", "grain_replay-fsync"):
        if name.startswith(prefix):
            return prefix
    return "caller" if threading.current_thread() is threading.main_thread() else name


def _wrap(name: str, fn: Any) -> Any:
    def counted(*a: Any, **k: Any) -> Any:
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--warm", type=int, default=1216, help="steps before counting (evicting)")
    p.add_argument("--trace", type=int, default=0, help="print the first N calls counted")
    p.add_argument("--envs", type=int, default=1024)
    p.add_argument("--flush-every", type=int, default=500)
    p.add_argument("--cpu-path", action="store_true", help="CPU devices read in place")
    args = p.parse_args(argv)
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
