"""Smoke test of benchmarks/bench_device_writes.py at toy size: run() gives every row, with a
ratio and its target. Timings are not asserted (shared CI machines are noise)."""

from __future__ import annotations

import math

from repo_scripts import ROOT, load_script

BENCH = ROOT / "benchmarks" / "bench_device_writes.py"


def test_bench_device_writes_rows() -> None:
    module = load_script(BENCH, "bench_device_writes")
    rows = module.run(True, steps=6, repeats=1, envs=64)
    names = [r["name"] for r in rows]
    assert names[0].startswith("device writes: loop with writing / without (cpu")
    assert rows[0]["target"] == 0.85 and rows[0]["unit"] == "x"
    assert all(set(r) == {"name", "value", "target", "unit"} for r in rows)
    assert all(r["value"] > 0 for r in rows if not math.isnan(r["value"])), rows
    assert [r["target"] for r in rows[1:]] == [None] * (len(rows) - 1)
    # The per-append profile behind a miss: each thread's CPU, the flush, the load.
    assert {
        "main thread's CPU time in a device append (check, queue)",
        "one flush() in the writing loop (100 steps of rows)",
        "1-min load average (highest seen)",
    } <= set(names)
    writer = [r for r in rows if r["name"].startswith("writer threads' CPU time per device")]
    assert len(writer) == 1 and writer[0]["value"] > 0 and writer[0]["unit"] == "us"
