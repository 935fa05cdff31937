"""Smoke test of ``benchmarks/bench_rlds.py --index-only`` at toy size: it runs without
TensorFlow, drops the shards' pages (checked with mincore) and prints both ratios, for
the Python parser and the compiled scan. Timings are not asserted (shared machines)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def test_bench_rlds_index_only_prints_disk_and_page_cache_ratios(tmp_path: Any) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    args = ["--index-only", "--episodes", "6", "--length", "4", "--shards", "2"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_rlds.py"), *args,
         "--repeats", "1", "--keep", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "at most 0.0% of pages resident after a drop" in out, out
    for where in ("disk", "page cache"):
        assert f"sequential read ({where}):" in out, out
        for parser in ("python", "compiled"):
            line = f"index build ({parser}, {where})"
            assert re.search(re.escape(line) + r" \d+ MB/s: \d+\.\d\dx the sequential", out), out
    # The dataset the bench wrote opens and holds the steps asked for.
    import grain_replay as gr

    assert len(gr.RLDSDataSource(str(tmp_path / "index_only"), progress=False)) == 24
