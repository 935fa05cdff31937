"""Device writes: the device_actor loop saving every step against the same loop not saving.

``examples/device_actor.py`` steps 1,024 JAX CartPoles under ``jit`` and appends each
step's transitions (``jax.Array``s, 41 B a row) to a bounded store, flushing every
``flush_every`` steps. The ratio of steps/s with writing to without, interleaved
repeats, median: the target is >= 0.85 on CPU (>= 0.95 on a GPU). The diagnostic
rows say where a miss goes: the writer's own throughput on the same host arrays
(what the background thread must keep up with), and the median time of one flush
(the durability barrier the loop waits for).

Run:  python benchmarks/bench_device_writes.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

import grain_replay as gr

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "device_actor.py"
ENVS = 1024


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_actor", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_actor", module)
    spec.loader.exec_module(module)
    return module


def _target(platform: str) -> float:
    return 0.85 if platform == "cpu" else 0.95


def run(
    quick: bool, *, steps: int | None = None, repeats: int | None = None, envs: int = ENVS
) -> list[dict[str, Any]]:
    """Rows of ``{"name", "value", "target", "unit"}``; ``target`` None for diagnostics."""
    import jax

    da = _example()
    steps = steps or (300 if quick else 2000)
    repeats = repeats or (3 if quick else 5)
    flush_every = 100 if quick else 500
    capacity = 1 << 20
    step, carry = da.make_actor(envs)
    carry, transition = step(carry)  # compile
    jax.block_until_ready(carry)
    host = jax.tree.map(np.asarray, transition)
    root = tempfile.mkdtemp(prefix="bench_device_writes_")
    plain: list[float] = []
    saving: list[float] = []
    ratios: list[float] = []
    overlap: list[float] = []  # flushed once, at the end: how well copy + write overlap
    writer_rates: list[float] = []
    flushes: list[float] = []
    loop_cpu: list[float] = []  # CPU seconds (every thread) per step, not writing
    writer_cpu: list[float] = []  # CPU seconds per append of the writer alone
    try:
        for r in range(repeats):
            times = {}
            modes = ("off", "on", "once")
            for mode in modes if r % 2 == 0 else modes[::-1]:
                writer = None
                if mode != "off":
                    store = os.path.join(root, f"actor-{r}-{mode}")
                    writer = gr.ReplayWriter(store, format="npy", capacity=capacity)
                every = steps + 1 if mode == "once" else flush_every
                cpu = time.process_time()
                try:
                    _, seconds = da.run_loop(step, carry, steps, writer, every)
                    if mode == "off":
                        loop_cpu.append((time.process_time() - cpu) / steps)
                finally:
                    if writer is not None:
                        writer.close()
                        shutil.rmtree(store, ignore_errors=True)
                times[mode] = seconds
            plain.append(steps / times["off"])
            saving.append(steps / times["on"])
            ratios.append(times["off"] / times["on"])
            overlap.append(times["off"] / times["once"])
            # The writer alone on the same rows (host arrays, written in the call).
            path = os.path.join(root, f"host-{r}")
            with gr.ReplayWriter(path, format="npy", capacity=capacity) as w:
                start, cpu = time.perf_counter(), time.process_time()
                for i in range(steps):
                    w.append(host)
                    if (i + 1) % flush_every == 0:
                        t = time.perf_counter()
                        w.flush()
                        flushes.append(time.perf_counter() - t)
                w.flush()
                writer_rates.append(steps / (time.perf_counter() - start))
                writer_cpu.append((time.process_time() - cpu) / steps)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    platform = jax.default_backend()
    med = statistics.median
    row_bytes = sum(a[0].nbytes for a in host.values())
    return [
        {
            "name": f"device writes: loop with writing / without ({platform}, {envs} envs, "
            f"flush every {flush_every} steps)",
            "value": med(ratios),
            "target": _target(platform),
            "unit": "x",
        },
        {"name": "same, one flush at the end (copy + write overlap, no barrier)",
         "value": med(overlap), "target": None, "unit": "x"},
        {"name": "device_actor loop without writing", "value": med(plain), "target": None,
         "unit": "steps/s"},
        {"name": "device_actor loop with writing", "value": med(saving), "target": None,
         "unit": "steps/s"},
        {"name": f"ReplayWriter alone, host arrays ({envs} rows x {row_bytes} B an append)",
         "value": med(writer_rates), "target": None, "unit": "appends/s"},
        {"name": "CPU time of a step, not writing (XLA threads included)",
         "value": 1e6 * med(loop_cpu), "target": None, "unit": "us"},
        {"name": "CPU time of an append, the writer alone (its flushes included)",
         "value": 1e6 * med(writer_cpu), "target": None, "unit": "us"},
        {"name": f"one flush() ({flush_every} steps of rows)", "value": 1e3 * med(flushes)
         if flushes else float("nan"), "target": None, "unit": "ms"},
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    rows = run(args.quick, steps=args.steps, repeats=args.repeats)
    for row in rows:
        target = "" if row["target"] is None else f"  (target >= {row['target']})"
        print(f"{row['name']}: {row['value']:.3g} {row['unit']}{target}")
    return rows


if __name__ == "__main__":
    main()
