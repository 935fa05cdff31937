"""This process's children, for tests that start and stop worker processes."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is in the test extras
    psutil = None

__all__ = [
    "JOB_TIMEOUT_S",
    "children",
    "cmdline",
    "free_port",
    "new_children",
    "run_job",
    "run_workers",
    "wait_no_new_children",
]

# One multi-process JAX job (2 or 4 processes, a few batches) takes 5-30 s on the
# 2-core CI machine, and up to ~65 s when other jobs load it to 20. The limit is
# above that and below the ~150 s the teardown stall (fixed by
# gr.shutdown_distributed()) waited, so a stall fails the test instead of passing slowly.
JOB_TIMEOUT_S = 120.0


def children(pid: int | None = None) -> set[int]:
    """Every live descendant of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    if psutil is not None:
        try:
            return {
                c.pid
                for c in psutil.Process(pid).children(recursive=True)
                if c.status() != psutil.STATUS_ZOMBIE
            }
        except psutil.NoSuchProcess:
            return set()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                parents[int(entry)] = int(stat[1])
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def new_children(baseline: set[int]) -> list[int]:
    """Children started since ``baseline``, less multiprocessing's resource tracker."""
    return sorted(p for p in children() - baseline if "resource_tracker" not in cmdline(p))


def wait_no_new_children(baseline: set[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while new_children(baseline):
        if time.monotonic() > deadline:
            left = {p: cmdline(p)[:120] for p in new_children(baseline)}
            raise AssertionError(
                f"orphan processes {timeout} s after the loader was closed: {left}"
            )
        gc.collect()
        time.sleep(0.1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a job's coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _py_spy_dumps(procs: list[subprocess.Popen[bytes]]) -> str:
    """Where each live process is (``py-spy dump --native``), when py-spy is installed."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(exe):
        return "\n(install py-spy to see where each process was)"
    out = []
    for i, p in enumerate(procs):
        if p.poll() is None:
            r = subprocess.run(
                [exe, "dump", "--native", "--pid", str(p.pid)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            out.append(f"--- process {i}: py-spy dump ---\n{r.stdout[-6000:]}{r.stderr[-500:]}")
    return "\n" + "\n".join(out)


def run_job(
    cmds: list[list[str]],
    env: dict[str, str],
    out_dir: Path,
    outs: list[Path],
    *,
    timeout_s: float = JOB_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Runs one process per command to completion and returns each one's JSON result.

    Kills every process and fails the test with their output when one exits non-zero
    (the others would wait for it) or the job runs past ``timeout_s``. Prints the
    job's time and when each process ended (``pytest -s`` shows it): a teardown stall
    shows as one process ending long after the others.
    """
    import pytest

    out_dir.mkdir(parents=True, exist_ok=True)
    logs = [out_dir / f"log{i}.txt" for i in range(len(cmds))]
    procs: list[subprocess.Popen[bytes]] = []
    ended: list[float | None] = [None] * len(cmds)
    t0 = time.monotonic()
    timed_out = False
    stacks = ""
    try:
        for cmd, log_path in zip(cmds, logs):
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir
                    )
                )
        while any(p.poll() is None for p in procs):
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.monotonic() - t0
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one failed: the others would wait on it until the timeout
            if time.monotonic() - t0 > timeout_s:
                timed_out = True
                break
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic() - t0
        stacks = _py_spy_dumps(procs) if timed_out else ""
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    elapsed = time.monotonic() - t0
    ends = ", ".join("-" if e is None else f"{e:.1f}" for e in ended)
    print(f"multihost job: {len(cmds)} processes, {elapsed:.1f} s (processes ended at {ends} s)")
    codes = [p.returncode for p in procs]
    if codes != [0] * len(cmds):
        report = "\n".join(
            f"--- process {i} (exit {codes[i]}) ---\n{logs[i].read_text(errors='replace')[-6000:]}"
            for i in range(len(cmds))
        )
        why = f"timed out after {timeout_s:.0f} s" if timed_out else "failed"
        pytest.fail(f"{len(cmds)}-process job {why}:\n{report}{stacks}")
    return [json.loads(o.read_text()) for o in outs]


def run_workers(
    worker: Path, num_processes: int, out_dir: Path, *args: str, local_devices: int = 4
) -> list[dict[str, Any]]:
    """Runs ``worker`` as each process of one JAX job on CPU (:func:`run_job`).

    Process ``i`` gets ``--port=P --process-id=I``, then ``args``, then ``--out=OUT``
    (where its JSON result goes), with ``local_devices`` CPU devices.
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    port = free_port()
    outs = [out_dir / f"out{i}.json" for i in range(num_processes)]
    cmds = [
        [sys.executable, str(worker), f"--port={port}", f"--process-id={i}", *args,
         f"--out={outs[i]}"]
        for i in range(num_processes)
    ]  # fmt: skip
    return run_job(cmds, env, out_dir, outs)
