"""Smoke test of benchmarks/bench_rate_limit.py at toy size: both directions finish, on ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.slow
def test_bench_rate_limit_runs_both_directions_on_ratio() -> None:
    import bench_rate_limit

    rows = bench_rate_limit.run(
        quick=True, inserts=50_000
    )  # tolerance 2,000 rows: +2.5 % at the end
    assert [r["name"] for r in rows] == ["rate_limit_fast_writer", "rate_limit_fast_learner"]
    for r in rows:
        assert not r["deadlock"] and r["within_5pct"], r
        assert r["max_above_ceiling_rows"] == 0, r
        assert r["inserts"] > 45_000
