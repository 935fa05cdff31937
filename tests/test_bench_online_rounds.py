"""bench_online.py --sample-rounds: the PER case alone, ours and the peers interleaved."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _round(ours: float, torchrl: float | None) -> dict:
    peer = {"skipped": "no venv"} if torchrl is None else {"sample": {"samples_per_s": torchrl}}
    if torchrl is not None:
        peer["version"] = "0.14.1"
    return {"ours": {"samples_per_s": ours}, "torchrl": peer}


def test_summarize_rounds_takes_the_median_of_each_rounds_ratio() -> None:
    import bench_online

    each = [_round(300.0, 100.0), _round(100.0, 100.0), _round(800.0, 400.0)]
    s = bench_online.summarize_rounds(each, ["torchrl"])
    assert s["ours_samples_per_s"] == [300.0, 100.0, 800.0]
    assert s["torchrl"]["ratios"] == [3.0, 1.0, 2.0]
    assert s["torchrl"]["median_ratio"] == 2.0  # not 1200 / 600 of the sums
    assert s["torchrl"]["version"] == "0.14.1" and s["torchrl"]["skipped"] is None
    doc = {"summary": s, "loadavg_1min": [1.0, 2.0], "cpu_count": 2}
    row = bench_online.rounds_table(doc).splitlines()[2]
    assert "ours / torchrl | 2.00 | 3.00, 1.00, 2.00 | >= 3x" in row


def test_summarize_rounds_without_the_peer_says_why() -> None:
    import bench_online

    s = bench_online.summarize_rounds([_round(300.0, None)], ["torchrl"])
    assert s["torchrl"]["median_ratio"] is None and s["torchrl"]["skipped"] == "no venv"
    text = bench_online.rounds_table({"summary": s, "loadavg_1min": [1.0], "cpu_count": 2})
    assert "| - | - | >= 3x | - | no venv |" in text


@pytest.mark.slow
def test_sample_rounds_runs_ours_and_skips_a_missing_peer(tmp_path: Path) -> None:
    import bench_online

    out = tmp_path / "online"
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    argv = ["--quick", "--sample-rounds", "2", "--peers", "torchrl", "--torchrl-python", missing]
    assert bench_online.main([*argv, "--out", str(out)]) == 0
    doc = json.loads((out / "rounds.json").read_text())
    assert len(doc["rounds"]) == 2 and set(doc["summary"]) == {"ours_samples_per_s", "torchrl"}
    assert all(x > 0 for x in doc["summary"]["ours_samples_per_s"])
    assert "no venv at" in doc["summary"]["torchrl"]["skipped"]
    assert "ours / torchrl" in (out / "rounds.md").read_text()


class _Joined:
    def join(self, timeout: float | None = None) -> None:
        pass


class _Scripted:
    """The message queue of two writer processes, in a given order."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = list(messages)

    def __call__(self) -> dict[str, Any]:
        return self.messages.pop(0)


@pytest.mark.parametrize(
    "order",
    [
        ["filled0", "filled1", "done0", "done1"],
        ["filled0", "done0", "filled1", "done1"],  # writer 0 finished before 1 had filled
    ],
)
def test_writers_start_waits_for_every_fill_and_join_gets_every_result(order: list[str]) -> None:
    from bench_online_peers import Writers

    w = object.__new__(Writers)
    w.procs = [_Joined(), _Joined()]
    w.go, w.stop = threading.Event(), threading.Event()
    messages = {
        "filled0": {"filled": 0},
        "filled1": {"filled": 0},
        "done0": {"rows": 10, "s": 1.0},
        "done1": {"rows": 20, "s": 1.0},
    }
    w._get = _Scripted([messages[m] for m in order])  # type: ignore[method-assign]
    w.start()
    assert sorted(r["rows"] for r in w.join()) == [10, 20]
