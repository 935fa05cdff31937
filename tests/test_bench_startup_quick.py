"""Smoke test of the benchmarks' ``startup`` section: it runs, reports each case and the note.

The first-batch times are not asserted (shared CI machines are noise); see
benchmarks/bench_startup.py for what is measured.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_startup_section_reports_first_batch_seconds_and_worker_cpu(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("JAX_PLATFORMS", "cpu")
    args = ["--quick", "--sections", "startup", "--only", "npy/", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), *args, "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    section = json.loads((tmp_path / "results.json").read_text())["sections"]["startup"]
    names = {c["name"] for c in section["cases"]}
    assert names == {
        "startup/npy/worker_count=0",
        "startup/npy/worker_count=2",
        "startup/npy/UniformReplay/worker_count=2",
    }
    for case in section["cases"]:
        (seconds,) = case["repeat_s"]
        assert math.isfinite(seconds) and seconds > 0
    cpu = section["worker_start_cpu_s"]
    assert cpu["startup/npy/worker_count=0"] == 0.0
    assert cpu["startup/npy/worker_count=2"] > 0  # the workers' start-up was counted
    assert any("first batch with worker_count=2" in note for note in section["notes"])
