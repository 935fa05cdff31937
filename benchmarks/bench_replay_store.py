"""Bounded, many-writer replay stores: reads after eviction, disk use, writers, refresh.

Every number is a ratio measured in this run:

- uniform ``sample + read`` (batch 256) over a bounded store of C live rows of
  525 B after 10 x C rows were inserted, against the same sampler over a plain
  store holding the same C rows (target >= 0.9);
- prioritized ``sample + read`` (plus ``update_priorities`` of each batch) over
  the same two stores (target >= 0.9);
  (both: the median of blocks of 10 batches, the two stores' blocks interleaved);
- disk use of the bounded store over its live bytes (target <= 1.1 plus the
  stated slack: two segments per writer, 2/16 of the capacity);
- committed rows/s of two writer processes (flush every 1,000 rows, 600,000 rows
  each, a few seconds a run) over one (target >= 1.6; needs 2 free cores), with
  each side's time per phase (startup, append, flush, close);
- ``refresh()`` after one writer's commit with 1, 8 and 64 writer parts (time,
  reader memory, uniform ``sample + read``; target: 64 parts <= 10 x 1 part).

Usage::

    python benchmarks/bench_replay_store.py [--quick] [--live C] [--out DIR]
        [--cases eviction,writers,refresh] [--repeats R] [--writer-rows N]
    python benchmarks/run.py --quick --sections store
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from bench_common import transitions

HERE = os.path.dirname(os.path.abspath(__file__))
BATCH = 256


ROW_BYTES = 64 * 4 * 2 + 8 + 4 + 1


def _disk(path: str) -> int:
    return sum(os.stat(os.path.join(r, f)).st_size for r, _, fs in os.walk(path) for f in fs)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _stepper(source: Any, prioritized: bool, batches: int) -> Any:
    """One ``sample + read`` step of a replay loader over ``source`` (prioritized: plus
    ``update_priorities`` of the batch, which the next draw applies: a learner's loop)."""
    import grain_replay as gr

    sampling: Any = (
        gr.PrioritizedReplay(refresh_every=None)
        if prioritized
        else gr.UniformReplay(refresh_every=None)
    )
    it = iter(gr.make_data_loader(source, batch_size=BATCH, sampling=sampling, seed=0))
    priorities = np.random.default_rng(0).random((batches + BLOCK, BATCH))

    def step(k: int) -> None:
        batch = next(it)
        if prioritized:
            it.update_priorities(batch.index, priorities[k])

    for k in range(3):
        step(k)
    return step


BLOCK = 10  # batches timed at a time, the sources' blocks interleaved


def _rates(sources: list[Any], batches: int, repeats: int, prioritized: bool) -> list[float]:
    """Batches/s of each source: the median over ``repeats * batches / BLOCK`` blocks of
    ``BLOCK`` batches, the sources' blocks interleaved, so that a change of the
    machine's load (a shared machine's load moves within a second) hits all alike."""
    steps = [_stepper(src, prioritized, batches * repeats) for src in sources]
    times: list[list[float]] = [[] for _ in sources]
    k = 0
    for _ in range(repeats * max(1, batches // BLOCK)):
        for step, out in zip(steps, times):
            t = time.perf_counter()
            for j in range(k, k + BLOCK):
                step(j)
            out.append((time.perf_counter() - t) / BLOCK)
        k += BLOCK
    return [1.0 / statistics.median(t) for t in times]


def _batches_per_s(source: Any, batches: int, repeats: int) -> float:
    return _rates([source], batches, repeats, False)[0]


def bench_eviction(tmp: str, live: int, repeats: int, log: Any) -> dict[str, Any]:
    import grain_replay as gr

    bounded, plain = os.path.join(tmp, "bounded"), os.path.join(tmp, "plain")
    block = max(1000, live // 50)
    with gr.ReplayWriter(bounded, capacity=live, writer_id="actor-0") as w:
        inserted = 0
        while inserted < 10 * live:
            n = min(block, 10 * live - inserted)
            w.append(transitions(n, inserted))
            inserted += n
            w.flush()
        segment_rows = w._store.manifest.segment_rows
    with gr.ReplayWriter(plain) as w:
        for start in range(0, live, block):
            w.append(transitions(min(block, live - start), start))
        w.flush()
    b_src, p_src = gr.open_source(bounded), gr.open_source(plain)
    assert len(b_src) == len(p_src) == live
    batches = 50 if live <= 50_000 else 200
    rate_b, rate_p = _rates([b_src, p_src], batches, repeats, False)
    t = time.perf_counter()
    prio_b, prio_p = _rates([b_src, p_src], batches, repeats, True)
    prio_wall = time.perf_counter() - t
    disk = _disk(bounded)
    out = {
        "live_rows": live,
        "inserted_rows": 10 * live,
        "segment_rows": segment_rows,
        "bounded_batches_per_s": rate_b,
        "plain_batches_per_s": rate_p,
        "uniform_ratio": rate_b / rate_p,
        "bounded_prioritized_batches_per_s": prio_b,
        "plain_prioritized_batches_per_s": prio_p,
        "prioritized_ratio": prio_b / prio_p,
        "prioritized_wall_s": prio_wall,
        "disk_bytes": disk,
        "live_bytes": live * ROW_BYTES,
        "disk_ratio": disk / (live * ROW_BYTES),
        "stated_slack": 2 * segment_rows / live,
    }
    log(
        f"  uniform sample+read after 10x capacity: bounded {rate_b:,.0f} / plain "
        f"{rate_p:,.0f} batches/s = {out['uniform_ratio']:.2f}; disk {out['disk_ratio']:.3f}"
        f" x live (slack allowed {out['stated_slack']:.3f})"
    )
    log(
        f"  prioritized sample+read+update after 10x capacity: bounded {prio_b:,.0f} / plain "
        f"{prio_p:,.0f} batches/s = {out['prioritized_ratio']:.2f}"
    )
    return out


_WRITER = r"""
import json, os, sys, time
sys.path.insert(0, {here!r})
from bench_common import transitions
import grain_replay as gr
path, wid, rows, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
data = transitions(1000, 0)
w = gr.ReplayWriter(path, capacity=rows, writer_id=wid)
w.append(data); w.flush()  # warm: the store, the first segment
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
append = flush = 0.0
t = time.perf_counter()
for _ in range(rows // 1000):
    a = time.perf_counter()
    w.append(data)
    b = time.perf_counter()
    w.flush()
    append, flush = append + b - a, flush + time.perf_counter() - b
loop = time.perf_counter() - t
t = time.perf_counter()
w.close()
print(json.dumps(dict(loop=loop, append=append, flush=flush, close=time.perf_counter() - t)),
      flush=True)
"""


def _run_writers(tmp: str, k: int, rows: int, attempt: int) -> tuple[float, dict[str, float]]:
    """Committed rows/s of ``k`` writer processes of ``rows`` rows each, timed from the
    moment all are ready (imports, the store and a first segment made) to the last one's
    exit; and the slowest writer's seconds in each phase (startup: spawn to ready)."""
    path = os.path.join(tmp, f"writers{k}-{attempt}")
    go = path + ".go"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), HERE]))
    code = _WRITER.format(here=HERE)
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, path, f"w{i}", str(rows), go],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(k)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    startup = time.perf_counter() - t
    t = time.perf_counter()
    open(go, "w").close()
    phases: dict[str, float] = {}
    for p in procs:
        assert p.stdout is not None
        for key, value in json.loads(p.stdout.readline()).items():
            phases[key] = max(phases.get(key, 0.0), value)
        p.wait()
    rate = k * rows / (time.perf_counter() - t)
    shutil.rmtree(path, ignore_errors=True)
    return rate, {"startup": startup, **phases}


_SYNCS = r"""
import os, sys, time
path, rounds, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
block = b"x" * (1000 * {row_bytes})
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
os.pwrite(fd, b"\0" * len(block) * rounds, 0)
os.fsync(fd)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
t = time.perf_counter()
for i in range(rounds):
    os.pwrite(fd, block, i * len(block))
    os.fdatasync(fd)
print(time.perf_counter() - t, flush=True)
os.close(fd)
"""


def _run_syncs(tmp: str, k: int, rounds: int, attempt: int) -> float:
    """``fdatasync``s per second of ``k`` processes at once, each overwriting its own
    pre-written file in place, 1,000 rows (525 kB) before each sync: what the disk itself
    gives a second process, with no file created, renamed or grown (no journal commit)."""
    go = os.path.join(tmp, f"syncs{k}-{attempt}.go")
    code = _SYNCS.format(row_bytes=ROW_BYTES)
    paths = [os.path.join(tmp, f"syncs{k}-{attempt}-{i}") for i in range(k)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, p, str(rounds), go], stdout=subprocess.PIPE, text=True
        )
        for p in paths
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    open(go, "w").close()
    slowest = 0.0
    for p in procs:
        assert p.stdout is not None
        slowest = max(slowest, float(p.stdout.readline()))
        p.wait()
    for path in [*paths, go]:
        os.unlink(path)
    return k * rounds / slowest


def memory_dir() -> str | None:
    """A folder on a memory file system (``/dev/shm``) with room for the writers case, or
    None: there ``fsync`` costs nothing, so the ratio shows the writers themselves."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize > 4 << 30 else None


def bench_writers(
    tmp: str, rows: int, repeats: int, log: Any, memory: str | None = None
) -> dict[str, Any]:
    """One writer, then two, ``repeats`` times interleaved (a shared machine's load moves
    between runs); medians of each. Also, in the same rounds: the disk's own ``fdatasync``
    rate with one and two processes (the ceiling that any commit protocol shares), and,
    when ``memory`` names a memory file system, the same writers there."""
    runs: dict[int, list[tuple[float, dict[str, float]]]] = {1: [], 2: []}
    syncs: dict[int, list[float]] = {1: [], 2: []}
    mem: dict[int, list[float]] = {1: [], 2: []}
    mem_tmp = tempfile.mkdtemp(prefix="bench_replay_store_", dir=memory) if memory else None
    try:
        for r in range(repeats):
            for k in (1, 2):
                runs[k].append(_run_writers(tmp, k, rows, r))
                syncs[k].append(_run_syncs(tmp, k, rows // 1000, r))
                if mem_tmp is not None:
                    mem[k].append(_run_writers(mem_tmp, k, rows, r)[0])
    finally:
        if mem_tmp is not None:
            shutil.rmtree(mem_tmp, ignore_errors=True)
    out: dict[str, Any] = {"rows_per_writer": rows, "repeats": repeats}
    out["disk_syncs_per_s"] = {str(k): statistics.median(v) for k, v in syncs.items()}
    out["disk_sync_ratio"] = statistics.median(b / a for a, b in zip(syncs[1], syncs[2]))
    if mem_tmp is not None:
        out["memory_rows_per_s"] = {str(k): statistics.median(v) for k, v in mem.items()}
        out["memory_ratio"] = statistics.median(b / a for a, b in zip(mem[1], mem[2]))
    for k, name in ((1, "one"), (2, "two")):
        out[f"{name}_rows_per_s"] = statistics.median(rate for rate, _ in runs[k])
        out[f"{name}_phases_s"] = {
            key: statistics.median(ph[key] for _, ph in runs[k]) for key in runs[k][0][1]
        }
    out["ratio"] = statistics.median(
        two[0] / one[0] for one, two in zip(runs[1], runs[2], strict=True)
    )
    one, two = out["one_rows_per_s"], out["two_rows_per_s"]
    log(
        f"  writers (flush every 1,000 rows, {rows:,} rows each, median of {repeats}): "
        f"1 {one:,.0f} rows/s, 2 {two:,.0f} rows/s, ratio {out['ratio']:.2f}"
    )
    for name in ("one", "two"):
        ph = out[f"{name}_phases_s"]
        log(
            f"    {name}: startup {ph['startup']:.2f} s, append {ph['append']:.2f} s, "
            f"flush {ph['flush']:.2f} s, close {ph['close']:.3f} s (of {ph['loop']:.2f} s)"
        )
    s1, s2 = out["disk_syncs_per_s"]["1"], out["disk_syncs_per_s"]["2"]
    log(
        f"    the disk alone (in-place write + fdatasync of 1,000 rows): 1 process {s1:,.0f}"
        f" syncs/s, 2 processes {s2:,.0f} syncs/s, ratio {out['disk_sync_ratio']:.2f}"
    )
    if "memory_ratio" in out:
        m = out["memory_rows_per_s"]
        log(
            f"    the same writers on {memory} (fsync free): 1 {m['1']:,.0f} rows/s, "
            f"2 {m['2']:,.0f} rows/s, ratio {out['memory_ratio']:.2f}"
        )
    return out


def bench_refresh(tmp: str, parts: int, rows: int, repeats: int, log: Any) -> dict[str, Any]:
    import grain_replay as gr

    path = os.path.join(tmp, f"parts{parts}")
    writers = [gr.ReplayWriter(path, capacity=rows, writer_id=f"a{i:03d}") for i in range(parts)]
    for i, w in enumerate(writers):
        w.append(transitions(rows, i))
        w.flush()
    gc.collect()
    before = _rss_mb()
    src = gr.open_source(path)
    src.read_batch(np.arange(len(src)))  # touch every page once
    memory = _rss_mb() - before
    times, idle = [], []
    for r in range(repeats * 4):
        w = writers[r % parts]
        w.append(transitions(10, r))
        w.flush()
        t = time.perf_counter()
        src.refresh()
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        src.refresh()
        idle.append(time.perf_counter() - t)
    rate = _batches_per_s(src, 50, repeats)
    for w in writers:
        w.close()
    out = {
        "parts": parts,
        "rows_per_part": rows,
        "refresh_ms": 1e3 * statistics.median(times),
        "refresh_unchanged_ms": 1e3 * statistics.median(idle),
        "reader_memory_mb": memory,
        "batches_per_s": rate,
    }
    log(
        f"  {parts:3d} parts: refresh {out['refresh_ms']:.2f} ms (nothing new "
        f"{out['refresh_unchanged_ms']:.2f} ms), reader memory {memory:.1f} MB, "
        f"{rate:,.0f} batches/s"
    )
    return out


CASES = ("eviction", "writers", "refresh")


def run_all(
    quick: bool,
    live: int | None,
    log: Any,
    cases: tuple[str, ...] = CASES,
    repeats: int | None = None,
    writer_rows: int | None = None,
) -> dict[str, Any]:
    live = live or (20_000 if quick else 1_000_000)
    repeats = repeats or (3 if quick else 5)
    tmp = tempfile.mkdtemp(prefix="bench_replay_store_")
    try:
        out: dict[str, Any] = {}
        if "eviction" in cases:
            out["eviction"] = bench_eviction(tmp, live, repeats, log)
        if "writers" in cases:
            rows = writer_rows or (20_000 if quick else 600_000)
            out["writers"] = bench_writers(tmp, rows, min(repeats, 3), log, memory_dir())
        if "refresh" in cases:
            out["refresh"] = [
                bench_refresh(tmp, k, 500 if quick else 4000, repeats, log) for k in (1, 8, 64)
            ]
            r = out["refresh"]
            out["refresh_64_over_1"] = r[-1]["refresh_ms"] / r[0]["refresh_ms"]
            log(f"  refresh at 64 parts / at 1 part: {out['refresh_64_over_1']:.1f}x")
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_store(cfg: Any, stores: Any, res: Any, log: Any) -> None:
    """The ``store`` section of benchmarks/run.py."""
    from bench_common import Ratio

    out = run_all(cfg.quick, None, log)
    res.extra["replay_store"] = out
    ev = out["eviction"]
    res.ratios.append(
        Ratio("store: uniform bounded / plain", "bounded", "plain", ev["uniform_ratio"], 0.9)
    )
    res.ratios.append(
        Ratio(
            "store: prioritized bounded / plain",
            "bounded",
            "plain",
            ev["prioritized_ratio"],
            0.9,
        )
    )
    res.ratios.append(
        Ratio(
            "store: 1.1 x (live + slack) / disk",
            "live",
            "disk",
            1.1 * (1 + ev["stated_slack"]) / ev["disk_ratio"],
            1.0,
        )
    )
    wr = out["writers"]
    res.ratios.append(Ratio("store: 2 writers / 1 writer", "2", "1", wr["ratio"], 1.6))
    res.ratios.append(
        Ratio("store: the disk's fdatasyncs, 2 processes / 1", "2", "1", wr["disk_sync_ratio"])
    )
    if "memory_ratio" in wr:
        res.ratios.append(
            Ratio("store: 2 writers / 1 writer, /dev/shm", "2", "1", wr["memory_ratio"], 1.6)
        )
    res.ratios.append(
        Ratio("store: 10 x refresh@1 / refresh@64", "1", "64", 10 / out["refresh_64_over_1"], 1.0)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--live", type=int, default=None, help="live rows of the eviction case")
    p.add_argument("--out", default=None, help="write results.json here")
    p.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}"
    )
    p.add_argument("--repeats", type=int, default=None, help="interleaved runs per case")
    p.add_argument(
        "--writer-rows",
        type=int,
        default=None,
        help="rows of each writer of the writers case (a multiple of 1,000)",
    )
    args = p.parse_args(argv)
    cases = tuple(c for c in args.cases.split(",") if c)
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    if args.writer_rows is not None and (args.writer_rows <= 0 or args.writer_rows % 1000):
        p.error(f"--writer-rows must be a positive multiple of 1000, got {args.writer_rows}")
    t0 = time.perf_counter()
    out = run_all(
        args.quick,
        args.live,
        lambda m: print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True),
        cases,
        args.repeats,
        args.writer_rows,
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "replay_store.json"), "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
