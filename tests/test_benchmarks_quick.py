"""Smoke test of benchmarks/run.py --quick: it runs and reports every section and format.

Performance targets are not asserted here: timings on shared CI machines are noise.
The datasets and batches are smaller than --quick's own (the same code runs on fewer
records; batches of 16 still split over the 8 fake devices): the run is a smoke test of
every section and format, not a measurement. Batches of 16 halve the run (the conv step
and the per-record baselines scale with the batch); 2 timed repeats a case instead of 5
take another third off (the slow per-record baselines and the writes are timed one batch
a repeat), and still check that the repeats asked for are run and reported.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "run.py"
SECTIONS = ("formats", "pipeline", "cold", "write")
FORMATS = ("npy", "hdf5", "zarr")
TRANSITIONS, IMAGES, BATCH, REPEATS = 4000, 400, 16, 2
QUICK = (
    "--quick", "--transitions", str(TRANSITIONS), "--image-records", str(IMAGES),
    "--batch-size", str(BATCH), "--repeats", str(REPEATS),
)  # fmt: skip
LAYOUTS = (
    "npy",
    "hdf5",
    "zarr",
    "hdf5-gzip",
    "hdf5-lzf",
    "hdf5-chunked",
    "zarr-zstd",
    "zarr-native",
)


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["BENCH_ONLINE_PEERS"] = "0"  # Reverb and torchrl, when their venvs exist: not here
    # Resident replay's gather windows of 8 batches, not 64: that program compiles in a
    # fraction of the time (the default window: tests/device/test_resident.py).
    env["BENCH_RESIDENT_WINDOW"] = "8"
    proc = subprocess.run(
        [sys.executable, str(RUN), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench_quick")
    proc = _run(*QUICK, "--out", str(out))
    return out, proc.stdout


def test_quick_run_writes_results_for_every_section_and_format(quick_run: tuple[Path, str]):
    out, stdout = quick_run
    doc = json.loads((out / "results.json").read_text())
    assert set(SECTIONS) <= set(doc["sections"])
    for name in SECTIONS:
        section = doc["sections"][name]
        cases = section["cases"]
        assert cases, f"section {name} has no cases"
        for case in cases:
            assert _positive(case["records_per_s"]), case["name"]
            assert _positive(case["mb_per_s"]), case["name"]
            assert len(case["repeat_s"]) >= REPEATS, case["name"]
        formats = {c["fmt"] for c in cases}
        assert set(FORMATS) <= formats, f"section {name} lacks formats {set(FORMATS) - formats}"
        assert _positive(section["peak_rss_anon_mb"])
        assert section["ratios"], f"section {name} reports no ratios"
        for ratio in section["ratios"]:
            assert _positive(ratio["value"]), ratio["name"]
    names = {c["name"] for c in doc["sections"]["formats"]["cases"]}
    for dataset in ("transitions", "images"):
        for layout in LAYOUTS:
            assert f"formats/{dataset}/{layout}/read_batch" in names
        assert f"formats/{dataset}/memory/numpy-gather" in names
        assert f"formats/{dataset}/arrayrecord/getitems+decode" in names
    # A spawned grain pipeline over the importable baselines ran (--quick: 1 worker).
    assert "formats/transitions/arrayrecord/grain-arrayrecord-w1" in names
    # So did the loader's worker processes (--quick: for one format).
    pipeline = {c["name"] for c in doc["sections"]["pipeline"]["cases"]}
    workers = ("full-1-worker", "make_data_loader-2-workers", "grain-worker-iterator-2-workers")
    for method in workers:
        assert f"pipeline/transitions/npy/{method}" in pipeline, sorted(pipeline)
    # A quick run reports its ratios and the full-size targets without judging them.
    assert doc["targets"]["judged"] is False and doc["targets"]["count"] > 0
    assert doc["targets"]["passed"] == doc["targets"]["failed"] == 0
    assert all(t["passed"] is None and t["target"] > 0 for t in doc["targets"]["list"])
    assert "| ratio | value | full-size target |" in stdout
    assert not [line for line in stdout.splitlines() if "PASS" in line or "FAIL" in line]
    assert "not judged" in stdout
    # The headline: each workload against the peer a user would pick, and against the limit.
    workloads = {row["workload"]: row for row in doc["headline"]}
    row = workloads["transitions, random batches (.npy)"]
    assert "arrayrecord" in row["vs_peer"]["den"] and "numpy-gather" in row["vs_limit"]["den"]
    assert len(workloads) >= 8
    assert "## at a glance" in stdout


def test_quick_run_reports_device_section(quick_run: tuple[Path, str]):
    out, _ = quick_run
    section = json.loads((out / "results.json").read_text())["sections"]["device"]
    methods = {(c["dataset"], c["method"]) for c in section["cases"]}
    for ds in ("transitions", "images"):
        for m in ("device_put-pageable", "sharded_device_put(loader)", "step-on-device-batches"):
            assert (ds, m) in methods, (ds, m)
    assert ("transitions", "sharded_device_put(loader, resident)") in methods
    assert all(_positive(c["records_per_s"]) for c in section["cases"])
    names = [r["name"] for r in section["ratios"]]
    assert any("resident / host pipeline" in n for n in names)
    assert set(section["input_fraction"]) == {"transitions", "images"}
    assert any("BENCH_RESIDENT_WINDOW" in note for note in section["notes"])


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_quick_run_draws_the_headline_then_the_detail(quick_run: tuple[Path, str]):
    out, _ = quick_run
    png, detail = out / "plot.png", out / "plot_detail.png"
    assert png.stat().st_size > 1000 and detail.stat().st_size > 1000
    width, height = _png_size(png)
    assert width <= 1400 and height <= 1400, (width, height)  # one screen, not a column
    assert _png_size(detail)[1] > height  # every ratio, after the headline


def test_only_and_sections_filter_and_reuse_the_data(quick_run: tuple[Path, str], tmp_path: Path):
    out, _ = quick_run
    proc = _run(
        *QUICK,
        "--out",
        str(tmp_path),
        "--data",
        str(out / "data"),
        "--sections",
        "write",
        "--only",
        "hdf5-lzf",
    )
    # Datasets are reused, not rewritten. (Only the stores written by other libraries
    # are checked: gr.write's stores are rewritten whenever grain_replay's writer
    # code changes, which may happen between the two runs while it is being edited.)
    assert f"wrote transitions-{TRANSITIONS}/hdf5-gzip.h5" not in proc.stdout
    assert f"wrote images-{IMAGES}/zarr-zstd.zarr" not in proc.stdout
    doc = json.loads((tmp_path / "results.json").read_text())
    reused = doc["meta"]["stores"]["transitions"]["hdf5-gzip"]["path"]
    assert reused.endswith(f"transitions-{TRANSITIONS}/hdf5-gzip.h5")  # the sizes the run named
    assert reused.startswith(str(out / "data"))
    assert list(doc["sections"]) == ["write"]
    sources = [c for c in doc["sections"]["write"]["cases"] if c["kind"] == "source"]
    assert sources and all(c["layout"] == "hdf5-lzf" for c in sources)
    assert (tmp_path / "plot.png").exists()


def test_quick_run_reports_online_section_without_peers(quick_run: tuple[Path, str]):
    out, _ = quick_run
    section = json.loads((out / "results.json").read_text())["sections"]["online"]
    doc = section["online"]
    inserts = {(r["where"], r["writers"]): r for r in doc["ours"]["inserts"]}
    assert set(inserts) == {("disk", 1), ("disk", 2)}
    for row in inserts.values():
        assert row["rows"] == row["writers"] * 4096 and _positive(row["rows_per_s"])
    sample = doc["ours"]["sample"]
    assert _positive(sample["samples_per_s"]) and sample["inserted_while_sampling"] > 0
    assert sample["rows_at_end"] > sample["rows_at_start"] >= 4096  # the writers kept writing
    latency = doc["ours"]["latency"]
    assert latency["measured"] == latency["commits"] == 15
    assert latency["min_ms"] <= latency["median_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    ratios = {r["name"]: r for r in section["ratios"]}
    ours = [n for n in ratios if not n.startswith("online: bench_")]
    assert ours == [
        "online: commit -> sampleable: 20 ms / median",
        "online: commit -> sampleable: 200 ms / p99",
    ]
    assert all(ratios[n]["target"] == 1.0 and _positive(ratios[n]["value"]) for n in ours)
    # The other helpers' benches (limiter accuracy, device writes) run when in the tree.
    for name in ("bench_rate_limit", "bench_device_writes"):
        if (ROOT / "benchmarks" / f"{name}.py").exists():
            assert isinstance(doc["others"][name], list) and doc["others"][name]
        else:
            assert doc["others"][name] == {"skipped": f"benchmarks/{name}.py is not in this tree"}
    # The peers are named as not run, each comparison with its target.
    assert doc["peers"] == {
        "reverb": {"skipped": "peers not asked for"},
        "torchrl": {"skipped": "peers not asked for"},
    }
    notes = "\n".join(section["notes"])
    assert "inserts, 1 writer, ours / reverb: not measured (peers not asked for)" in notes
    assert "PER sample+read 256 while 2 writers insert, ours / torchrl: not measured" in notes
    assert "1-min load average" in notes
