"""Smoke test of benchmarks/bench_device_replay.py at toy size: it runs and prints a ratio per
workload and sampling. Timings are not asserted (shared CI machines are noise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_device_replay_prints_ratios_for_both_workloads() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("JAX_PLATFORMS", "cpu")
    args = ["--quick", "--rows", "2000", "--frames", "64", "--batch", "16"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_device_replay.py"), *args,
         "--steps", "2", "--repeats", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:-1]}
    assert set(rows) == {"mlp", "conv"}, proc.stdout
    for cells in rows.values():
        ratios = [float(cells[5]), float(cells[7])]
        assert all(r > 0 for r in ratios), proc.stdout
    assert "ratio: steps/s with sampling" in proc.stdout
