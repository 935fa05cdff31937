"""Probe: what resident replay's compiles cost, and what keeping its programs saves.

Two parts, one run (CPU: 8 fake devices; a TPU's own devices when there is one):

``iterators``: ``sharded_device_put(loader, resident=True)`` over a store of 5 leaves (the
one ``tests/device/test_resident.py`` uses), batch 16, windows of 8 and of 64 batches.
``before``: no program kept (``resident_programs._KEPT = 0``, what every iterator did
before the programs were kept): each iterator's build and first batch, and the seconds jax
spent tracing, lowering and compiling. ``after``: the first iterator (``cold``) and the
next ones of the same shapes (``kept``). ``per_batch_us``: host time of ``next()`` a batch
over 64 epochs (768 batches) after the first (the gathers dispatched as they are, blocked at
the end), ``calls`` and ``outputs``: jax calls (gather dispatches and id arrays made) and
arrays the gathers return, a batch handed out; each before and after.

``programs``: the window's gather built three ways on the same store: ``unroll`` (one
gather a batch, what resident replay runs), ``flat`` (one gather of the window's rows, then
split into batches inside the program) and ``map`` (``jax.lax.map`` over the window, then
split): compile seconds, host time a batch, and the program's temporary bytes (XLA's
memory analysis: a window-sized temporary is memory the budget does not count).

Medians of ``--repeats`` (3). Prints a table and one JSON object.

    python benchmarks/probe_resident_compile.py [--windows 8,64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import grain_replay as gr
from grain_replay.device import resident as resident_module
from grain_replay.device import resident_programs
from grain_replay.device.converter import default_sharding
from grain_replay.device.lines import Probe, RowLayout
from grain_replay.device.resident_store import load_store

N, BATCH = 203, 16
_compile_s = collections.Counter()


def _listen(event: str, duration: float, **_: Any) -> None:
    if event.startswith("/jax/core/compile/"):
        _compile_s["s"] += duration


jax.monitoring.register_event_duration_secs_listener(_listen)


def _store(root: str) -> str:
    rng = np.random.default_rng(7)
    path = os.path.join(root, "store")
    gr.write(
        path,
        {
            "id": np.arange(N, dtype=np.int64),
            "obs": {
                "pixels": rng.integers(0, 256, (N, 4, 3), dtype=np.uint8),
                "vec": rng.standard_normal((N, 5)),
            },
            "reward": rng.standard_normal(N).astype(np.float32),
            "done": rng.random(N) < 0.3,
        },
        format="npy",
    )
    return path


class _Counting:
    """A gather program, counting its calls and the arrays it returns."""

    def __init__(self, program: Any, counts: collections.Counter[str]) -> None:
        self.program, self.counts = program, counts

    def __call__(self, *args: Any) -> Any:
        out = self.program(*args)
        self.counts["calls"] += 1
        self.counts["outputs"] += len(jax.tree.leaves(out))
        return out


@contextlib.contextmanager
def _counting(counts: collections.Counter[str]) -> Iterator[None]:
    """Resident iterators made inside count their jax calls (gathers dispatched, id arrays
    made) and the arrays the gathers return."""
    real = resident_programs.gather_program
    real_ids = resident_module.ResidentReplayIterator._ids_block

    def ids_block(self: Any, block: Any) -> Any:
        counts["calls"] += 1
        return real_ids(self, block)

    resident_module.gather_program = lambda *a, **k: _Counting(real(*a, **k), counts)
    resident_module.ResidentReplayIterator._ids_block = ids_block  # type: ignore[method-assign]
    try:
        yield
    finally:
        resident_module.gather_program = real
        resident_module.ResidentReplayIterator._ids_block = real_ids  # type: ignore[method-assign]


def _iterator(loader: Any) -> tuple[Any, float, float]:
    """A resident iterator, its first batch: (iterator, seconds, compile seconds)."""
    _compile_s.clear()
    t = time.perf_counter()
    it = gr.sharded_device_put(loader, resident=True)
    jax.block_until_ready(next(it))
    return it, time.perf_counter() - t, _compile_s["s"]


def _per_batch(loader: Any, repeats: int, keep: bool) -> tuple[float, float, float]:
    """Host us a batch of next() after the first (its program compiled), and the jax calls
    and gathered arrays a batch handed out (all batches); ``keep``: programs kept."""
    times, calls, outputs = [], [], []
    kept = resident_programs._KEPT
    resident_programs._KEPT = kept if keep else 0
    resident_programs.clear()
    try:
        for _ in range(repeats):
            counts = collections.Counter[str]()
            with _counting(counts):
                it, _, _ = _iterator(loader)
                steps, t, last = 1, time.perf_counter(), None
                for batch in it:
                    steps, last = steps + 1, batch
                jax.block_until_ready(last)
                times.append((time.perf_counter() - t) / (steps - 1))
            calls.append(counts["calls"] / steps)
            outputs.append(counts["outputs"] / steps)
            it.close()
    finally:
        resident_programs._KEPT = kept
    return statistics.median(times) * 1e6, statistics.median(calls), statistics.median(outputs)


def _iterators(path: str, window: int, repeats: int) -> dict[str, Any]:
    resident_module._MAX_WINDOW = window
    src = gr.open_source(path)
    loader = gr.make_data_loader(src, batch_size=BATCH, num_epochs=8, seed=1)
    row: dict[str, Any] = {"window": window}
    kept = resident_programs._KEPT
    resident_programs._KEPT = 0  # before: every iterator builds its own programs
    resident_programs.clear()
    try:
        runs = [_iterator(loader)[1:] for _ in range(repeats)]
    finally:
        resident_programs._KEPT = kept
    row["before_s"] = statistics.median(r[0] for r in runs)
    row["before_compile_s"] = statistics.median(r[1] for r in runs)
    resident_programs.clear()
    row["cold_s"], row["cold_compile_s"] = _iterator(loader)[1:]
    runs = [_iterator(loader)[1:] for _ in range(repeats)]
    row["kept_s"] = statistics.median(r[0] for r in runs)
    row["kept_compile_s"] = statistics.median(r[1] for r in runs)
    longer = gr.make_data_loader(src, batch_size=BATCH, num_epochs=64, seed=1)
    for when, keep in (("before", False), ("after", True)):
        us, calls, outputs = _per_batch(longer, repeats, keep)
        row[f"{when}_per_batch_us"] = us
        row[f"{when}_calls"] = calls
        row[f"{when}_outputs"] = outputs
    return row


def _programs(path: str, window: int, repeats: int) -> list[dict[str, Any]]:
    src = gr.open_source(path)
    probe = Probe(src)
    layout = RowLayout(probe, len(src))
    sharding = default_sharding()
    mesh, axis = sharding.mesh, sharding.spec[0]
    store = load_store(src, layout, NamedSharding(mesh, PartitionSpec()), False, 64 << 20)
    drawn = np.random.default_rng(0).integers(0, len(src), (window, BATCH)).astype(np.int32)
    ids = jax.device_put(drawn, NamedSharding(mesh, PartitionSpec(None, axis)))

    def unroll(store: Any, ids: Any) -> Any:
        return tuple(layout.gather(store, ids[k]) for k in range(ids.shape[0]))

    def flat(store: Any, ids: Any) -> Any:
        w, b = ids.shape
        leaves = [x.reshape(w, b, *x.shape[1:]) for x in layout.gather(store, ids.reshape(-1))]
        return tuple([x[k] for x in leaves] for k in range(w))

    def lmap(store: Any, ids: Any) -> Any:
        leaves = jax.lax.map(lambda i: layout.gather(store, i), ids)
        return tuple([x[k] for x in leaves] for k in range(ids.shape[0]))

    def build(fn: Any) -> Any:  # a new function object each time: jax compiles it again
        return jax.jit(
            jax.shard_map(
                lambda s, i: fn(s, i),
                mesh=mesh,
                in_specs=(PartitionSpec(), PartitionSpec(None, axis)),
                out_specs=PartitionSpec(axis),
            ),
            out_shardings=sharding,
        )

    want = jax.tree.map(np.asarray, build(unroll)(store, ids))
    rows = []
    for name, fn in (("unroll", unroll), ("flat", flat), ("map", lmap)):
        compiles = []
        for _ in range(repeats):
            t = time.perf_counter()
            program = build(fn).lower(store, ids).compile()
            compiles.append(time.perf_counter() - t)
        got = program(store, ids)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)  # the same batches
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(20):
                out = program(store, ids)
                for leaves in out:
                    jax.tree_util.tree_unflatten(probe.treedef, leaves)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t) / (20 * window))
        memory = program.memory_analysis()
        rows.append(
            {
                "window": window,
                "program": name,
                "compile_s": statistics.median(compiles),
                "per_batch_us": statistics.median(times) * 1e6,
                "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
                "output_bytes": getattr(memory, "output_size_in_bytes", None),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", default="8,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",")]
    result: dict[str, Any] = {
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "repeats": args.repeats,
        "iterators": [],
        "programs": [],
    }
    with tempfile.TemporaryDirectory() as root:
        path = _store(root)
        for w in windows:
            result["iterators"].append(_iterators(path, w, args.repeats))
        for w in windows:
            result["programs"].extend(_programs(path, w, args.repeats))
    print(f"devices: {result['devices']}; medians of {args.repeats}")
    print(
        "| window | before: build+first s (compile s) | after: cold s | after: kept s "
        "(compile s) | per batch us before / after | jax calls a batch before / after | "
        "arrays a batch before / after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in result["iterators"]:
        print(
            f"| {r['window']} | {r['before_s']:.2f} ({r['before_compile_s']:.2f}) | "
            f"{r['cold_s']:.2f} | {r['kept_s']:.3f} ({r['kept_compile_s']:.3f}) | "
            f"{r['before_per_batch_us']:.0f} / {r['after_per_batch_us']:.0f} | "
            f"{r['before_calls']:.3f} / {r['after_calls']:.3f} | "
            f"{r['before_outputs']:.2f} / {r['after_outputs']:.2f} |"
        )
    print("| window | program | compile s | per batch us | temp bytes | output bytes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in result["programs"]:
        print(
            f"| {r['window']} | {r['program']} | {r['compile_s']:.2f} | "
            f"{r['per_batch_us']:.0f} | {r['temp_bytes']} | {r['output_bytes']} |"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
