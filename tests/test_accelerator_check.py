"""benchmarks/accelerator_check.sh (issue 41's accelerator run) and its summary, on this CPU.

- The summary (``benchmarks/accelerator_summary.py``) on fixture JSON files shaped as the
  benchmarks write them (the device section's through ``bench_report.write_json`` itself):
  every target gets a row, judged only on an accelerator, a missing result says why, a
  malformed file is named with a fix.
- The script's dry run: which carried wheels it installs, keeps, skips or refuses, and the
  plan it prints (the steps in order, one process at a time, the PYTHONPATH order).
- Real runs (slow; need ``make accelerator-wheels``): without ``--cpu`` on this machine it
  stops before any benchmark (no accelerator); a benchmark past ``--timeout`` is stopped
  and its rows say so; and the whole path, the carried wheels installed beside this venv's
  packages, every benchmark on CPU at toy sizes, the table printed.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import accelerator_summary as summary  # noqa: E402
from bench_common import Case, SectionResult  # noqa: E402
from bench_report import write_json  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "accelerator_check.sh"
OLD_SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
WHEELS = ROOT / ".accelerator-wheels"

# -- the summary on fixtures ------------------------------------------------------------------


def _feed(backend: str, ratios: dict[str, dict[str, float]]) -> dict[str, Any]:
    """bench_feed.py --out: per workload rates, ratios of the fed cases, link and bound."""
    doc: dict[str, Any] = {"backend": backend, "jax": "0.10.2"}
    for name, r in ratios.items():
        rates = {"step": 1000.0, "put-plain-1": 2000.0, "loader-w0": 5000.0}
        rates.update({c: 1000.0 * v for c, v in r.items()})
        doc[name] = {"batch_bytes": 134400, "rates": rates, "link": 2000.0, "bound": 1000.0,
                     "ratios": dict(r)}  # fmt: skip
    return doc


def _replay(backend: str, uniform: float, prioritized: float) -> dict[str, Any]:
    """bench_device_replay.py --out: rates per workload, flashbax under peers."""
    rates = {"bare": 100.0, "uniform": 100.0 * uniform, "prioritized": 100.0 * prioritized}
    return {
        "backend": backend,
        "batch": 256,
        "workloads": {w: {"name": w, "rates": dict(rates)} for w in ("mlp", "conv")},
        "peers": {"mlp": {"rates": {"uniform": 20.0, "prioritized": 10.0}, "version": "0.1.3"}},
    }


def _writes(backend: str, ratio: float) -> dict[str, Any]:
    """bench_device_writes.py --out: its rows, the first the ratio with / without."""
    rows = [
        {"name": f"device writes: loop with writing / without ({backend}, 1024 envs, ...)",
         "value": ratio, "target": 0.95, "unit": "x"},
        {"name": "device_actor loop without writing", "value": 2000.0, "target": None,
         "unit": "steps/s"},
        {"name": "device_actor loop with writing", "value": 2000.0 * ratio, "target": None,
         "unit": "steps/s"},
        {"name": "one flush(wait=False) in the writing loop (the caller's time)", "value": None,
         "target": None, "unit": "ms"},
    ]  # fmt: skip
    return {"backend": backend, "jax": "0.10.2", "rows": rows}


def _case(ds: str, method: str, ms: float) -> Case:
    return Case(f"device/{ds}/npy/{method}", "device", ds, "npy", "npy", method, "pipeline",
                256, 525, 100, [ms / 10, ms / 10, ms / 10])  # fmt: skip


def _device(out: Path, backend: str, resident: dict[str, float], skip: str = "") -> None:
    """run.py --sections device's results.json, written by bench_report.write_json."""
    res = SectionResult("device")
    res.extra["jax"] = {"backend": backend, "device_count": 1}
    for ds in ("transitions", "images"):
        if ds == skip:
            res.notes.append(f"{ds}: resident replay skipped: over budget")
            continue
        base = res.add(_case(ds, "step-on-device-batches", 1.0))
        fed = res.add(_case(ds, "step-fed-by-resident", 1.0 / resident[ds]))
        res.ratio(f"device/{ds}: step-fed-by-resident / step on device batches "
                  "(1 - input fraction)", fed, base, None, "step")  # fmt: skip
        if ds == "images":  # the ceiling case beside it (bench_device's window of copies)
            top = res.add(_case(ds, "step-fed-by-window-copies", 1.0 / 0.97))
            res.ratio(f"device/{ds}: step-fed-by-window-copies / step on device batches "
                      "(1 - input fraction)", top, base, None, "step")  # fmt: skip
    res.extra["gpu_targets"] = [
        {"name": "device/images: sharded_device_put(loader) / bare pinned put", "value": 0.5,
         "target": 0.8, "judged": backend != "cpu", "passed": None},
    ]  # fmt: skip
    (out / "device").mkdir()
    write_json(str(out / "device" / "results.json"), [res], {"mode": "full"})


def _fixtures(out: Path, backend: str = "tpu") -> Path:
    """Every file, on ``backend``; the ratios straddle their targets (the edges pass)."""
    out.mkdir(exist_ok=True)
    feed = _feed(backend, {
        "mlp": {"fed-w0-default": 0.9, "fed-w4-default": 0.95, "fed-w0-before": 0.2},
        "conv": {"fed-w0-default": 0.89, "fed-w4-default": 1.1},
    })  # fmt: skip
    (out / "feed.json").write_text(json.dumps(feed))
    (out / "device_replay.json").write_text(json.dumps(_replay(backend, 0.97, 0.68)))
    (out / "device_writes.json").write_text(json.dumps(_writes(backend, 0.93)))
    _device(out, backend, {"transitions": 0.96, "images": 0.5})
    (out / "runs.tsv").write_text("".join(
        f"{n}\t0\t{s}\n" for n, s in (("bench_feed", 60), ("bench_device_replay", 30),
                                     ("bench_device_writes", 20), ("device_section", 90))
    ))  # fmt: skip
    return out


def _table(text: str) -> dict[str, list[str]]:
    """target -> [issue, ratio, needs, measured, verdict] of each row of the markdown table."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| #"):
            issue, target, *rest = [c.strip() for c in line.strip("|").split(" | ")]
            rows[target] = [issue, *rest]
    return rows


FEED_ROWS = [f"host-fed step / min(step, link): {w}, worker_count {k}"
             for w in ("mlp", "conv") for k in (0, 4)]  # fmt: skip
REPLAY_ROWS = [f"DeviceReplay {m} in the step / bare step: {w}"
               for m in ("uniform", "prioritized") for w in ("mlp", "conv")]  # fmt: skip
RESIDENT_ROWS = [f"step fed by resident replay / step on device batches: {w}"
                 for w in ("mlp", "conv")]  # fmt: skip
WRITES_ROW = "device_actor loop with writing / without"
ISSUE_41 = [*FEED_ROWS, *REPLAY_ROWS, *RESIDENT_ROWS, WRITES_ROW]


def test_every_target_is_judged_on_an_accelerator(tmp_path: Path, capsys: Any) -> None:
    out = _fixtures(tmp_path / "out")
    md = tmp_path / "summary.md"
    assert summary.main([str(out), "--backend", "tpu", "--md", str(md)]) == 0
    text = capsys.readouterr().out
    assert md.read_text() == text and "backend tpu" in text
    rows = _table(text)
    assert list(rows)[: len(ISSUE_41)] == ISSUE_41  # in this order, each once, then #17's
    assert {rows[t][0] for t in list(rows)[len(ISSUE_41) :]} == {"#17"}
    verdicts = {t: (rows[t][1], rows[t][2], rows[t][4]) for t in ISSUE_41}
    assert verdicts == {
        FEED_ROWS[0]: ("0.900", ">= 0.9", "PASS"),  # exactly the target passes
        FEED_ROWS[1]: ("0.950", ">= 0.9", "PASS"),
        FEED_ROWS[2]: ("0.890", ">= 0.9", "FAIL"),
        FEED_ROWS[3]: ("1.100", ">= 0.9", "PASS"),
        REPLAY_ROWS[0]: ("0.970", ">= 0.97", "PASS"),
        REPLAY_ROWS[1]: ("0.970", ">= 0.97", "PASS"),
        REPLAY_ROWS[2]: ("0.680", ">= 0.9", "FAIL"),
        REPLAY_ROWS[3]: ("0.680", ">= 0.9", "FAIL"),
        RESIDENT_ROWS[0]: ("0.960", ">= 0.95", "PASS"),
        RESIDENT_ROWS[1]: ("0.500", ">= 0.95", "FAIL"),
        WRITES_ROW: ("0.930", ">= 0.9", "PASS"),
    }
    # What each ratio is made of, and flashbax beside ours.
    assert rows[FEED_ROWS[0]][3] == "fed 900.0/s; step 1000.0/s, link 2000.0/s"
    assert rows[REPLAY_ROWS[0]][3] == (
        "97.0 vs bare 100.0 steps/s; flashbax 20.0/s (ours/theirs 4.85)"
    )
    assert rows[RESIDENT_ROWS[1]][3] == (
        "2 ms/step fed, 1 on device batches; ceiling (a window of copies, no gather) 0.970"
    )
    assert rows[RESIDENT_ROWS[0]][3] == "1.04 ms/step fed, 1 on device batches"  # no ceiling
    assert rows[WRITES_ROW][3] == "1860 vs 2000 steps/s"
    # The device section's own GPU target (issue 17), judged the same way.
    pinned = rows["device section: device/images: sharded_device_put(loader) / bare pinned put"]
    assert pinned == ["#17", "0.500", ">= 0.8", "", "FAIL"]
    assert "12 judged: 7 PASS, 5 FAIL; 0 without a result." in text


def test_on_cpu_every_ratio_is_printed_not_judged(tmp_path: Path, capsys: Any) -> None:
    out = _fixtures(tmp_path / "out", backend="cpu")
    # Each file's own backend wins over --backend: these ran on CPU.
    assert summary.main([str(out), "--backend", "tpu"]) == 0
    text = capsys.readouterr().out
    rows = _table(text)
    assert len(rows) == 12
    for target, cells in rows.items():
        assert cells[4] == "not judged (cpu)" and float(cells[1]) > 0, target
    assert "Nothing judged: targets are judged on an accelerator only; 0 without a result." in text
    assert "PASS" not in text and "FAIL" not in text


def test_a_file_without_a_backend_takes_the_detected_one(tmp_path: Path, capsys: Any) -> None:
    out = _fixtures(tmp_path / "out")
    feed = json.loads((out / "feed.json").read_text())
    del feed["backend"]  # written before bench_feed.py recorded it
    (out / "feed.json").write_text(json.dumps(feed))
    summary.main([str(out), "--backend", "cpu"])
    assert _table(capsys.readouterr().out)[FEED_ROWS[0]][4] == "not judged (cpu)"
    summary.main([str(out)])
    assert _table(capsys.readouterr().out)[FEED_ROWS[0]][4] == "not judged (backend unknown)"


def test_a_missing_result_says_why(tmp_path: Path, capsys: Any) -> None:
    out = _fixtures(tmp_path / "out")
    for name in ("feed.json", "device_replay.json", "device_writes.json"):
        (out / name).unlink()
    (out / "device" / "results.json").unlink()
    (out / "runs.tsv").write_text("bench_feed\t124\t1800\nbench_device_replay\t1\t12\n"
                                  "device_section\t0\t90\n")  # fmt: skip
    assert summary.main([str(out), "--backend", "tpu"]) == 0  # a missing result is a finding
    text = capsys.readouterr().out
    rows = _table(text)
    assert len(rows) == 11  # every issue-41 target still has its row
    assert rows[FEED_ROWS[2]][4] == (
        "no result: bench_feed timed out after 1800 s (logs/bench_feed.log)"
    )
    assert rows[REPLAY_ROWS[3]][4] == (
        "no result: bench_device_replay failed, exit status 1 (logs/bench_device_replay.log)"
    )
    assert rows[WRITES_ROW][4].startswith("no result: bench_device_writes did not run")
    assert rows[RESIDENT_ROWS[0]][4] == (
        "no result: device_section exited 0 but wrote no device/results.json"
    )
    assert "Nothing judged" in text and "11 without a result" in text


def test_a_case_that_did_not_run_is_named(tmp_path: Path, capsys: Any) -> None:
    out = _fixtures(tmp_path / "out")
    feed = json.loads((out / "feed.json").read_text())
    del feed["conv"]  # bench_feed.py --only mlp
    (out / "feed.json").write_text(json.dumps(feed))
    (out / "device" / "results.json").unlink()
    (out / "device").rmdir()
    _device(out, "tpu", {"transitions": 0.96, "images": 1.0}, skip="images")
    summary.main([str(out)])
    rows = _table(capsys.readouterr().out)
    assert rows[FEED_ROWS[2]][4] == "no result: no conv.ratios.fed-w0-default in feed.json"
    assert rows[RESIDENT_ROWS[1]][4] == (
        "no result: resident replay skipped (over its device budget)"
    )
    assert rows[RESIDENT_ROWS[0]][4] == "PASS"


@pytest.mark.parametrize(
    "file, text, phrase",
    [
        ("feed.json", '{"mlp": {', "feed.json is not JSON"),
        ("feed.json", "[1, 2]", "feed.json holds a list, not the object bench_feed writes"),
        ("feed.json", '{"mlp": {"ratios": {"fed-w0-default": "fast"}}}',
         "feed.json: mlp.ratios.fed-w0-default is 'fast', not a finite number"),
        ("device_replay.json", '{"workloads": {"conv": {"rates": {"bare": 1, "uniform": NaN}}}}',
         "device_replay.json: workloads.conv.rates.uniform is nan, not a finite number"),
        ("device_writes.json", '{"rows": {"a": 1}}',
         "device_writes.json: 'rows' is dict, not the list of rows"),
        ("runs.tsv", "bench_feed\tlate\n", "runs.tsv, line 1: 'bench_feed\\tlate' is not"),
    ],
)  # fmt: skip
def test_a_malformed_file_is_named_with_a_fix(
    tmp_path: Path, capsys: Any, file: str, text: str, phrase: str
) -> None:
    out = _fixtures(tmp_path / "out")
    (out / file).write_text(text)
    assert summary.main([str(out), "--backend", "tpu"]) == 2
    captured = capsys.readouterr()
    assert phrase in captured.err and "Fix:" in captured.err, captured.err
    rows = _table(captured.out)
    assert len(rows) == 12  # the other files' rows are still printed
    if file != "runs.tsv":
        assert sum("is unreadable" in cells[4] for cells in rows.values()) >= 1
    assert rows[RESIDENT_ROWS[0]][4] == "PASS"


def test_the_summary_refuses_a_folder_that_is_not_there(tmp_path: Path, capsys: Any) -> None:
    assert summary.main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere is not a folder" in err and "Fix:" in err


# -- the script's dry run ---------------------------------------------------------------------


def _run(
    *args: str, script: Path = SCRIPT, timeout: float = 120, pythonpath: str = str(ROOT)
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "PYTHONPATH")}
    env["PYTHONPATH"] = pythonpath  # the script must drop ROOT: a checkout is not what runs
    return subprocess.run(
        ["bash", str(script), "--python", sys.executable, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _fake_wheels(folder: Path, *names: str) -> Path:
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def _carry(tmp_path: Path) -> Path:
    return _fake_wheels(
        tmp_path / "carry",
        "grain_replay-0.1.0-py3-none-any.whl",
        "zarr-3.4.2-py3-none-any.whl",  # this venv has zarr: kept
        "not_a_real_package-1.0-py3-none-any.whl",  # missing here: installed
        "other_python_only-1.0-cp39-cp39-manylinux2014_x86_64.whl",  # not for this Python
    )


def _steps(out: str) -> list[tuple[int, str]]:
    return [(int(m[1]), m[2]) for m in re.finditer(r"^step (\d+): (.*)$", out, re.M)]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """The plain dry run (its folder, its run): two tests read it, one run of the script."""
    tmp_path = tmp_path_factory.mktemp("dry_run")
    return tmp_path, _run(
        "--carry", str(_carry(tmp_path)), "--out", str(tmp_path / "out"), "--dry-run"
    )


def test_dry_run_installs_what_the_machine_lacks_and_keeps_the_rest(
    dry_run: tuple[Path, subprocess.CompletedProcess],
) -> None:
    tmp_path, proc = dry_run
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "install grain_replay-0.1.0-py3-none-any.whl" in out
    assert "keep zarr-3.4.2-py3-none-any.whl zarr" in out
    assert "install not_a_real_package-1.0-py3-none-any.whl" in out
    assert "skip other_python_only-1.0-cp39" in out
    install = dict(_steps(out))[1]
    assert "--no-deps --no-index --target " + str(tmp_path / "out" / "site") in install
    assert "grain_replay-0.1.0" in install and "not_a_real_package" in install
    assert "zarr" not in install and "other_python_only" not in install
    assert "PIP_CONFIG_FILE=/dev/null" in install  # the machine's pip configuration ignored
    assert not (tmp_path / "out").exists()  # a dry run changes nothing


def test_dry_run_prints_the_plan_one_process_at_a_time(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    proc = _run("--carry", str(_carry(tmp_path)), "--out", str(out_dir), "--dry-run",
                "--timeout", "600", "--index-url", "")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    steps = _steps(proc.stdout)
    assert [n for n, _ in steps] == list(range(1, 11))
    plan = dict(steps)
    # The environment: the machine's site-packages first, the carried packages last.
    env = plan[3].split(": ", 1)[1].split()
    assert [e.split("=")[0] for e in env] == ["PYTHONPATH"]  # JAX_PLATFORMS only with --cpu
    path = env[0].removeprefix("PYTHONPATH=").split(":")
    site = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    assert path == [*site, str(out_dir / "site")]
    assert sysconfig.get_paths()["purelib"] in path[:-1]
    assert str(ROOT) not in path  # the checkout is never imported
    assert plan[5].endswith('-c "import jax; print(jax.default_backend())"')
    # The benchmarks, strictly in this order, each under its timeout, after the detection.
    names = ["bench_feed", "bench_device_replay", "bench_device_writes", "device_section"]
    assert [plan[n].split(",")[0] for n in range(6, 10)] == names
    scripts = ["bench_feed.py", "bench_device_replay.py --peers", "bench_device_writes.py",
               "run.py --sections device"]  # fmt: skip
    for n, script in zip(range(6, 10), scripts):
        assert f"timeout 600s: {sys.executable} {ROOT}/benchmarks/{script}" in plan[n], plan[n]
        assert "--repeats 3" in plan[n] and "--quick" not in plan[n]
    assert f"--out {out_dir}/feed.json" in plan[6]
    assert f"--out {out_dir}/device_replay.json" in plan[7]
    assert f"--out {out_dir}/device_writes.json" in plan[8]
    assert "--transitions 200000 --image-records 20000" in plan[9]
    assert plan[10].startswith("summary (no jax)") and "accelerator_summary.py" in plan[10]
    lines = proc.stdout.splitlines()
    single = next(i for i, line in enumerate(lines) if line.startswith("one process at a time"))
    assert lines[single - 1].startswith("step 5:") and lines[single + 1].startswith("step 6:")
    assert "libtpu lets one process hold a TPU" in lines[single]
    assert "step 2: install from the index (none): nothing, the machine has h5py" in proc.stdout


def test_the_machines_own_pythonpath_stays_first_and_a_checkout_on_it_goes(tmp_path: Path) -> None:
    # A TPU host's image puts its jax on PYTHONPATH (/opt/...): dropping it loses jax.
    machine = tmp_path / "machine-jax"
    machine.mkdir()
    out_dir = tmp_path / "out"
    proc = _run("--carry", str(_carry(tmp_path)), "--out", str(out_dir), "--dry-run",
                "--index-url", "", pythonpath=f"{machine}:{ROOT}:")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    env = dict(_steps(proc.stdout))[3].split(": ", 1)[1].split()
    path = env[0].removeprefix("PYTHONPATH=").split(":")
    site = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    assert path == [str(machine), *site, str(out_dir / "site")]


def test_dry_run_with_cpu_runs_toy_sizes_on_cpu(tmp_path: Path) -> None:
    proc = _run("--carry", str(_carry(tmp_path)), "--out", str(tmp_path / "out"), "--dry-run",
                "--cpu", "--repeats", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = dict(_steps(proc.stdout))
    assert plan[3].split(": ", 1)[1].split()[1] == "JAX_PLATFORMS=cpu"
    for n in range(6, 10):
        assert "--quick" in plan[n] and "--repeats 1" in plan[n] and "timeout 900s" in plan[n]
    assert "--transitions 2000 --image-records 200" in plan[9] and "--batch-size 16" in plan[9]


def test_packages_the_machine_lacks_come_from_the_index(tmp_path: Path) -> None:
    carry = _carry(tmp_path)
    proc = _run("--carry", str(carry), "--out", str(tmp_path / "out"), "--dry-run",
                "--index-url", "file:///srv/simple", "--index-packages",
                "h5py no-such-dist-here")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "the machine lacks no-such-dist-here: from file:///srv/simple" in proc.stdout
    step = dict(_steps(proc.stdout))[2]
    assert step.endswith("--index-url file:///srv/simple no-such-dist-here")  # h5py is here
    assert "--no-deps --target " in step
    proc = _run("--carry", str(carry), "--out", str(tmp_path / "out"), "--dry-run",
                "--index-url", "", "--index-packages", "no-such-dist-here")  # fmt: skip
    assert "nothing, no --index-url (lacking no-such-dist-here)" in proc.stdout


def test_the_peers_packages_come_from_the_index_best_effort(tmp_path: Path) -> None:
    # flashbax imports flax, which a TPU host's image lacks and its index has.
    args = ("--carry", str(_carry(tmp_path)), "--out", str(tmp_path / "out"), "--dry-run")
    proc = _run(*args, "--index-url", "file:///srv/simple",
                "--peer-packages", "numpy no-such-peer-here")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    peers = "best effort, for the peers (flashbax): no-such-peer-here\n"  # numpy is here
    assert peers in proc.stdout
    proc = _run(*args, "--index-url", "", "--peer-packages", "no-such-peer-here")
    assert "for the peers" not in proc.stdout  # no index: nothing to try


def test_the_old_name_runs_the_new_script(
    dry_run: tuple[Path, subprocess.CompletedProcess],
) -> None:
    assert len(OLD_SCRIPT.read_text().splitlines()) == 3
    tmp_path, new = dry_run
    args = ("--carry", str(tmp_path / "carry"), "--out", str(tmp_path / "out"), "--dry-run")
    old = _run(*args, script=OLD_SCRIPT)
    assert old.returncode == new.returncode == 0, old.stderr
    assert _steps(old.stdout) == _steps(new.stdout) and len(_steps(old.stdout)) == 10


def test_a_carried_jax_libtpu_or_numpy_is_refused(tmp_path: Path) -> None:
    # One run (a dry run starts several interpreters): the plan names every refused wheel.
    refused = {"jax-0.12.0": "jax", "jaxlib-0.12.0": "jaxlib", "libtpu-0.0.20": "libtpu",
               "numpy-2.4.6": "numpy"}  # fmt: skip
    carry = _fake_wheels(
        tmp_path / "carry",
        "grain_replay-0.1.0-py3-none-any.whl",
        *(f"{wheel}-py3-none-any.whl" for wheel in refused),
    )
    proc = _run("--carry", str(carry), "--out", str(tmp_path / "out"), "--dry-run")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    for wheel, name in refused.items():
        line = f"refuse {wheel}-py3-none-any.whl {name}: the machine's own {name} is never replaced"
        assert line in proc.stdout, proc.stdout
    assert "make accelerator-wheels" in proc.stderr


def test_bad_usage_is_named_with_a_fix(tmp_path: Path) -> None:
    proc = _run("--carry", str(tmp_path / "none"), "--dry-run")
    assert proc.returncode == 2 and "make accelerator-wheels" in proc.stderr
    assert "Fix:" in proc.stderr
    proc = _run("--no-such-flag")
    assert proc.returncode == 2 and "unknown argument --no-such-flag" in proc.stderr
    proc = _run("--repeats", "three", "--dry-run")
    assert proc.returncode == 2 and "--repeats three is not a positive whole number" in proc.stderr
    proc = _run("--timeout")
    assert proc.returncode == 2 and "--timeout needs a value" in proc.stderr
    carry = _fake_wheels(tmp_path / "carry", "zarr-3.4.2-py3-none-any.whl")
    proc = _run("--carry", str(carry), "--out", str(tmp_path / "out"), "--dry-run")
    assert proc.returncode == 2 and "no grain_replay wheel" in proc.stderr
    proc = _run("--python", str(tmp_path / "no-python"), "--dry-run")
    assert proc.returncode == 2 and "no interpreter" in proc.stderr
    proc = _run("--only", "bench_feed,bench_replay", "--dry-run")
    assert proc.returncode == 2 and "--only: no step bench_replay" in proc.stderr
    assert "Fix: name some of: bench_feed, bench_device_replay" in proc.stderr


def test_dry_run_with_only_names_the_steps_it_leaves_out(tmp_path: Path) -> None:
    proc = _run("--carry", str(_carry(tmp_path)), "--out", str(tmp_path / "out"), "--dry-run",
                "--only", "bench_feed,device_section")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = dict(_steps(proc.stdout))
    assert not plan[6].endswith("(not in --only: not run)")
    assert plan[7].endswith("(not in --only: not run)")
    assert plan[8].endswith("(not in --only: not run)")
    assert not plan[9].endswith("(not in --only: not run)")
    kept = f"(the other steps' results in {tmp_path}/out are kept)"
    assert f"only: bench_feed device_section {kept}" in proc.stdout


# -- real installs (slow; need make accelerator-wheels) ---------------------------------------

needs_wheels = pytest.mark.skipif(
    not list(WHEELS.glob("grain_replay-*.whl")),
    reason="no .accelerator-wheels/ (make accelerator-wheels)",
)


@pytest.mark.slow  # installs the wheels: a minute or two here
@needs_wheels
def test_no_accelerator_without_cpu_stops_before_any_benchmark(tmp_path: Path) -> None:
    proc = _run("--carry", str(WHEELS), "--out", str(tmp_path))  # this machine: jax on CPU
    assert proc.returncode == 5, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "jax's backend is cpu: no accelerator is visible" in proc.stderr
    assert "Fix:" in proc.stderr and "--cpu" in proc.stderr
    assert "==> unchanged: jax=" in proc.stdout  # installed and checked first
    assert not (tmp_path / "logs").exists() and not (tmp_path / "runs.tsv").exists()


@pytest.mark.slow  # installs the wheels: a minute or two here
@needs_wheels
def test_a_benchmark_past_its_timeout_is_stopped_and_the_table_says_so(tmp_path: Path) -> None:
    # One second: not enough for any of them to import jax and write its stores.
    proc = _run("--carry", str(WHEELS), "--out", str(tmp_path), "--cpu", "--timeout", "1")
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "a benchmark failed or timed out" in proc.stderr
    runs = [line.split("\t") for line in (tmp_path / "runs.tsv").read_text().splitlines()]
    assert [(r[0], r[1]) for r in runs] == [
        ("bench_feed", "124"), ("bench_device_replay", "124"), ("bench_device_writes", "124"),
        ("device_section", "124"),
    ]  # fmt: skip
    rows = _table(proc.stdout.split("==> summary", 1)[1])
    assert list(rows) == ISSUE_41  # every target still has its row
    assert re.fullmatch(r"no result: bench_feed timed out after \d+ s \(logs/bench_feed.log\)",
                        rows[FEED_ROWS[0]][4])  # fmt: skip
    assert rows[WRITES_ROW][4].startswith("no result: bench_device_writes timed out")
    left = subprocess.run(["pgrep", "-f", f"--out {tmp_path}/"], capture_output=True, text=True)
    assert left.stdout == ""  # timeout ended each benchmark before the next started


@pytest.mark.slow  # installs the wheels twice: a few minutes here
@needs_wheels
def test_only_fills_one_folder_over_several_invocations(tmp_path: Path) -> None:
    first = _run("--carry", str(WHEELS), "--out", str(tmp_path), "--cpu", "--timeout", "1",
                 "--only", "bench_feed,bench_device_writes")  # fmt: skip
    assert first.returncode == 6, first.stdout[-2000:] + first.stderr[-2000:]
    assert "bench_device_replay: not in --only" in first.stdout
    second = _run("--carry", str(WHEELS), "--out", str(tmp_path), "--cpu", "--timeout", "1",
                  "--only", "bench_device_writes")  # fmt: skip
    assert second.returncode == 6
    runs = [line.split("\t")[:2] for line in (tmp_path / "runs.tsv").read_text().splitlines()]
    # The first invocation's bench_feed stays; bench_device_writes is the second's alone.
    assert runs == [["bench_feed", "124"], ["bench_device_writes", "124"]]
    rows = _table(second.stdout.split("==> summary", 1)[1])
    assert rows[FEED_ROWS[0]][4].startswith("no result: bench_feed timed out")


# -- the whole path on CPU --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(3600)  # four benchmarks at toy sizes: 7 minutes on 2 loaded cores
@needs_wheels
def test_cpu_run_installs_the_wheels_and_prints_every_target(tmp_path: Path) -> None:
    proc = _run("--carry", str(WHEELS), "--out", str(tmp_path), "--cpu", timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "==> unchanged: jax=" in out
    assert f"grain_replay 0.1.0 ({tmp_path}/site/grain_replay/" in out  # the carried wheel
    assert "CPU (--cpu): toy sizes" in out
    names = ("bench_feed", "bench_device_replay", "bench_device_writes", "device_section")
    order = [out.index(f"==> {n} (timeout") for n in names]
    assert order == sorted(order)
    rows = _table(out.split("==> summary", 1)[1])
    for target in ISSUE_41:
        issue, ratio, need, _, verdict = rows[target]
        assert issue == "#41"
        assert verdict == "not judged (cpu)" and float(ratio) > 0 and need.startswith(">= ")
    assert any(cells[0] == "#17" for cells in rows.values())
    runs = [line.split("\t") for line in (tmp_path / "runs.tsv").read_text().splitlines()]
    assert [(r[0], r[1]) for r in runs] == [
        ("bench_feed", "0"), ("bench_device_replay", "0"), ("bench_device_writes", "0"),
        ("device_section", "0"),
    ]  # fmt: skip
    assert (tmp_path / "summary.md").read_text() in out
    assert not math.isnan(float(rows[WRITES_ROW][1]))
