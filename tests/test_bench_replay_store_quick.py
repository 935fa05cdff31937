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

import pytest

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


def test_writers_case_reports_ratio_and_phases(tmp_path: Path) -> None:
    proc = _bench("--quick", "--cases", "writers", "--writer-rows", "3000", "--repeats", "1",
                  "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "writers (flush every 1,000 rows, 3,000 rows each, median of 1)" in proc.stdout
    out = json.loads((tmp_path / "replay_store.json").read_text())["writers"]
    assert out["rows_per_writer"] == 3000 and out["repeats"] == 1
    assert math.isfinite(out["ratio"]) and out["ratio"] > 0
    for side in ("one", "two"):
        phases = out[f"{side}_phases_s"]
        assert set(phases) == {"startup", "loop", "append", "flush", "close", "to_last_commit"}
        assert 0 < phases["append"] <= phases["loop"] and 0 < phases["flush"] <= phases["loop"]


def test_writer_rows_not_a_multiple_of_1000_is_refused() -> None:
    proc = _bench("--quick", "--cases", "writers", "--writer-rows", "1500")
    assert proc.returncode == 2
    assert "--writer-rows must be a positive multiple of 1000, got 1500" in proc.stderr


def test_an_unknown_case_is_refused_naming_the_choices() -> None:
    proc = _bench("--quick", "--cases", "eviction,nope")
    assert proc.returncode == 2
    assert "unknown ['nope']" in proc.stderr and "'refresh'" in proc.stderr


def test_s3_store_quick_reports_each_case_beside_the_disk(tmp_path: Path) -> None:
    """``--store s3 --quick``: writers, latency, sample and the server alone, each printed
    and in replay_store_s3.json (skipped without moto)."""
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from s3_server import moto_unavailable_reason

    reason = moto_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    proc = _bench("--store", "s3", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for line in ("1 writer(s): s3 ", "2 writer(s): s3 ", "commit -> sampleable",
                 "s3 / disk (medians):", "uniform sample+read, batch 256, 5,000 rows, warm: s3",
                 "GETs a batch", "the S3 server alone", "2 client(s): "):  # fmt: skip
        assert line in proc.stdout, (line, proc.stdout[-3000:])
    out = json.loads((tmp_path / "replay_store_s3.json").read_text())
    assert set(out) == {"writers", "latency", "sample", "server", "server_share_used"}
    wr = out["writers"]
    assert set(wr["s3_rows_per_s"]) == set(wr["disk_rows_per_s"]) == {"1", "2"}
    assert wr["s3_ratio_over_1"]["1"] == wr["disk_ratio_over_1"]["1"] == 1.0
    for value in (*wr["s3_over_disk"].values(), out["latency"]["median_ratio"],
                  out["sample"]["ratio"], *out["server"]["requests_per_s"].values()):  # fmt: skip
        assert math.isfinite(value) and value > 0
    for side in ("s3", "disk"):
        lat = out["latency"][side]
        assert lat["commits"] == 3 and lat["p99_ms"] >= lat["median_ms"]
    assert out["sample"]["gets_per_batch"] == 0  # warm: every piece is in the reader's cache
    assert wr["s3_requests_per_flush"]["PUT"] >= 2  # the piece, the manifest version (+ lease)
    assert math.isfinite(out["server_share_used"]) and out["server_share_used"] > 0
    assert "writers' requests/s / the most the server answered alone" in proc.stdout


def test_a_disk_case_under_store_s3_is_refused_naming_the_choices() -> None:
    proc = _bench("--store", "s3", "--quick", "--cases", "eviction")
    assert proc.returncode == 2
    assert "unknown ['eviction']" in proc.stderr and "'latency'" in proc.stderr
