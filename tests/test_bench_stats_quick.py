"""Smoke test of benchmarks/bench_stats.py and bench_minari_jpeg.py at toy size: they run and
print every row. Timings are not asserted (shared CI machines are noise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_bench_stats_prints_a_ratio_per_layout(tmp_path: Any) -> None:
    out = _run("bench_stats.py", "--records", "3000", "--repeats", "1", "--out", str(tmp_path))
    rows = [line.split()[0] for line in out.splitlines()[2:-1]]
    assert rows == ["npy", "hdf5", "hdf5-gzip", "zarr"], out
    assert "target >= 0.7" in out


def test_bench_minari_jpeg_prints_the_decode_rate_per_format() -> None:
    pytest.importorskip("minari")
    pytest.importorskip("pyarrow")
    pytest.importorskip("PIL")
    out = _run("bench_minari_jpeg.py", "--steps", "60", "--batch", "16", "--repeats", "1")
    rows = [line.split()[0] for line in out.splitlines()[2:-1]]
    assert rows == ["hdf5", "arrow"], out
