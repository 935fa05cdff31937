"""CPU per device append: the caller thread's and the whole process's, on the accelerator path.

A CPU STAND-IN for an accelerator: ``grain_replay.writers.device.leaves.on_host`` is made to
say no device is the host's (as tests/writers/test_device_pack.py does), so the writer takes
the accelerator path with CPU arrays: like trees stacked by one jitted call a group, a
transfer a leaf a group, blocks written by the writer's thread. The device_actor loop
(``examples/device_actor.py``, 1,024 CartPoles) runs without writing, then appending every
step with ``flush(wait=False)`` every ``--flush-every`` steps; printed per append (medians
over ``--repeats``): the caller's thread CPU in ``append`` (``time.thread_time``), the
writer threads' CPU, and the process's CPU beyond the loop without writing (every thread,
XLA's included). What an append costs the training loop on an accelerator host is the
caller's number plus the GIL the writer's threads hold; wall-clock ratios here are not the
accelerator's (the step runs on these same cores).

Run:  python benchmarks/probe_device_append_cpu.py [--steps N] [--repeats N] [--envs N]
        [--flush-every N] [--nested]
(``--nested``: the same arrays appended as a nested tree, a dict of dicts and a tuple.)
"""

from __future__ import annotations

import argparse
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
from bench_device_writes import CAPACITY, _example, _thread_cpu

import grain_replay as gr
from grain_replay.writers.device import leaves as device_leaves


def _nest(transition: dict[str, Any]) -> dict[str, Any]:
    """The step's leaves as a nested tree (a dict of dicts and a tuple): the same arrays."""
    t = transition
    return {
        "obs": {"now": t["obs"], "next": t["next_obs"]},
        "step": (t["action"], t["reward"], t["done"]),
    }


def _loop(
    da: Any,
    step: Any,
    carry: Any,
    steps: int,
    flush_every: int,
    store: str | None,
    nested: bool = False,
):
    """One loop; returns (process CPU s, caller CPU s in append, writer threads' CPU s)."""
    import jax

    writer = None if store is None else gr.ReplayWriter(store, format="npy", capacity=CAPACITY)
    pool = _thread_cpu("grain_replay-fsync")
    caller = 0.0
    cpu = time.process_time()
    threads = 0.0
    try:
        for i in range(steps):
            carry, transition = step(carry)
            if nested:
                transition = _nest(transition)
            if writer is not None:
                t = time.thread_time()
                writer.append(transition)
                caller += time.thread_time() - t
                if (i + 1) % flush_every == 0:
                    writer.flush(wait=False)
        if writer is not None:
            writer.flush()
            threads = _thread_cpu("grain_replay-device")  # before close ends them
        jax.block_until_ready(carry)
    finally:
        if writer is not None:
            writer.close()
    cpu = time.process_time() - cpu
    threads += _thread_cpu("grain_replay-fsync") - pool
    return cpu, caller, threads


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--envs", type=int, default=1024)
    p.add_argument("--flush-every", type=int, default=500)
    p.add_argument("--nested", action="store_true", help="append the transitions as a nested tree")
    args = p.parse_args(argv)
    import jax

    device_leaves.on_host = lambda leaf: False  # the CPU stand-in for an accelerator
    da = _example()
    step, carry = da.make_actor(args.envs)
    carry, _ = step(carry)
    jax.block_until_ready(carry)
    root = tempfile.mkdtemp(prefix="probe_device_append_")
    off: list[float] = []
    total: list[float] = []
    caller: list[float] = []
    writer: list[float] = []
    try:
        warm = os.path.join(root, "w")
        _loop(da, step, carry, min(args.steps, 500), args.flush_every, warm, args.nested)
        for r in range(args.repeats + 1):
            cpu, _, _ = _loop(da, step, carry, args.steps, args.flush_every, None, args.nested)
            store = os.path.join(root, f"s{r}")
            cpu_on, in_append, threads = _loop(
                da, step, carry, args.steps, args.flush_every, store, args.nested
            )
            shutil.rmtree(store, ignore_errors=True)
            if r == 0:
                continue  # warm-up
            off.append(cpu / args.steps)
            total.append((cpu_on - cpu) / args.steps)
            caller.append(in_append / args.steps)
            writer.append(threads / args.steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    out = {
        "caller_us": 1e6 * med(caller),
        "writer_threads_us": 1e6 * med(writer),
        "process_extra_us": 1e6 * med(total),
        "step_cpu_us": 1e6 * med(off),
    }
    print(
        f"CPU STAND-IN for an accelerator (jax backend {jax.default_backend()}, on_host "
        f"patched to False; {args.envs} envs, {args.steps} steps, flush(wait=False) every "
        f"{args.flush_every}, {'nested' if args.nested else 'flat'} trees, median of "
        f"{args.repeats}, {threading.active_count()} threads)"
    )
    print(f"caller thread's CPU per append (in append):    {out['caller_us']:8.1f} us")
    print(f"writer threads' CPU per append:               {out['writer_threads_us']:8.1f} us")
    print(f"process CPU per append beyond the bare loop:  {out['process_extra_us']:8.1f} us")
    print(f"process CPU per step of the bare loop:        {out['step_cpu_us']:8.1f} us")
    return out


if __name__ == "__main__":
    main()
