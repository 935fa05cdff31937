"""Smoke test of benchmarks/bench_replay_store.py: a chosen case runs and reports its ratios.

Timings are not asserted (shared machines); the store is smaller than --quick's own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_replay_store.py"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eviction_case_alone_reports_both_ratios(tmp_path: Path) -> None:
    proc = _bench("--quick", "--live", "2000", "--cases", "eviction", "--repeats", "2",
                  "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "prioritized sample+read+update after 10x capacity: bounded" in proc.stdout
    out = json.loads((tmp_path / "replay_store.json").read_text())
    assert set(out) == {"eviction"}
    ev = out["eviction"]
    assert ev["live_rows"] == 2000 and ev["inserted_rows"] == 20_000
    for key in ("uniform_ratio", "prioritized_ratio", "disk_ratio"):
        assert math.isfinite(ev[key]) and ev[key] > 0, key


def test_an_unknown_case_is_refused_naming_the_choices() -> None:
    proc = _bench("--quick", "--cases", "eviction,nope")
    assert proc.returncode == 2
    assert "unknown ['nope']" in proc.stderr and "'refresh'" in proc.stderr
