"""The sampling examples (per_dqn_cartpole, offline_to_online), each run at toy size."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from repo_scripts import load_example

pytest.importorskip("gymnasium")


def test_per_dqn_cartpole_learns_from_a_growing_store(tmp_path: Path) -> None:
    store = tmp_path / "replay"
    argv = "--steps 400 --warmup 150 --flush-every 20 --refresh-every 5 --batch-size 32"
    result = load_example("per_dqn_cartpole").main([*argv.split(), "--store", str(store)])
    assert result["rows"] == 400  # every step committed, read while it grew
    assert result["episodes"] > 5
    assert math.isfinite(result["mean_abs_td"]) and result["mean_abs_td"] > 0


def test_offline_to_online_anneals_exact_shares(tmp_path: Path) -> None:
    argv = (
        "--offline-rows 600 --offline-steps 60 --online-steps 150 --anneal-steps 80 "
        "--batch-size 32 --flush-every 10"
    )
    result = load_example("offline_to_online").main([*argv.split(), "--dir", str(tmp_path)])
    assert result["exact_counts"]
    assert result["first_online_share"] == 0.0
    assert result["final_online_share"] == 0.75  # 24 of 32 rows
    assert result["online_rows"] >= 150
