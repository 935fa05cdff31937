"""Per device append, each thread's jax calls, lock acquisitions, Python calls and CPU; a profile.

The device_actor loop (``examples/device_actor.py``, 1,024 CartPoles) appends every
step's transitions (``jax.Array``s) with ``flush(wait=False)`` every ``--flush-every``
steps, three ways (``--modes``):

- ``cpu``: no instrument; the caller thread's CPU in ``append`` (``time.thread_time``)
  and the writer's threads' CPU (its own and the fsync pool's), medians of ``--repeats``;
- ``count``: with counting wrappers (installed by this probe, none in the library): the
  jax calls each thread makes (``jit`` calls of the writer's stacking function, and the
  ``jax.Array`` methods that reach the runtime: ``copy_to_host_async``,
  ``block_until_ready``, ``delete``, ``np.asarray``/``__array__``, ``jax.device_get`` and
  ``jax.device_put``; apart, the ``is_deleted`` liveness checks), the acquisitions of
  the writer's lock (its two conditions share it, ``notify`` included, which tries it
  once), and the Python-level calls (profile events), per append;
- ``profile``: cProfile in the caller's ``append`` and in the writer's thread; the top
  functions by own time.

On a CPU backend it is a STAND-IN for an accelerator unless ``--cpu-path``:
``grain_replay.writers.device.leaves.on_host`` is made to say no device is the host's (as
``probe_device_append_cpu.py`` does), so the writer takes the accelerator path (trees
stacked on the device by one jitted call a group, one transfer a leaf a group). On a TPU
nothing is patched. Jax calls per append are what transfers from one host to another (each
costs ~0.12 ms of host CPU on the TPU v5e host); CPU times do not.

Run:  python benchmarks/probe_device_append_calls.py [--steps N] [--repeats N]
        [--flush-every N] [--modes cpu,count,profile] [--cpu-path]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
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
from jax_calls import counting, group, jax_calls

import grain_replay as gr
from grain_replay.writers.device import background
from grain_replay.writers.device import leaves as device_leaves

# (thread group, what) -> count: the Python calls' (profile events).
COUNTS: collections.Counter[tuple[str, str]] = collections.Counter()


def _python_calls(on: bool) -> None:
    """Counts Python-level calls (profile 'call' and 'c_call' events) by thread."""

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            COUNTS[group(), "python calls (profile events)"] += 1

    sys.setprofile(hook if on else None)
    threading.setprofile(hook if on else None)


def _loop(
    da: Any, step: Any, carry: Any, steps: int, flush_every: int, store: str | None, *,
    events: bool = False, profile: dict[str, cProfile.Profile] | None = None,
) -> tuple[float, float, float]:  # fmt: skip
    """One loop; returns (process CPU s, caller CPU s in append, writer threads' CPU s)."""
    import jax

    writer = None if store is None else gr.ReplayWriter(store, format="npy", capacity=CAPACITY)
    pool = _thread_cpu("grain_replay-fsync")
    caller = threads = 0.0
    prof = (
        None
        if profile is None
        else profile.setdefault("caller", cProfile.Profile(time.thread_time))
    )
    if events:
        COUNTS.clear()
    if events:
        _python_calls(True)
    cpu = time.process_time()
    try:
        for i in range(steps):
            if events:
                sys.setprofile(None)
            carry, transition = step(carry)
            if events:
                sys.setprofile(threading.getprofile())
            if writer is not None:
                t = time.thread_time()
                if prof is not None:
                    prof.enable()
                writer.append(transition)
                if prof is not None:
                    prof.disable()
                caller += time.thread_time() - t
                if (i + 1) % flush_every == 0:
                    writer.flush(wait=False)
        if writer is not None:
            writer.flush()
            threads = _thread_cpu("grain_replay-device")  # before close ends them
        if events:
            _python_calls(False)
        jax.block_until_ready(carry)
    finally:
        if events:
            _python_calls(False)
        if writer is not None:
            writer.close()
    cpu = time.process_time() - cpu
    threads += _thread_cpu("grain_replay-fsync") - pool
    return cpu, caller, threads


def _profile_thread(profiles: dict[str, cProfile.Profile]) -> None:
    """cProfile in the writer's thread: its ``_run`` wrapped (once, before it starts)."""
    orig = background.BackgroundWriter._run

    def run(self: Any) -> None:
        prof = profiles.setdefault(
            threading.current_thread().name, cProfile.Profile(time.thread_time)
        )
        prof.enable()
        try:
            orig(self)
        finally:
            prof.disable()

    background.BackgroundWriter._run = run  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--envs", type=int, default=1024)
    p.add_argument("--flush-every", type=int, default=500)
    p.add_argument("--modes", default="cpu,count,profile")
    p.add_argument(
        "--cpu-path", action="store_true", help="CPU devices read in place (no stand-in)"
    )
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--sort", default="tottime", help="pstats sort key (tottime, ncalls, cumtime)")
    args = p.parse_args(argv)
    import jax

    modes = args.modes.split(",")
    stand_in = jax.default_backend() == "cpu" and not args.cpu_path
    if stand_in:
        device_leaves.on_host = lambda leaf: False  # the CPU stand-in for an accelerator
    da = _example()
    step, carry = da.make_actor(args.envs)
    carry, _ = step(carry)
    jax.block_until_ready(carry)
    root = tempfile.mkdtemp(prefix="probe_device_calls_")
    out: dict[str, Any] = {"backend": jax.default_backend(), "stand_in": stand_in}
    print(
        f"backend {jax.default_backend()}{' (CPU STAND-IN for an accelerator)' if stand_in else ''}"
        f", {args.envs} envs, {args.steps} steps, flush(wait=False) every {args.flush_every}"
    )
    n = 0
    try:
        warm = os.path.join(root, "w")
        _loop(da, step, carry, min(args.steps, 500), args.flush_every, warm)
        if "cpu" in modes:
            caller, writer, extra = [], [], []
            for r in range(args.repeats):
                off, _, _ = _loop(da, step, carry, args.steps, args.flush_every, None)
                store = os.path.join(root, f"s{r}")
                on, in_append, threads = _loop(da, step, carry, args.steps, args.flush_every, store)
                shutil.rmtree(store, ignore_errors=True)
                caller.append(1e6 * in_append / args.steps)
                writer.append(1e6 * threads / args.steps)
                extra.append(1e6 * (on - off) / args.steps)
            med = statistics.median
            out.update(caller_us=med(caller), writer_us=med(writer), extra_us=med(extra))
            print(f"caller's CPU in append:          {med(caller):8.1f} us an append  {caller}")
            print(f"writer threads' CPU:             {med(writer):8.1f} us an append  {writer}")
            print(f"process CPU beyond the bare loop: {med(extra):7.1f} us an append  {extra}")
        if "profile" in modes:
            profiles: dict[str, cProfile.Profile] = {}
            _profile_thread(profiles)
            store = os.path.join(root, f"p{n}")
            _loop(da, step, carry, args.steps, args.flush_every, store, profile=profiles)
            shutil.rmtree(store, ignore_errors=True)
            for name, prof in profiles.items():
                s = io.StringIO()
                st = pstats.Stats(prof, stream=s)
                print(
                    f"--- profile: {name} (total {st.total_tt * 1e6 / args.steps:.1f} us an append)"
                )
                st.sort_stats(args.sort).print_stats(args.top)
                print("\n".join(s.getvalue().splitlines()[6:]))
        if "count" in modes:
            store = os.path.join(root, f"e{n}")
            _loop(da, step, carry, args.steps, args.flush_every, store, events=True)
            shutil.rmtree(store, ignore_errors=True)
            events = collections.Counter(COUNTS)
            # The packer was made (and its programs compiled) by the loops before: the
            # counted loop is a steady one.
            with counting(locks=True) as calls:
                store = os.path.join(root, f"c{n}")
                _loop(da, step, carry, args.steps, args.flush_every, store)
                shutil.rmtree(store, ignore_errors=True)
            calls.update(events)
            counts = {f"{g}: {w}": c / args.steps for (g, w), c in sorted(calls.items())}
            out["counts"] = counts
            for k, v in counts.items():
                print(f"  {k}: {v:.3f} an append")
            for g in sorted({g for g, _ in calls}):
                checks = jax_calls(calls, g, "check:") / args.steps
                print(
                    f"jax calls (dispatches) an append, {g}: "
                    f"{jax_calls(calls, g) / args.steps:.3f} (and {checks:.3f} is_deleted)"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
