"""grain-replay stats, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

import grain_replay as gr
from grain_replay.cli import main


def _store(tmp_path: Any) -> str:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 3)).astype(np.float32)
    x[3, 2] = np.nan
    return gr.write(
        str(tmp_path / "s.h5"),
        {"obs": x, "action": rng.integers(0, 4, 500), "done": np.arange(500) % 50 == 49},
    )


def test_stats_json_equals_compute_stats_with_nan_as_null(tmp_path: Any, capsys: Any) -> None:
    path = _store(tmp_path)
    assert main(["stats", path, "--json", "--quantiles", "0.01", "0.99"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_records"] == 500 and list(out["leaves"]) == ["obs", "action", "done"]
    want = gr.compute_stats(path, quantiles=[0.01, 0.99])
    obs = out["leaves"]["obs"]
    assert sorted(obs) == sorted(["count", "mean", "std", "min", "max", "q01", "q99"])
    np.testing.assert_allclose(obs["mean"][:2], want["obs"]["mean"][:2], rtol=1e-15)
    assert obs["mean"][2] is None and obs["q99"][2] is None  # the NaN column
    assert out["leaves"]["action"]["max"] == 3 and out["leaves"]["done"]["max"] is True


def test_stats_text_lists_every_leaf_and_keys_select(tmp_path: Any, capsys: Any) -> None:
    path = _store(tmp_path)
    assert main(["stats", path, "--quiet", "--keys", "action", "--no-cache"]) == 0
    text = capsys.readouterr().out
    assert "500 records" in text and "action  int64 ()" in text and "obs" not in text
    assert "q50" in text
    assert not os.path.exists(path + ".stats.npz")


def test_stats_shows_a_progress_bar_on_stderr(tmp_path: Any) -> None:
    path = _store(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "grain_replay.cli", "stats", path],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "stats" in proc.stderr and "500/500" in proc.stderr
    assert "std" in proc.stdout


def test_stats_of_a_missing_store_is_an_error(tmp_path: Any, capsys: Any) -> None:
    assert main(["stats", str(tmp_path / "nope.h5")]) == 2
    assert "nope.h5" in capsys.readouterr().err
