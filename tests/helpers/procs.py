"""This process's children, for tests that start and stop worker processes."""

from __future__ import annotations

import gc
import os
import time

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is in the test extras
    psutil = None

__all__ = ["children", "cmdline", "new_children", "wait_no_new_children"]


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
