"""Smoke test of benchmarks/bench_device_writes.py at toy size: run() gives every row, with a
ratio and its target. Timings are not asserted (shared CI machines are noise)."""

from __future__ import annotations

import math

from repo_scripts import ROOT, load_script

BENCH = ROOT / "benchmarks" / "bench_device_writes.py"


def test_bench_device_writes_rows() -> None:
    module = load_script(BENCH, "bench_device_writes")
    memory: dict = {}
    rows = module.run(True, steps=6, repeats=1, envs=64, memory_steps=20, memory=memory)
    names = [r["name"] for r in rows]
    assert names[0].startswith("device writes: loop with writing / without (cpu")
    assert rows[0]["target"] == 0.85 and rows[0]["unit"] == "x"
    assert all(set(r) == {"name", "value", "target", "unit"} for r in rows)
    # memory_stats() is None on CPU devices: those two rows say None, not a number.
    in_use = [r for r in rows if r["name"].startswith("device bytes in use")]
    assert len(in_use) == 2 and all(r["value"] is None for r in in_use), in_use
    live = [r for r in rows if r["name"].startswith("live jax arrays before / after")]
    assert len(live) == 1 and live[0]["value"] == (
        memory["live_arrays_after"] - memory["live_arrays_before"]
    )
    assert memory["steps"] == 20 and memory["rows_live"] == 20 * 64
    assert memory["memory_stats_before"] is None and memory["memory_stats_after"] is None
    # Jax calls per append: the caller dispatches none (its checks are is_deleted, one a
    # leaf); the writer's thread reads each CPU leaf (np.asarray) once.
    calls = {
        r["name"].split(" (")[0].removeprefix("jax calls per device append, "): r["value"]
        for r in rows
        if r["name"].startswith("jax calls per device append")
    }
    assert calls == {"the caller's thread": 0, "the writer's threads": 5}, calls
    checks = [r for r in rows if r["name"].startswith("liveness checks per device append")]
    assert len(checks) == 1 and checks[0]["value"] == 5
    rest = [r for r in rows if r not in in_use and r not in live and r["unit"] != "calls"]
    assert all(r["value"] > 0 for r in rest if not math.isnan(r["value"])), rows
    assert [r["target"] for r in rows[1:]] == [None] * (len(rows) - 1)
    # The per-append profile behind a miss: each thread's CPU, the flush, the load.
    assert {
        "main thread's CPU time in a device append (check, queue)",
        "one flush() in the writing loop (100 steps of rows)",
        "1-min load average (highest seen)",
    } <= set(names)
    writer = [r for r in rows if r["name"].startswith("writer threads' CPU time per device")]
    assert len(writer) == 1 and writer[0]["value"] > 0 and writer[0]["unit"] == "us"
