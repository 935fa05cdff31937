"""Device writes: the device_actor loop saving every step against the same loop not saving.

``examples/device_actor.py`` steps 1,024 JAX CartPoles under ``jit`` and appends each
step's transitions (``jax.Array``s, 41 B a row) to a bounded store, committing every
``flush_every`` steps with ``flush(wait=False)`` (in the background) as the example
does. The ratio of steps/s with writing to without, interleaved repeats, median: the
target is >= 0.85 on CPU, >= 0.9 on a TPU (>= 0.95 on a GPU). Beside it, in the same
run: the same loop with a blocking ``flush()`` every ``flush_every`` steps (the
durability barrier in the loop) and with one flush at the end. The diagnostic rows
say where a miss goes: the writer's own throughput on the same host arrays (what the
background thread must keep up with), each thread's CPU and jax calls per append (the
calls are what carries over to a host whose jax calls cost more), the time of one
blocking flush, the caller's time in ``flush(wait=False)`` and how long its commit
takes to be visible; then the device memory before and after a 10,000-step writing loop.

Loops of 6,000 steps by default (about 1.2 s each on a 2-core VM): each timed loop ends
with a blocking ``flush()`` (every row durable before the clock stops), a fixed ~15 ms
there, which is ~4% of a 2,000-step loop but ~1% of this one; an actor that runs for
hours pays it once. ``--steps 2000`` gives the shorter loops (same code, noisier here:
0.82-0.93 against 0.85-0.88 in three runs each, docs/device_writes.md).

Run:  python benchmarks/bench_device_writes.py [--quick] [--steps N] [--repeats N]
      [--memory-steps N] [--out FILE]
(``--out``: the rows as JSON too, with the backend they ran on and, under ``memory``,
``jax.devices()[0].memory_stats()`` and the count of live jax arrays before and after a
writing loop of ``--memory-steps`` steps (10,000): what the writer holds on the device
stays flat. ``memory_stats()`` is None on CPU devices; the live arrays say it there.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

import grain_replay as gr

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from jax_calls import counting, jax_calls  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "device_actor.py"
ENVS = 1024
CAPACITY = 1 << 20


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_actor", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_actor", module)
    spec.loader.exec_module(module)
    return module


def _target(platform: str) -> float:
    return {"cpu": 0.85, "tpu": 0.9}.get(platform, 0.95)


def _device_memory() -> dict[str, int] | None:
    """``jax.devices()[0].memory_stats()`` (None on CPU devices, which keep no count)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if stats is None else {k: int(v) for k, v in stats.items()}


def _memory(
    da: ModuleType, step: Any, carry: Any, steps: int, flush_every: int, store: str
) -> dict[str, Any]:
    """Device memory and live jax arrays before and after one writing loop of ``steps``
    steps (flush(wait=False) every ``flush_every``, as the example), the writer closed:
    what the writer holds on the device must not grow with the steps."""
    import gc

    import jax

    jax.block_until_ready(carry)
    gc.collect()
    before, live_before = _device_memory(), len(jax.live_arrays())
    with gr.ReplayWriter(store, format="npy", capacity=CAPACITY) as w:
        carry, _ = da.run_loop(step, carry, steps, w, flush_every, wait=False)
        rows = w.live
    jax.block_until_ready(carry)
    del carry
    gc.collect()
    after, live_after = _device_memory(), len(jax.live_arrays())
    return {
        "steps": steps,
        "rows_live": rows,
        "memory_stats_before": before,
        "memory_stats_after": after,
        "live_arrays_before": live_before,
        "live_arrays_after": live_after,
    }


def _thread_cpu(prefix: str) -> float:
    """CPU seconds of this process's live threads whose name starts with ``prefix``."""
    total = 0.0
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ValueError):  # the thread ended meanwhile
                pass
    return total


def _profile(
    da: ModuleType, step: Any, carry: Any, steps: int, flush_every: int, store: str, wait: bool
) -> dict[str, float]:
    """One more writing loop, instrumented: the main thread's CPU per append, the writer's
    threads' CPU per append (its own threads and the fsync pool), the caller's time in one
    flush (``wait``: blocking, else ``flush(wait=False)``) and, without ``wait``, the time
    from that call until its commit is visible (``committed`` seen moving, step by step)."""
    import jax

    main_cpu = 0.0
    flushes: list[float] = []
    visible: list[float] = []
    asked: tuple[int, float] | None = None  # (rows, when) of the commit not yet seen
    pool_before = _thread_cpu("grain_replay-fsync")
    with gr.ReplayWriter(store, format="npy", capacity=CAPACITY) as w:
        for i in range(steps):
            carry, transition = step(carry)
            t = time.thread_time()
            w.append(transition)
            main_cpu += time.thread_time() - t
            if asked is not None and w.committed >= asked[0]:
                visible.append(time.perf_counter() - asked[1])
                asked = None
            if (i + 1) % flush_every == 0:
                t = time.perf_counter()
                rows = w.flush(wait=wait)
                flushes.append(time.perf_counter() - t)
                if not wait and asked is None:
                    asked = (rows, t)
        w.flush()
        writer_cpu = _thread_cpu("grain_replay-device")  # writes and syncs; end at close
    jax.block_until_ready(carry)
    pool_cpu = _thread_cpu("grain_replay-fsync") - pool_before
    med = statistics.median
    return {
        "main_us": 1e6 * main_cpu / steps,
        "writer_us": 1e6 * (writer_cpu + pool_cpu) / steps,
        "flush_ms": 1e3 * med(flushes) if flushes else float("nan"),
        "visible_ms": 1e3 * med(visible) if visible else float("nan"),
    }


def _jax_calls(
    da: ModuleType, step: Any, carry: Any, steps: int, flush_every: int, store: str
) -> dict[str, float]:
    """One more writing loop (flush(wait=False) every ``flush_every`` steps), untimed, with
    counting wrappers (benchmarks/jax_calls.py): the jax calls (dispatches) per append of
    the caller's thread (in ``append`` and ``flush``) and of the writer's threads, and the
    caller's liveness checks (``is_deleted``, no dispatch). The actor's own step is not
    counted (it runs with or without writing)."""
    with counting() as calls, gr.ReplayWriter(store, format="npy", capacity=CAPACITY) as w:
        for i in range(steps):
            carry, transition = step(carry)
            w.append(transition)
            if (i + 1) % flush_every == 0:
                w.flush(wait=False)
        w.flush()
    threads = sum(jax_calls(calls, g) for g in {g for g, _ in calls} if g != "caller")
    return {
        "caller": jax_calls(calls, "caller") / steps,
        "threads": threads / steps,
        "checks": jax_calls(calls, "caller", "check:") / steps,
    }


def run(
    quick: bool,
    *,
    steps: int | None = None,
    repeats: int | None = None,
    envs: int = ENVS,
    memory_steps: int | None = None,
    memory: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Rows of ``{"name", "value", "target", "unit"}``; ``target`` None for diagnostics.
    ``memory``, when given, receives the device memory before and after a writing loop
    of ``memory_steps`` steps (default 10,000; 1,000 with ``quick``): :func:`_memory`.

    Fair by construction: both loops run the same jitted step from the same carry for
    the same number of steps in the same process (so with the same XLA threads), one
    untimed round of every mode first (compilation, thread start, first files), then
    the modes interleaved, their order reversed every other repeat."""
    import jax

    da = _example()
    steps = steps or (300 if quick else 6000)
    repeats = repeats or (3 if quick else 5)
    flush_every = 100 if quick else 500
    step, carry = da.make_actor(envs)
    carry, transition = step(carry)  # compile
    jax.block_until_ready(carry)
    host = jax.tree.map(np.asarray, transition)
    root = tempfile.mkdtemp(prefix="bench_device_writes_")
    load = [os.getloadavg()[0]]
    # off: not writing; on: flush(wait=False) every flush_every steps (as the example);
    # blocking: flush() every flush_every steps; once: one flush at the end.
    times: dict[str, list[float]] = {"off": [], "on": [], "blocking": [], "once": []}
    loop_cpu: list[float] = []  # CPU seconds (every thread) per step, not writing
    writer_rates: list[float] = []
    writer_cpu: list[float] = []  # CPU seconds per append of the writer alone
    modes = ("off", "on", "blocking", "once")

    def loop(mode: str, tag: str) -> float:
        writer = None
        store = os.path.join(root, f"actor-{tag}-{mode}")
        if mode != "off":
            writer = gr.ReplayWriter(store, format="npy", capacity=CAPACITY)
        every = steps + 1 if mode == "once" else flush_every
        cpu = time.process_time()
        try:
            _, seconds = da.run_loop(step, carry, steps, writer, every, wait=mode != "on")
            if mode == "off" and tag != "warm":
                loop_cpu.append((time.process_time() - cpu) / steps)
        finally:
            if writer is not None:
                writer.close()
                shutil.rmtree(store, ignore_errors=True)
        return float(seconds)

    try:
        for mode in modes:
            loop(mode, "warm")  # untimed
        for r in range(repeats):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                times[mode].append(loop(mode, str(r)))
            # The writer alone on the same rows (host arrays, written in the call).
            path = os.path.join(root, f"host-{r}")
            with gr.ReplayWriter(path, format="npy", capacity=CAPACITY) as w:
                start, cpu = time.perf_counter(), time.process_time()
                for i in range(steps):
                    w.append(host)
                    if (i + 1) % flush_every == 0:
                        w.flush()
                w.flush()
                writer_rates.append(steps / (time.perf_counter() - start))
                writer_cpu.append((time.process_time() - cpu) / steps)
            shutil.rmtree(path, ignore_errors=True)
        load.append(os.getloadavg()[0])
        prof = _profile(da, step, carry, steps, flush_every, os.path.join(root, "p-on"), False)
        blocking = _profile(da, step, carry, steps, flush_every, os.path.join(root, "p-bl"), True)
        calls = _jax_calls(da, step, carry, steps, flush_every, os.path.join(root, "p-calls"))
        mem_steps = memory_steps or (1000 if quick else 10_000)
        mem = _memory(da, step, carry, mem_steps, flush_every, os.path.join(root, "mem"))
        if memory is not None:
            memory.update(mem)
        load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    platform = jax.default_backend()
    med = statistics.median
    ratios = [off / on for off, on in zip(times["off"], times["on"])]
    barrier = [off / on for off, on in zip(times["off"], times["blocking"])]
    overlap = [off / once for off, once in zip(times["off"], times["once"])]
    row_bytes = sum(a[0].nbytes for a in host.values())
    return [
        {
            "name": f"device writes: loop with writing / without ({platform}, {envs} envs, "
            f"flush(wait=False) every {flush_every} steps, as examples/device_actor.py)",
            "value": med(ratios),
            "target": _target(platform),
            "unit": "x",
        },
        {"name": f"same, a blocking flush() every {flush_every} steps (--blocking-flush)",
         "value": med(barrier), "target": None, "unit": "x"},
        {"name": "same, one flush at the end (copy + write overlap, no barrier)",
         "value": med(overlap), "target": None, "unit": "x"},
        {"name": "device_actor loop without writing", "value": steps / med(times["off"]),
         "target": None, "unit": "steps/s"},
        {"name": "device_actor loop with writing", "value": steps / med(times["on"]),
         "target": None, "unit": "steps/s"},
        {"name": "device_actor loop with writing, blocking flushes",
         "value": steps / med(times["blocking"]), "target": None, "unit": "steps/s"},
        {"name": f"ReplayWriter alone, host arrays ({envs} rows x {row_bytes} B an append)",
         "value": med(writer_rates), "target": None, "unit": "appends/s"},
        {"name": "CPU time of a step, not writing (XLA threads included)",
         "value": 1e6 * med(loop_cpu), "target": None, "unit": "us"},
        {"name": "CPU time of an append, the writer alone (its flushes included)",
         "value": 1e6 * med(writer_cpu), "target": None, "unit": "us"},
        {"name": "main thread's CPU time in a device append (check, queue)",
         "value": prof["main_us"], "target": None, "unit": "us"},
        {"name": "writer threads' CPU time per device append (host copy, write, checksums, "
         "segments, syncs, commits)", "value": prof["writer_us"], "target": None, "unit": "us"},
        {"name": "jax calls per device append, the caller's thread (dispatches: jit calls, "
         "host copies, np.asarray of a jax.Array, device_get/put; benchmarks/jax_calls.py)",
         "value": calls["caller"], "target": None, "unit": "calls"},
        {"name": "jax calls per device append, the writer's threads (stacking, host copies)",
         "value": calls["threads"], "target": None, "unit": "calls"},
        {"name": "liveness checks per device append, the caller's thread (Array.is_deleted, "
         "a C++ accessor: no dispatch)", "value": calls["checks"], "target": None,
         "unit": "calls"},
        {"name": f"one flush() in the writing loop ({flush_every} steps of rows)",
         "value": blocking["flush_ms"], "target": None, "unit": "ms"},
        {"name": "one flush(wait=False) in the writing loop (the caller's time)",
         "value": prof["flush_ms"], "target": None, "unit": "ms"},
        {"name": "flush(wait=False) until its rows are visible (committed moves; seen at "
         "the next step)", "value": prof["visible_ms"], "target": None, "unit": "ms"},
        {"name": f"device bytes in use before a {mem_steps}-step writing loop (memory_stats(); "
         "None on CPU devices)", "value": _in_use(mem["memory_stats_before"]), "target": None,
         "unit": "B"},
        {"name": "device bytes in use after it (the writer closed)",
         "value": _in_use(mem["memory_stats_after"]), "target": None, "unit": "B"},
        {"name": f"live jax arrays before / after the {mem_steps}-step writing loop",
         "value": mem["live_arrays_after"] - mem["live_arrays_before"], "target": None,
         "unit": f"arrays more ({mem['live_arrays_before']} before)"},
        {"name": "1-min load average (highest seen)", "value": max(load), "target": None,
         "unit": ""},
    ]  # fmt: skip


def _in_use(stats: dict[str, int] | None) -> float | None:
    return None if stats is None else float(stats.get("bytes_in_use", float("nan")))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--memory-steps",
        type=int,
        default=None,
        help="steps of the loop whose device memory is taken before and after (10,000)",
    )
    p.add_argument("--out", default="", help="also write the rows to FILE (JSON)")
    args = p.parse_args(argv)
    memory: dict[str, Any] = {}
    rows = run(
        args.quick,
        steps=args.steps,
        repeats=args.repeats,
        memory_steps=args.memory_steps,
        memory=memory,
    )
    for row in rows:
        target = "" if row["target"] is None else f"  (target >= {row['target']})"
        value = "None" if row["value"] is None else f"{row['value']:.3g}"
        print(f"{row['name']}: {value} {row['unit']}{target}")
    print(f"memory_stats() before: {memory['memory_stats_before']}")
    print(f"memory_stats() after:  {memory['memory_stats_after']}")
    if args.out:
        import jax

        # rows[0] is the loop with writing / without; NaN (no sample) is written as null.
        clean = [
            {**r, "value": None if r["value"] is None or r["value"] != r["value"] else r["value"]}
            for r in rows
        ]
        doc = {
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
            "rows": clean,
            "memory": memory,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
