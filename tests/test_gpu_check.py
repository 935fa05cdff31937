"""benchmarks/gpu_check.sh, the GPU machine's run, exercised on this CPU machine.

The dry run checks which carried wheels the script would install next to the
machine's own packages (never jax). The end-to-end run (slow; needs
``make gpu-wheels``) installs the carried grain_replay wheel into a throwaway venv
that sees this venv's packages, runs the device section on CPU and prints every
GPU target with its ratio.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
WHEELS = ROOT / ".gpu-wheels"


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.run(
        ["bash", str(SCRIPT), "--python", sys.executable, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _fake_wheels(folder: Path, *names: str) -> Path:
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_dry_run_installs_what_the_machine_lacks_and_keeps_the_rest(tmp_path: Path) -> None:
    carry = _fake_wheels(
        tmp_path / "carry",
        "grain_replay-0.1.0-py3-none-any.whl",
        "zarr-3.4.2-py3-none-any.whl",  # this venv has zarr: kept
        "not_a_real_package-1.0-py3-none-any.whl",  # missing here: installed
        "other_python_only-1.0-cp39-cp39-manylinux2014_x86_64.whl",  # not for this Python
    )
    proc = _run("--carry", str(carry), "--out", str(tmp_path / "out"), "--dry-run", "--cpu")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "install grain_replay-0.1.0-py3-none-any.whl" in out
    assert "keep zarr-3.4.2-py3-none-any.whl zarr" in out
    assert "install not_a_real_package-1.0-py3-none-any.whl" in out
    assert (
        "skip other_python_only-1.0-cp39" in out
        and "other_python_only" not in out.split("pip install", 1)[1]
    )
    assert "--no-index --no-deps" in out and "--sections device" in out
    assert "JAX_PLATFORMS=cpu" in out
    assert not (tmp_path / "out" / "venv").exists()  # a dry run changes nothing


def test_a_carried_jax_is_refused_and_a_missing_carry_named(tmp_path: Path) -> None:
    carry = _fake_wheels(
        tmp_path / "carry",
        "grain_replay-0.1.0-py3-none-any.whl",
        "jax-0.12.0-py3-none-any.whl",
    )
    proc = _run("--carry", str(carry), "--out", str(tmp_path / "out"), "--dry-run")
    assert proc.returncode == 3 and "jax" in proc.stderr and "make gpu-wheels" in proc.stderr
    proc = _run("--carry", str(tmp_path / "none"), "--dry-run")
    assert proc.returncode == 2 and "make gpu-wheels" in proc.stderr
    proc = _run("--no-such-flag")
    assert proc.returncode == 2 and "unknown argument" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    not list(WHEELS.glob("grain_replay-*.whl")), reason="no .gpu-wheels/ (make gpu-wheels)"
)
def test_cpu_run_installs_the_wheel_and_prints_every_gpu_target(tmp_path: Path) -> None:
    proc = _run(
        "--carry", str(WHEELS), "--out", str(tmp_path), "--cpu",
        "--transitions", "2000", "--image-records", "200", "--batch-size", "16",
        "--repeats", "1", "--target-s", "0.002",
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "jax unchanged" in out
    assert f"grain_replay 0.1.0 ({tmp_path}/venv/" in out  # the carried wheel, not a checkout
    targets = out.split("==> GPU targets", 1)[1]
    for name in ("bare pinned put", "step-fed-by-loader", "step-fed-by-resident"):
        line = next(line for line in targets.splitlines() if name in line)
        assert "not judged (cpu)" in line and "x (target >= " in line, line
