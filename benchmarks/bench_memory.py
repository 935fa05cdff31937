"""Section ``memory``: one epoch over a store larger than half of RAM, peak RssAnon per process.

Opt-in (``--sections memory``): it writes a store of 0.52 x MemTotal into
``--data`` (deleted afterwards), drops it from the page cache, then reads it
once with ``make_data_loader(worker_count=0)`` and once with ``worker_count=2``
while a thread samples ``RssAnon`` of this process and of every child process
(grain's workers). The goal is that no process holds anonymous memory in
proportion to the store: file pages are page cache (``RssFile``), decoded
chunks are bounded by the source's ``cache_bytes``.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_common import Case, Config, SectionResult, drop_page_cache, rss_anon_mb

import grain_replay as gr

__all__ = ["run_memory"]

# The bound on every process's anonymous memory during an epoch.
TARGET_MB = 500
STORE_FRACTION_OF_RAM = 0.52
QUICK_STORE_BYTES = 64 * 2**20
ROW_SHAPE = (84, 84, 4)
BLOCK_ROWS = 1024
# Disk space kept free beyond the store.
HEADROOM_BYTES = 2**30
WORKER_COUNTS = (0, 2)


def mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def children_of(pid: int) -> list[int]:
    """Descendant process ids of ``pid`` (scans /proc)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        parents[int(name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


class PeakRss:
    """Samples RssAnon of this process and its descendants until stopped."""

    def __init__(self, interval_s: float = 0.05):
        self.main_mb = rss_anon_mb()
        self.children_mb: dict[int, float] = {}
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(self._interval):
            self.main_mb = max(self.main_mb, rss_anon_mb())
            for pid in children_of(me):
                self.children_mb[pid] = max(self.children_mb.get(pid, 0.0), rss_anon_mb(pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def write_store(path: str, rows: int, fmt: str, log: Callable[[str], None]) -> None:
    """``rows`` image records (and their ids, ``step``) written in blocks: memory stays small."""
    t0 = time.perf_counter()
    block = np.empty((BLOCK_ROWS, *ROW_SHAPE), dtype=np.uint8)
    with gr.ReplayWriter(path, format=fmt) as w:
        for start in range(0, rows, BLOCK_ROWS):
            k = min(BLOCK_ROWS, rows - start)
            block[:k] = start % 251
            w.append({"obs": block[:k], "step": np.arange(start, start + k, dtype=np.int64)})
        w.flush()
    os.sync()
    log(f"  wrote {rows:,} records to {path} in {time.perf_counter() - t0:.1f}s")


def read_epoch(path: str, workers: int, batch_size: int) -> tuple[float, int, PeakRss]:
    """One shuffled epoch through ``make_data_loader``; checks every record arrives once."""
    src = gr.open_source(path)
    seen = np.zeros(len(src), dtype=np.int64)
    drop_page_cache([path])
    peak = PeakRss()
    t0 = time.perf_counter()
    batches = 0
    try:
        loader = gr.make_data_loader(
            src, batch_size=batch_size, worker_count=workers, drop_remainder=False
        )
        for batch in loader:
            np.add.at(seen, batch["step"], 1)
            batches += 1
    finally:
        elapsed = time.perf_counter() - t0
        peak.stop()
        src.close()
    if not (seen == 1).all():
        raise AssertionError(f"{path}: an epoch read {int((seen != 1).sum())} records not once")
    return elapsed, batches, peak


def run_memory(
    cfg: Config,
    stores: dict[str, dict[str, Any]],
    res: SectionResult,
    log: Callable[[str], None],
    fmt: str = "npy",
) -> None:
    ram = mem_total_bytes()
    target = QUICK_STORE_BYTES if cfg.quick else int(STORE_FRACTION_OF_RAM * ram)
    row_bytes = int(np.prod(ROW_SHAPE)) + 8
    rows = max(cfg.batch_size, target // row_bytes)
    store_bytes = rows * row_bytes
    os.makedirs(cfg.data_dir, exist_ok=True)
    free = shutil.disk_usage(cfg.data_dir).free
    if free < store_bytes + HEADROOM_BYTES:
        msg = (
            f"SKIPPED: a {store_bytes / 1e9:.1f} GB store ({STORE_FRACTION_OF_RAM} x RAM of "
            f"{ram / 1e9:.1f} GB) "
            f"needs {(store_bytes + HEADROOM_BYTES) / 1e9:.1f} GB free on {cfg.data_dir}, which "
            f"has {free / 1e9:.1f} GB. Fix: pass --data DIR on a disk with room."
        )
        log(f"  {msg}")
        res.notes.append(msg)
        return
    suffix = {"npy": "", "hdf5": ".h5", "zarr": ".zarr"}[fmt]
    path = os.path.join(cfg.data_dir, f"memory-{rows}-{fmt}{suffix}")
    remove(path)
    extra: dict[str, Any] = {
        "ram_bytes": ram,
        "store_bytes": store_bytes,
        "records": rows,
        "format": fmt,
        "target_mb": TARGET_MB,
        "epochs": [],
    }
    res.extra["memory"] = extra
    try:
        write_store(path, rows, fmt, log)
        for workers in WORKER_COUNTS:
            elapsed, batches, peak = read_epoch(path, workers, cfg.batch_size)
            worst_child = max(peak.children_mb.values(), default=0.0)
            epoch = {
                "worker_count": workers,
                "epoch_s": elapsed,
                "batches": batches,
                "peak_rss_anon_main_mb": peak.main_mb,
                "peak_rss_anon_children_mb": sorted(peak.children_mb.values(), reverse=True),
            }
            extra["epochs"].append(epoch)
            note = f"peak RssAnon main {peak.main_mb:,.0f} MB, worst child {worst_child:,.0f} MB"
            method = f"epoch-workers{workers}"
            case = Case(
                f"memory/images/{fmt}/{method}", "memory", "images", fmt, fmt, method,
                "pipeline", cfg.batch_size, row_bytes, batches, [elapsed], note,
            )  # fmt: skip
            res.add(case)
            ok = max(peak.main_mb, worst_child) < TARGET_MB
            res.notes.append(
                f"{'PASS' if ok else 'FAIL'} one epoch of a {store_bytes / 1e9:.1f} GB {fmt} store "
                f"(RAM {ram / 1e9:.1f} GB), worker_count={workers}: peak RssAnon main "
                f"{peak.main_mb:,.0f} MB, children "
                f"{[round(v) for v in epoch['peak_rss_anon_children_mb']]} MB "
                f"(target < {TARGET_MB} MB each), {elapsed:.1f}s"
            )
            log(f"  {res.notes[-1]}")
    finally:
        remove(path)
        remove(path + ".lock")  # ReplayWriter's lock file
