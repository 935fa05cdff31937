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

``--store s3``: the many-writer store on a local moto S3 server (its own process,
tests/helpers/s3_server.py) beside the same on the local disk, in one run:

- committed rows/s of 1, 4 and 16 writer processes (flush every 1,000 rows; all rows
  over the time from go to the last ``flush()`` returned), each over one writer
  (target: 16 >= 8x) and S3 over disk;
- commit -> sampleable: 4 writers flushing every 100 ms, a reader refreshing in a
  loop; from ``flush()`` being called to the end of the first ``refresh()`` that holds
  the rows (median, p99);
- uniform ``sample + read`` of batch 256, warm, S3 over disk (target >= 0.5), and
  the GETs a batch costs (counted at a proxy);
- the server alone: requests/s of 1, 4 and 16 boto3 processes PUTting a flush's two
  objects (no grain_replay): whether the server or the writers are the ceiling.

Usage::

    python benchmarks/bench_replay_store.py [--quick] [--live C] [--out DIR]
        [--cases eviction,writers,refresh] [--repeats R] [--writer-rows N]
    python benchmarks/bench_replay_store.py --store s3 [--quick]
        [--cases writers,latency,sample,server] [--repeats R] [--writer-rows N] [--live C]
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


def _rates(
    sources: list[Any], batches: int, repeats: int, prioritized: bool, block: int = 0
) -> list[float]:
    """Batches/s of each source: the median over ``repeats * batches / BLOCK`` blocks of
    ``BLOCK`` batches, the sources' blocks interleaved, so that a change of the
    machine's load (a shared machine's load moves within a second) hits all alike."""
    block = block or BLOCK
    steps = [_stepper(src, prioritized, batches * repeats) for src in sources]
    times: list[list[float]] = [[] for _ in sources]
    k = 0
    for _ in range(repeats * max(1, batches // block)):
        for step, out in zip(steps, times):
            t = time.perf_counter()
            for j in range(k, k + block):
                step(j)
            out.append((time.perf_counter() - t) / block)
        k += block
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
opts = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
period = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
kw = dict(storage_options=opts) if opts else {{}}
data = transitions(1000, 0)
w = gr.ReplayWriter(path, capacity=rows, writer_id=wid, **kw)
w.append(data); w.flush()  # warm: the store, the first segment
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
append = flush = 0.0
commits = []
t = time.perf_counter()
for i in range(rows // 1000):
    if period:  # a fixed cadence: one flush of 1,000 rows every `period` seconds
        time.sleep(max(0.0, t + i * period - time.perf_counter()))
    a = time.perf_counter()
    w.append(data)
    b = time.perf_counter()
    asked = time.time()  # wall clock: flush() called (its rows become visible inside it)
    w.flush()
    commits.append((1000 * (i + 2), asked, time.time()))  # rows committed, called, returned
    append, flush = append + b - a, flush + time.perf_counter() - b
loop = time.perf_counter() - t
t = time.perf_counter()
w.close()
print(json.dumps(dict(loop=loop, append=append, flush=flush, close=time.perf_counter() - t,
                      commits=commits)), flush=True)
"""


def _run_writers(
    tmp: str,
    k: int,
    rows: int,
    attempt: int,
    url: str | None = None,
    options: dict[str, Any] | None = None,
    period: float = 0.0,
    watch: Any = None,
) -> tuple[float, dict[str, float]]:
    """Committed rows/s of ``k`` writer processes of ``rows`` rows each, timed from the
    moment all are ready (imports, the store and a first segment made) to the last one's
    exit; and the slowest writer's seconds in each phase (startup: spawn to ready).

    ``url``/``options``: the store on object storage (else a folder under ``tmp``);
    ``period``: a flush every ``period`` s; ``watch(procs)``: called in a loop while the
    writers run (a reader), and then with each writer's commits ``[(rows, wall time
    flush() was called, wall time it returned)]`` as ``watch(None, {writer_id: commits})``."""
    path = url or os.path.join(tmp, f"writers{k}-{attempt}")
    go = os.path.join(tmp, f"writers{k}-{attempt}-{time.time_ns()}.go")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), HERE]))
    code = _WRITER.format(here=HERE)
    extra = [json.dumps(options or {}), str(period)]
    t = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, path, f"w{i}", str(rows), go, *extra],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(k)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    startup = time.perf_counter() - t
    if watch is not None:
        watch(procs)  # the reader opened before the writers go
    t = time.perf_counter()
    wall = time.time()
    open(go, "w").close()
    if watch is not None:
        while any(p.poll() is None for p in procs):
            watch(procs)
    phases: dict[str, float] = {}
    commits: dict[str, list[tuple[int, float, float]]] = {}
    for i, p in enumerate(procs):
        assert p.stdout is not None
        line = p.stdout.readline()
        assert p.wait() == 0 and line, f"writer w{i} failed (exit {p.returncode})"
        for key, value in json.loads(line).items():
            if key == "commits":
                commits[f"w{i}"] = [(int(c), float(a), float(r)) for c, a, r in value]
            else:
                phases[key] = max(phases.get(key, 0.0), value)
    rate = k * rows / (time.perf_counter() - t)
    # go -> the last flush() returned: the same rows over the time to commit them alone
    # (a writer's close and its interpreter's exit left out)
    phases["to_last_commit"] = max(c[-1][2] for c in commits.values()) - wall
    os.unlink(go)
    if url is None:
        shutil.rmtree(path, ignore_errors=True)
    if watch is not None:
        watch(None, commits)
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


# -- on object storage (--store s3): a local moto S3 server against the local disk ------

S3_CASES = ("writers", "latency", "sample", "server")
S3_WRITERS = (1, 4, 16)
BUCKET = "bench-replay"


def _s3_server() -> Any:
    """moto's S3 on 127.0.0.1 in its own process (its GIL is not ours), a bucket made;
    tests/helpers/s3_server.py, as the tests start it."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "helpers"))
    from s3_server import S3Server, moto_unavailable_reason

    reason = moto_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--store s3: {reason}")
    server = S3Server(subprocess=True).start()
    server.create_bucket(BUCKET)
    return server


def _s3_drop(server: Any, prefix: str) -> None:
    """Deletes every object under ``prefix`` (moto keeps them in memory)."""
    client = server.client()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})


def bench_s3_writers(
    tmp: str, server: Any, rows: int, repeats: int, log: Any, counts: tuple[int, ...]
) -> dict[str, Any]:
    """Committed rows/s of ``counts`` writer processes (flush every 1,000 rows) on the S3
    server and on the local disk, ``repeats`` rounds interleaved: all rows over the time
    from go to the last ``flush()`` returned; medians, and the median of each round's
    ratio k / 1."""
    rates: dict[str, dict[int, list[float]]] = {"s3": {}, "disk": {}}
    flush_s: dict[int, list[float]] = {}
    for r in range(repeats):
        for k in counts:
            prefix = f"writers{k}-{r}"
            _, phases = _run_writers(
                tmp, k, rows, r, f"s3://{BUCKET}/{prefix}", server.storage_options()
            )
            rates["s3"].setdefault(k, []).append(k * rows / phases["to_last_commit"])
            flush_s.setdefault(k, []).append(phases["flush"] / (rows // 1000))
            _s3_drop(server, prefix)
            _, phases = _run_writers(tmp, k, rows, r)
            rates["disk"].setdefault(k, []).append(k * rows / phases["to_last_commit"])
    out: dict[str, Any] = {"rows_per_writer": rows, "repeats": repeats}
    out["s3_requests_per_flush"] = _requests_per_flush(server)
    for side, by_k in rates.items():
        out[f"{side}_rows_per_s"] = {str(k): statistics.median(v) for k, v in by_k.items()}
        out[f"{side}_ratio_over_1"] = {
            str(k): statistics.median(a / b for a, b in zip(v, by_k[1])) for k, v in by_k.items()
        }
    out["s3_flush_ms"] = {str(k): 1e3 * statistics.median(v) for k, v in flush_s.items()}
    out["s3_over_disk"] = {
        str(k): statistics.median(
            a / b for a, b in zip(rates["s3"][k], rates["disk"][k], strict=True)
        )
        for k in counts
    }
    log(
        f"  writers (flush every 1,000 rows, {rows:,} rows each, median of {repeats}; "
        "committed rows/s):"
    )
    per = out["s3_requests_per_flush"]
    out["s3_requests_per_s"] = {
        key: rate / 1000 * sum(per.values()) for key, rate in out["s3_rows_per_s"].items()
    }
    for k in counts:
        key = str(k)
        log(
            f"    {k:2d} writer(s): s3 {out['s3_rows_per_s'][key]:,.0f} "
            f"(x{out['s3_ratio_over_1'][key]:.2f} of 1; a flush {out['s3_flush_ms'][key]:.0f} ms)"
            f", disk {out['disk_rows_per_s'][key]:,.0f} (x{out['disk_ratio_over_1'][key]:.2f}"
            f" of 1); s3 / disk {out['s3_over_disk'][key]:.2f}"
        )
    log(
        "    a flush sends "
        + ", ".join(f"{v:g} {m}" for m, v in per.items())
        + " (counted at a proxy): s3 writers' requests/s "
        + ", ".join(f"{k} {out['s3_requests_per_s'][str(k)]:,.0f}" for k in counts)
    )
    return out


def _requests_per_flush(server: Any, flushes: int = 5) -> dict[str, float]:
    """The requests (by method) one writer's ``flush()`` of 1,000 rows sends, counted at a
    proxy in front of the server (a store of one writer, so every LIST is its smallest)."""
    from s3_server import HTTPProxy, s3_storage_options

    import grain_replay as gr

    data = transitions(1000, 0)
    with HTTPProxy(server.port) as proxy:
        opts = s3_storage_options(proxy.endpoint_url)
        with gr.ReplayWriter(
            f"s3://{BUCKET}/counted", capacity=10_000, writer_id="w0", storage_options=opts
        ) as w:
            w.append(data)
            w.flush()
            with proxy.counting() as got:
                for _ in range(flushes):
                    w.append(data)
                    w.flush()
    _s3_drop(server, "counted")
    return {k: v / flushes for k, v in sorted(got.items()) if v}


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _latency_run(
    tmp: str, k: int, flushes: int, period: float, attempt: int, url: str | None, opts: Any
) -> tuple[list[float], list[float]]:
    """``k`` writers flushing 1,000 rows every ``period`` s while this process refreshes a
    reader in a loop: for each commit, the seconds from its ``flush()`` being called (the
    writer's wall clock) to the end of the first ``refresh()`` whose snapshot holds it;
    and the seconds of each refresh.

    From the call, not the return: the rows become visible inside ``flush()``, so a
    reader polling in a loop often holds them before the writer's clock reads its
    return (a loaded machine: medians below zero on the disk, CI 2026-12-07)."""
    import grain_replay as gr

    state: dict[str, Any] = {"src": None, "seen": {}, "refresh": [], "lat": []}

    def watch(procs: Any, commits: Any = None) -> None:
        if procs is None:  # the writers are done: match each commit to the first poll
            for wid, got in commits.items():
                polls = state["seen"].get(wid, [])
                for rows, asked, _ in got:
                    seen = next((t for t, c in polls if c >= rows), None)
                    if seen is not None:
                        state["lat"].append(seen - asked)
            return
        if state["src"] is None:
            state["src"] = gr.open_source(url or path, storage_options=opts)
        t = time.perf_counter()
        state["src"].refresh()
        state["refresh"].append(time.perf_counter() - t)
        now = time.time()
        for m in state["src"].writers:
            state["seen"].setdefault(m.writer_id, []).append((now, m.committed))

    path = os.path.join(tmp, f"writers{k}-{attempt}")  # _run_writers' folder on disk
    _run_writers(tmp, k, 1000 * flushes, attempt, url, opts, period, watch)
    return state["lat"], state["refresh"]


def bench_s3_latency(
    tmp: str, server: Any, k: int, flushes: int, period: float, repeats: int, log: Any
) -> dict[str, Any]:
    """Commit -> sampleable latency, on the S3 server and on the local disk."""
    lat: dict[str, list[float]] = {"s3": [], "disk": []}
    ref: dict[str, list[float]] = {"s3": [], "disk": []}
    for r in range(repeats):
        prefix = f"latency-{r}"
        a, b = _latency_run(
            tmp, k, flushes, period, r, f"s3://{BUCKET}/{prefix}", server.storage_options()
        )
        lat["s3"] += a
        ref["s3"] += b
        _s3_drop(server, prefix)
        a, b = _latency_run(tmp, k, flushes, period, 100 + r, None, None)
        lat["disk"] += a
        ref["disk"] += b
    out: dict[str, Any] = {"writers": k, "flushes": flushes, "period_s": period}
    for side in ("s3", "disk"):
        out[side] = {
            "commits": len(lat[side]),
            "median_ms": 1e3 * _percentile(lat[side], 50),
            "p99_ms": 1e3 * _percentile(lat[side], 99),
            "refresh_median_ms": 1e3 * _percentile(ref[side], 50),
        }
    out["median_ratio"] = out["s3"]["median_ms"] / out["disk"]["median_ms"]
    log(
        f"  commit -> sampleable ({k} writers, a flush of 1,000 rows every {period * 1e3:.0f}"
        f" ms, a reader refreshing in a loop; {repeats} runs pooled):"
    )
    for side in ("s3", "disk"):
        o = out[side]
        log(
            f"    {side:4s}: median {o['median_ms']:.1f} ms, p99 {o['p99_ms']:.1f} ms over "
            f"{o['commits']} commits (a refresh {o['refresh_median_ms']:.1f} ms)"
        )
    log(f"    s3 / disk (medians): {out['median_ratio']:.1f}")
    return out


def bench_s3_sample(
    tmp: str, server: Any, live: int, batches: int, repeats: int, log: Any
) -> dict[str, Any]:
    """Uniform ``sample + read`` of batch 256 over ``live`` rows written by one writer
    (flush every 1,000 rows) into the bucket and onto the local disk; warm readers, the
    two sources' blocks of 2 batches interleaved."""
    import grain_replay as gr

    url, folder = f"s3://{BUCKET}/sample", os.path.join(tmp, "sample")
    opts = server.storage_options()
    for where, kw in ((url, {"storage_options": opts}), (folder, {})):
        with gr.ReplayWriter(where, capacity=live, writer_id="actor-0", **kw) as w:
            for start in range(0, live, 1000):
                w.append(transitions(min(1000, live - start), start))
                w.flush()
    s3_src, disk_src = gr.open_source(url, storage_options=opts), gr.open_source(folder)
    assert len(s3_src) == len(disk_src) == live
    rate_s3, rate_disk = _rates([s3_src, disk_src], batches, repeats, False, block=2)
    # requests a batch costs, counted at the wire through a proxy (not in the timing)
    from s3_server import HTTPProxy, s3_storage_options

    with HTTPProxy(server.port) as proxy:
        counted = gr.open_source(url, storage_options=s3_storage_options(proxy.endpoint_url))
        it = iter(gr.make_data_loader(counted, batch_size=BATCH, seed=1,
                                      sampling=gr.UniformReplay(refresh_every=None)))  # fmt: skip
        next(it)
        with proxy.counting() as got:
            for _ in range(3):
                next(it)
    gets = got["GET"] / 3
    out = {
        "live_rows": live,
        "gets_per_batch": gets,
        "s3_batches_per_s": rate_s3,
        "disk_batches_per_s": rate_disk,
        "ratio": rate_s3 / rate_disk,
    }
    log(
        f"  uniform sample+read, batch {BATCH}, {live:,} rows, warm: s3 {rate_s3:,.1f} / disk "
        f"{rate_disk:,.0f} batches/s = {out['ratio']:.4f} ({gets:,.0f} GETs a batch)"
    )
    _s3_drop(server, "sample")
    return out


_PUTS = r"""
import os, sys, time, boto3
url, bucket, prefix, rounds, go, lists = sys.argv[1:7]
lists = int(lists)
c = boto3.client("s3", endpoint_url=url, aws_access_key_id="testing-key",
                 aws_secret_access_key="testing-secret", region_name="us-east-1")
piece, manifest = b"x" * (1000 * {row_bytes}), b"{{}}" * 300
c.put_object(Bucket=bucket, Key=prefix + "/warm", Body=b"")
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
t = time.perf_counter()
for i in range(int(rounds)):
    c.put_object(Bucket=bucket, Key=f"{{prefix}}/pieces/{{i}}", Body=piece)
    c.put_object(Bucket=bucket, Key=f"{{prefix}}/manifests/{{i}}", Body=manifest,
                 IfNoneMatch="*")
    for _ in range(lists):  # a flush's listings (versions, pieces, the lease)
        c.list_objects_v2(Bucket=bucket, Prefix=prefix + "/manifests/")
print(time.perf_counter() - t, flush=True)
"""


def _run_puts(tmp: str, server: Any, k: int, rounds: int, attempt: int, lists: int) -> float:
    """Requests/s the S3 server answers to ``k`` boto3 processes at once, each sending
    ``rounds`` x (a 525 kB PUT, a 1 kB PUT by conditional create, ``lists`` LISTs): a
    flush's requests, no grain_replay."""
    go = os.path.join(tmp, f"puts{k}-{attempt}.go")
    code = _PUTS.format(row_bytes=ROW_BYTES)
    args = [server.endpoint_url, BUCKET, f"puts{k}-{attempt}", str(rounds), go, str(lists)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args[:2], f"{args[2]}/{i}", *args[3:]],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(k)
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    open(go, "w").close()
    slowest = 0.0
    for p in procs:
        assert p.stdout is not None
        slowest = max(slowest, float(p.stdout.readline()))
        assert p.wait() == 0
    os.unlink(go)
    _s3_drop(server, f"puts{k}-{attempt}")
    return (2 + lists) * k * rounds / slowest


def bench_s3_server(
    tmp: str,
    server: Any,
    rounds: int,
    repeats: int,
    log: Any,
    counts: tuple[int, ...],
    lists: int = 3,
) -> dict[str, Any]:
    """The server alone: its request rate with ``counts`` client processes sending a
    flush's requests (2 PUTs, ``lists`` LISTs)."""
    got: dict[int, list[float]] = {}
    for r in range(repeats):
        for k in counts:
            got.setdefault(k, []).append(_run_puts(tmp, server, k, rounds, r, lists))
    out: dict[str, Any] = {
        "rounds": rounds,
        "lists_per_round": lists,
        "requests_per_s": {str(k): statistics.median(v) for k, v in got.items()},
        "ratio_over_1": {
            str(k): statistics.median(a / b for a, b in zip(v, got[1])) for k, v in got.items()
        },
    }
    log(
        f"  the S3 server alone (boto3 clients, each {rounds} x (a 525 kB PUT, a conditional"
        f" 1 kB PUT, {lists} LISTs), median of {repeats}):"
    )
    for k in counts:
        log(
            f"    {k:2d} client(s): {out['requests_per_s'][str(k)]:,.0f} requests/s "
            f"(x{out['ratio_over_1'][str(k)]:.2f} of 1)"
        )
    return out


def run_s3(
    quick: bool,
    log: Any,
    cases: tuple[str, ...] = S3_CASES,
    repeats: int | None = None,
    writer_rows: int | None = None,
    live: int | None = None,
) -> dict[str, Any]:
    """``--store s3``: each case on the local S3 server and on the local disk, one run."""
    repeats = repeats or (1 if quick else 3)
    counts = (1, 2) if quick else S3_WRITERS
    tmp = tempfile.mkdtemp(prefix="bench_replay_store_")
    server = _s3_server()
    log(f"  moto S3 server (its own process) at {server.endpoint_url}")
    try:
        out: dict[str, Any] = {}
        if "writers" in cases:
            rows = writer_rows or (2000 if quick else 20_000)
            out["writers"] = bench_s3_writers(tmp, server, rows, repeats, log, counts)
        if "latency" in cases:
            out["latency"] = bench_s3_latency(
                tmp, server, 1 if quick else 4, 3 if quick else 30, 0.1, repeats, log
            )
        if "sample" in cases:
            out["sample"] = bench_s3_sample(
                tmp, server, live or (5000 if quick else 20_000), 4 if quick else 10, repeats,
                log,
            )  # fmt: skip
        if "server" in cases:
            per = out.get("writers", {}).get("s3_requests_per_flush", {})
            out["server"] = bench_s3_server(
                tmp, server, 2 if quick else 20, repeats, log, counts, int(per.get("GET", 3))
            )
        if "writers" in out and "server" in out:
            most = str(counts[-1])
            used = out["writers"]["s3_requests_per_s"][most] / max(
                out["server"]["requests_per_s"].values()
            )
            out["server_share_used"] = used
            log(
                f"  {most} s3 writers' requests/s / the most the server answered alone: "
                f"{used:.2f} ({'the server is' if used >= 0.8 else 'the writers are'} the limit)"
            )
        return out
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


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
        "--store",
        choices=("disk", "s3"),
        default="disk",
        help="s3: the many-writer store on a local moto S3 server beside the same on disk",
    )
    p.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated subset of {','.join(CASES)} (--store s3: {','.join(S3_CASES)})",
    )
    p.add_argument("--repeats", type=int, default=None, help="interleaved runs per case")
    p.add_argument(
        "--writer-rows",
        type=int,
        default=None,
        help="rows of each writer of the writers case (a multiple of 1,000)",
    )
    args = p.parse_args(argv)
    choices = S3_CASES if args.store == "s3" else CASES
    cases = tuple(c for c in (args.cases or ",".join(choices)).split(",") if c)
    unknown = sorted(set(cases) - set(choices))
    if unknown:
        p.error(f"--cases: unknown {unknown}; choose from {list(choices)}")
    if args.writer_rows is not None and (args.writer_rows <= 0 or args.writer_rows % 1000):
        p.error(f"--writer-rows must be a positive multiple of 1000, got {args.writer_rows}")
    t0 = time.perf_counter()

    def log(m: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {m}", flush=True)

    if args.store == "s3":
        out = run_s3(args.quick, log, cases, args.repeats, args.writer_rows, args.live)
    else:
        out = run_all(args.quick, args.live, log, cases, args.repeats, args.writer_rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "replay_store_s3.json" if args.store == "s3" else "replay_store.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
