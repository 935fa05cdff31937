"""Smoke test of benchmarks/bench_feed.py at toy size: it runs both workloads and prints the
fed case's ratio against min(step, link). Timings are not asserted (shared CI machines are
noise); a benchmark that no longer runs is what this catches (it once passed numpy's
parameter draws a jax key and failed on the accelerator host only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_feed_runs_both_workloads_and_writes_their_ratios(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("JAX_PLATFORMS", "cpu")
    out = tmp_path / "feed.json"
    args = ["--quick", "--rows", "1000", "--frames", "200", "--repeats", "1", "--seconds", "0.05"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_feed.py"), *args,
         "--cases", "fed-w0-default$", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("bound min(step, link)") == 2, proc.stdout
    result = json.loads(out.read_text())
    for name in ("mlp", "conv"):
        # the ratio's bound is timed whatever --cases asks: the step and the link's puts
        assert set(result[name]["rates"]) == {
            "step",
            "put-plain-1",
            "put-plain-4",
            "put-flat-u8-4",
            "fed-w0-default",
        }, result[name]
        assert result[name]["link"] == max(
            result[name]["rates"][c] for c in ("put-plain-1", "put-plain-4", "put-flat-u8-4")
        )
        assert result[name]["ratios"]["fed-w0-default"] > 0
