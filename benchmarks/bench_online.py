"""The online loop: inserts from writer processes, prioritized sampling while they write, and
commit -> sampleable latency, against Reverb and torchrl, as ratios measured in one run.

Every case uses transitions of 525 B (obs and next_obs f32[64], action, reward, done),
writers appending 64 envs' steps at a time, a capacity of 1M rows and batches of 256:

- **inserts** from 1 and 2 writer processes: grain_replay's
  ``ReplayWriter(path, capacity=1M / K, writer_id=...)`` with ``flush()`` (the
  durability barrier: ``fsync``) every 1,024 rows, against Reverb (a server on
  127.0.0.1, ``TrajectoryWriter`` clients, one item per transition, ``flush()``
  every 1,024 items) and torchrl (``ReplayBuffer(LazyMemmapStorage(1M),
  shared=True)``, ``extend`` from each writer process). Targets: >= 20x Reverb,
  >= 2x torchrl. Ours on ``/dev/shm`` (a flush costs no disk) is reported beside.
- **prioritized sample + read** of 256 rows while 2 writers insert (paced, the same
  rows/s for every system): ``gr.PrioritizedReplay`` over the bounded store,
  Reverb's prioritized table through ``TrajectoryDataset.batch(256)``, torchrl's
  ``TensorDictPrioritizedReplayBuffer(shared=True, sync=False)``. Targets:
  >= 10x Reverb, >= 3x torchrl.
- **commit -> sampleable latency**: a writer process commits 64 rows at a time at
  random gaps and notes when each ``flush()`` was called (``time.monotonic``, one
  clock for every process of the machine; the rows become visible inside the flush,
  so its return could come after a reader already holds them); this process iterates a loader with
  ``gr.UniformReplay()`` (the default refresh: a look every 16 batches) back to back,
  as a learner would, and notes when the length its sampler draws below (the
  ``sampler`` state of ``get_state()``) first covers each commit. Targets: median
  <= 20 ms, p99 <= 200 ms. The look interval is 16 batches of the reader's own
  pace: a learner that trains between batches sees rows later (reported).
- **limiter accuracy** and **device writes**: ``bench_rate_limit.run(quick)`` and
  ``bench_device_writes.run(quick)`` when those modules exist.

The peers run in their own virtual environments (``bench_online_peers.py``, after
ours: never two systems at once on a small machine). Usage::

    python benchmarks/bench_online.py [--quick] [--reverb-python P] [--torchrl-python P]
    python benchmarks/run.py --quick --sections online
    make bench-online-peers
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_common  # noqa: E402
from bench_common import PeerError, time_calls, transitions  # noqa: E402
from bench_online_peers import write_loop  # noqa: E402

# The repo-local venvs `make bench-online-peers` builds.
DEFAULT_REVERB = HERE.parent / ".venv-reverb" / "bin" / "python"
DEFAULT_TORCHRL = HERE.parent / ".venv-peers" / "bin" / "python"
ENVS, FLUSH_ROWS, CAPACITY, BATCH = 64, 1024, 1_000_000, 256


@dataclasses.dataclass
class Params:
    quick: bool
    rows: int  # rows per writer, inserts (ours)
    peer_rows: int  # rows per writer, inserts (the peers: Reverb takes ~0.1 ms a row)
    prefill: int  # rows before the sample case starts
    rate: float  # rows/s per writer while the sampler draws
    repeats: int
    per_repeat: int
    commits: int  # latency case
    peer_writers: tuple[int, ...]

    @classmethod
    def make(cls, quick: bool) -> Params:
        if quick:
            return cls(True, 4096, 2048, 4096, 1000.0, 3, 5, 15, (1,))
        return cls(False, 200_704, 20_480, 51_200, 1500.0, 7, 40, 200, (1, 2))


# -- grain_replay's writers ----------------------------------------------------


def _our_writer(
    path: str, wid: str, capacity: int, cfg: dict[str, Any], seed: int,
    ready: Any, go: Any, stop: Any, out: Any,
) -> None:  # fmt: skip
    import grain_replay as gr

    data = transitions(cfg["envs"], seed)
    w = gr.ReplayWriter(path, capacity=capacity, writer_id=wid)
    w.append(data)
    w.flush()
    ready.set()
    write_loop(lambda: w.append(data), w.flush, cfg, go, stop, out)
    w.close()


class OurWriters:
    """K writer processes of one bounded store (ids ``w0``..., capacity 1M / K each)."""

    def __new__(cls, path: str, k: int, cfg: dict[str, Any]) -> Any:
        from bench_online_peers import Writers

        capacity = CAPACITY // k
        return Writers(_our_writer, [(path, f"w{i}", capacity, cfg, i) for i in range(k)])


def bench_inserts(root: str, p: Params, log: Any) -> list[dict[str, Any]]:
    out = []
    places = [("disk", root)]
    if not p.quick and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        places.append(("tmpfs", "/dev/shm"))
    for where, base in places:
        for k in (1, 2):
            path = tempfile.mkdtemp(prefix=f"online_inserts{k}_", dir=base)
            try:
                cfg = {"envs": ENVS, "rows": p.rows, "flush_rows": FLUSH_ROWS, "rate": None}
                w = OurWriters(path, k, cfg)
                t = w.start()
                each = w.join()
                wall = time.perf_counter() - t
            finally:
                shutil.rmtree(path, ignore_errors=True)
            rows = sum(r["rows"] for r in each)
            flush = statistics.mean(r["flush_s"] / r["s"] for r in each)
            out.append(
                {
                    "where": where,
                    "writers": k,
                    "rows": rows,
                    "s": wall,
                    "rows_per_s": rows / wall,
                    "flush_fraction": flush,
                }
            )
            log(
                f"  ours, {k} writer(s) on {where}: {rows / wall:,.0f} rows/s "
                f"({100 * flush:.0f}% of the time in flush)"
            )
    return out


def _prioritized_loader(path: str) -> Any:
    """A prioritized loader's iterator over the store at ``path``, its first batch drawn."""
    import grain_replay as gr

    it = iter(
        gr.make_data_loader(gr.open_source(path), batch_size=BATCH, sampling=gr.PrioritizedReplay())
    )
    next(it)
    return it


def bench_sample(root: str, p: Params, log: Any) -> dict[str, Any]:
    """Prioritized sample + read while 2 writers insert (see the module docstring)."""
    import grain_replay as gr

    cfg = {
        "envs": ENVS,
        "fill_rows": -(-p.prefill // 2),
        "rows": None,
        "flush_rows": FLUSH_ROWS,
        "rate": p.rate,
    }
    path = os.path.join(root, "online_sample")
    store = "bounded store, 2 writers"
    w = OurWriters(path, 2, cfg)
    try:
        # The loader exists (imports paid) before the clock: the store holds the
        # writers' first rows; after the prefill it looks again at its next draw.
        it = _prioritized_loader(path)
        t = time.perf_counter()
        t0 = w.start()
        prefill_s = t0 - t
        it.refresh()
        start_rows = len(gr.open_source(path))

        def draw() -> None:
            batch = next(it)
            assert batch.data["obs"].shape == (BATCH, 64)

        repeats = time_calls(draw, p.repeats, p.per_repeat, warmup=5)
        each = w.join(stop=True)
        end_rows = len(gr.open_source(path))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    inserted = sum(r["rows"] for r in each)
    out = {
        "store": store,
        "batch_s": repeats,
        "samples_per_s": BATCH / statistics.median(repeats),
        "prefill_s": prefill_s,
        "rows_at_start": start_rows,
        "rows_at_end": end_rows,
        "inserted_while_sampling": inserted,
        "insert_rows_per_s": inserted / max(r["s"] for r in each),
    }
    log(
        f"  ours: PER sample+read {out['samples_per_s']:,.0f} samples/s while writers insert "
        f"{out['insert_rows_per_s']:,.0f} rows/s ({store})"
    )
    return out


def bench_latency(root: str, p: Params, log: Any) -> dict[str, Any]:
    """Commit -> sampleable: flush() is called in a writer process -> this loader can draw it."""
    import grain_replay as gr

    path = tempfile.mkdtemp(prefix="online_latency_", dir=root)
    cfg = {
        "envs": ENVS,
        "fill_rows": 0,
        "rows": p.commits * ENVS,
        "flush_rows": ENVS,  # one commit per append
        "rate": None,
        "commits": True,
        "gap_s": (0.01, 0.04),
    }
    try:
        w = OurWriters(path, 1, cfg)  # ready: its first 64 rows are committed
        src = gr.open_source(path)
        it = iter(gr.make_data_loader(src, batch_size=BATCH, sampling=gr.UniformReplay()))
        for _ in range(32):  # the reader is warm before the first commit
            next(it)
        seen: list[tuple[int, float]] = []
        batches, last, t0 = 0, -1, time.perf_counter()
        results: list[dict[str, Any]] = []
        w.go.set()
        while True:
            next(it)
            batches += 1
            n = int(json.loads(it.get_state())["sampler"]["n"])
            if n != last:
                seen.append((n, time.monotonic()))
                last = n
            if not results:
                try:  # the writer's report: it has made its last commit
                    msg = w.out.get_nowait()
                    results = [msg] if "commits" in msg else []
                except queue.Empty:
                    pass
            if results and last >= results[0]["commits"][-1][0] + ENVS:
                break
            if time.perf_counter() - t0 > 300:
                raise RuntimeError(f"the reader saw {last} rows after 300 s: {results}")
        reader_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(path, ignore_errors=True)
    commits = results[0]["commits"]
    lat = []
    for rows, t in commits:
        # +64: the writer's first append (before ready) is in the store too.
        first = next((ts for n, ts in seen if n >= rows + ENVS), None)
        if first is not None:
            lat.append(first - t)
    ms = np.asarray(lat) * 1e3
    out = {
        "commits": len(commits),
        "measured": len(lat),
        "median_ms": float(np.median(ms)),
        "p99_ms": float(np.percentile(ms, 99)),
        "max_ms": float(ms.max()),
        "min_ms": float(ms.min()),
        "reader_batches_per_s": batches / reader_s,
        "look_every_ms": 16e3 * reader_s / batches,
    }
    log(
        f"  commit -> sampleable: median {out['median_ms']:.1f} ms, p99 {out['p99_ms']:.1f} ms, "
        f"max {out['max_ms']:.1f} ms over {len(lat)} commits; reader "
        f"{out['reader_batches_per_s']:,.0f} batches/s (a look every {out['look_every_ms']:.1f} ms)"
    )
    return out


# -- the peers ------------------------------------------------------------------


def run_peer(
    name: str, python: str | None, p: Params, scratch: str, log: Any, cases: str = "inserts,sample"
) -> dict[str, Any]:
    if not python:
        return {"skipped": "peers not asked for"}
    if not os.path.exists(python):
        return {"skipped": f"no venv at {python} (make bench-online-peers builds it)"}
    cmd = [
        python,
        str(HERE / "bench_online_peers.py"),
        f"--peer={name}",
        f"--cases={cases}",
        f"--writers={','.join(map(str, p.peer_writers))}",
        f"--rows={p.peer_rows}",
        f"--envs={ENVS}",
        f"--flush-rows={FLUSH_ROWS}",
        f"--capacity={CAPACITY}",
        f"--batch={BATCH}",
        f"--prefill={p.prefill}",
        f"--rate={p.rate}",
        f"--repeats={p.repeats}",
        f"--per-repeat={p.per_repeat}",
        f"--scratch={scratch}",
    ]
    t = time.perf_counter()
    try:
        last = bench_common.run_peer(cmd[0], cmd[1], cmd[2:], timeout=300 if p.quick else 1800)
        out: dict[str, Any] = json.loads(last)
    except (PeerError, ValueError) as e:
        return {"skipped": f"{name}: {e}"}
    out["wall_s"] = time.perf_counter() - t
    for row in out.get("inserts", []):
        log(f"  {name}, {row['writers']} writer(s): {row['rows_per_s']:,.0f} rows/s")
    if "sample" in out:
        s = out["sample"]
        log(
            f"  {name}: PER sample+read {s['samples_per_s']:,.0f} samples/s while writers "
            f"insert {s['insert_rows_per_s']:,.0f} rows/s"
        )
    return out


# -- results --------------------------------------------------------------------


def _optional(name: str, quick: bool, log: Any) -> tuple[list[dict[str, Any]] | None, str]:
    """``run(quick)`` of another helper's bench module, or None with why it did not run."""
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            return None, f"benchmarks/{name}.py is not in this tree"
        raise
    # --quick: toy sizes where the module takes them (bench_device_writes: its own smoke
    # test's sizes; the limiter: 20,000 rows, the writers given 0.5 s to reach the hold).
    small = {
        "inserts": 20_000, "hold_s": 0.5,
        "steps": 6, "repeats": 1, "envs": 64, "memory_steps": 20,
    } if quick else {}  # fmt: skip
    params = inspect.signature(mod.run).parameters
    kwargs = {k: v for k, v in small.items() if k in params}
    log(f"  {name}.run(quick={quick}{''.join(f', {k}={v}' for k, v in kwargs.items())})")
    return list(mod.run(quick, **kwargs)), ""


def _other_row(row: dict[str, Any]) -> tuple[float | None, float | None, str]:
    """(value, target, text) of a row of bench_rate_limit / bench_device_writes."""
    text = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("name", "value"))
    if "error_pct" in row:  # the limiter: within +-5 % of samples_per_insert, no deadlock
        err = abs(float(row["error_pct"]))
        ok = not row.get("deadlock", False)
        return (5.0 / max(err, 1e-3) if ok else 0.0), 1.0, text
    value = row.get("value", row.get("ratio"))
    if isinstance(value, (int, float)) and np.isfinite(value):
        return float(value), row.get("target"), text
    return None, row.get("target"), text


def run_all(p: Params, out_dir: str, pythons: dict[str, str | None], log: Any) -> dict[str, Any]:
    os.makedirs(out_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench_online_", dir=out_dir)
    load = [os.getloadavg()[0]]
    try:
        ours = {
            "inserts": bench_inserts(root, p, log),
            "sample": bench_sample(root, p, log),
            "latency": bench_latency(root, p, log),
        }
        load.append(os.getloadavg()[0])
        peers = {name: run_peer(name, py, p, root, log) for name, py in pythons.items()}
        load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    extra: dict[str, Any] = {}
    for name in ("bench_rate_limit", "bench_device_writes"):
        rows, why = _optional(name, p.quick, log)
        extra[name] = rows if rows is not None else {"skipped": why}
    return {
        "params": dataclasses.asdict(p),
        "ours": ours,
        "peers": peers,
        "others": extra,
        "loadavg_1min": load,
        "cpu_count": os.cpu_count(),
    }


def run_sample_rounds(
    p: Params, out_dir: str, pythons: dict[str, str | None], rounds: int, log: Any
) -> dict[str, Any]:
    """The PER sample case only, ``rounds`` times, ours and each peer interleaved.

    Each round runs ours, then each peer (never two systems at once); the ratio of a
    peer is the median over rounds of ours / theirs of the same round.
    """
    os.makedirs(out_dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench_online_", dir=out_dir)
    load = [os.getloadavg()[0]]
    each: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            log(f"round {r + 1} of {rounds}")
            row: dict[str, Any] = {"ours": bench_sample(root, p, log)}
            for name, py in pythons.items():
                row[name] = run_peer(name, py, p, root, log, cases="sample")
            row["load"] = os.getloadavg()[0]
            load.append(row["load"])
            each.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarize_rounds(each, list(pythons))
    return {"params": dataclasses.asdict(p), "rounds": each, "summary": summary,
            "loadavg_1min": load, "cpu_count": os.cpu_count()}  # fmt: skip


def summarize_rounds(each: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per peer: its samples/s, ours / theirs of each round, and the median of those."""
    summary: dict[str, Any] = {
        "ours_samples_per_s": [r["ours"]["samples_per_s"] for r in each],
    }
    for name in names:
        theirs = [r[name].get("sample", {}).get("samples_per_s") for r in each]
        ratios = [r["ours"]["samples_per_s"] / t for r, t in zip(each, theirs, strict=True) if t]
        summary[name] = {
            "samples_per_s": theirs,
            "ratios": ratios,
            "median_ratio": statistics.median(ratios) if ratios else None,
            "skipped": next((r[name]["skipped"] for r in each if "skipped" in r[name]), None),
            "version": next((r[name].get("version") for r in each if "version" in r[name]), None),
        }
    return summary


def rounds_table(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    ours = s["ours_samples_per_s"]
    lines = [
        "| comparison | median ratio | each round | target | ours samples/s | theirs samples/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, target in (("reverb", 10.0), ("torchrl", 3.0)):
        if name not in s:
            continue
        t = s[name]
        label = f"PER sample+read {BATCH} while 2 writers insert, ours / {name}"
        if t["median_ratio"] is None:
            lines.append(f"| {label} | - | - | >= {target:g}x | - | {t['skipped']} |")
            continue
        lines.append(
            f"| {label} | {t['median_ratio']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in t['ratios'])} | >= {target:g}x | "
            f"{', '.join(f'{x:,.0f}' for x in ours)} | "
            f"{', '.join(f'{x:,.0f}' if x else '-' for x in t['samples_per_s'])} |"
        )
    lines.append("")
    lines.append(
        f"1-min load average {', '.join(f'{x:.1f}' for x in doc['loadavg_1min'])} (start, "
        f"after each round) on {doc['cpu_count']} cores; peers: "
        + "; ".join(
            f"{k} {v['version'] or v['skipped']}" for k, v in s.items() if k != "ours_samples_per_s"
        )
    )
    return "\n".join(lines)


def _rows(doc: dict[str, Any]) -> list[tuple[str, float | None, float | None, str]]:
    """(comparison, ratio, target, the measurements behind it); ratio None: not measured."""
    ours, peers = doc["ours"], doc["peers"]
    out: list[tuple[str, float | None, float | None, str]] = []
    mine = {(r["where"], r["writers"]): r for r in ours["inserts"]}
    for name, target in (("reverb", 20.0), ("torchrl", 2.0)):
        peer = peers.get(name, {})
        theirs = {r["writers"]: r for r in peer.get("inserts", [])}
        for k in (1, 2):
            label = f"inserts, {k} writer{'s' if k > 1 else ''}, ours / {name}"
            if k not in theirs:
                why = peer.get("skipped", f"{name} ran with fewer writers (--quick)")
                out.append((label, None, target, why))
                continue
            a, b = mine[("disk", k)], theirs[k]
            out.append(
                (
                    label,
                    a["rows_per_s"] / b["rows_per_s"],
                    target,
                    f"ours {a['rows_per_s']:,.0f} rows/s ({100 * a['flush_fraction']:.0f}% in "
                    f"flush), {name} {b['rows_per_s']:,.0f} rows/s",
                )
            )
            if ("tmpfs", k) in mine:
                c = mine[("tmpfs", k)]
                out.append(
                    (
                        f"{label}, ours on /dev/shm (reported)",
                        c["rows_per_s"] / b["rows_per_s"],
                        None,
                        f"ours {c['rows_per_s']:,.0f} rows/s "
                        f"({100 * c['flush_fraction']:.0f}% in flush)",
                    )
                )
    s = ours["sample"]
    for name, target in (("reverb", 10.0), ("torchrl", 3.0)):
        peer = peers.get(name, {})
        label = f"PER sample+read {BATCH} while 2 writers insert, ours / {name}"
        if "sample" not in peer:
            out.append((label, None, target, peer.get("skipped", "not run")))
            continue
        t = peer["sample"]
        out.append(
            (
                label,
                s["samples_per_s"] / t["samples_per_s"],
                target,
                f"ours {s['samples_per_s']:,.0f} samples/s ({s['rows_at_start']:,} rows, "
                f"writers {s['insert_rows_per_s']:,.0f} rows/s; {s['store']}), {name} "
                f"{t['samples_per_s']:,.0f} samples/s ({t['rows_at_start']:,} rows, writers "
                f"{t['insert_rows_per_s']:,.0f} rows/s)",
            )
        )
    lat = ours["latency"]
    note = (
        f"median {lat['median_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms, max "
        f"{lat['max_ms']:.1f} ms ({lat['measured']} commits); reader "
        f"{lat['reader_batches_per_s']:,.0f} batches/s, a look every "
        f"{lat['look_every_ms']:.1f} ms"
    )
    out.append(
        ("commit -> sampleable: 20 ms / median", 20 / max(lat["median_ms"], 1e-3), 1.0, note)
    )
    out.append(("commit -> sampleable: 200 ms / p99", 200 / max(lat["p99_ms"], 1e-3), 1.0, note))
    for name, rows in doc["others"].items():
        if isinstance(rows, dict):
            out.append((name, None, None, rows.get("skipped", "")))
            continue
        for row in rows:
            value, target, text = _other_row(row)
            label = f"{name}: {row.get('name', '?')}"
            if "error_pct" in row:
                label += " (5 % / abs(observed - target) samples per insert)"
            out.append((label, value, target, text))
    return out


def table(doc: dict[str, Any], judge: bool) -> str:
    lines = [
        "| comparison | ratio | target | passes | measurements |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, ratio, target, note in _rows(doc):
        tgt = "-" if target is None else f">= {target:g}x"
        if ratio is None:
            lines.append(f"| {name} | - | {tgt} | - | {note} |")
            continue
        ok = "-" if target is None else ("not judged" if not judge else
                                         ("yes" if ratio >= target else "NO"))  # fmt: skip
        lines.append(f"| {name} | {ratio:.2f} | {tgt} | {ok} | {note} |")
    load = doc["loadavg_1min"]
    lines.append("")
    lines.append(
        f"1-min load average {', '.join(f'{x:.1f}' for x in load)} (start, after ours, after "
        f"the peers) on {doc['cpu_count']} cores; peers: "
        + "; ".join(
            f"{k} {v.get('version', v.get('skipped', '?'))}" for k, v in doc["peers"].items()
        )
    )
    return "\n".join(lines)


def run_online(cfg: Any, stores: Any, res: Any, log: Any) -> None:
    """The ``online`` section of benchmarks/run.py."""
    from bench_common import Ratio

    pythons: dict[str, str | None] = {
        "reverb": str(DEFAULT_REVERB),
        "torchrl": str(DEFAULT_TORCHRL),
    }
    if os.environ.get("BENCH_ONLINE_PEERS") == "0":  # the smoke test: ours only
        pythons = {k: None for k in pythons}
    doc = run_all(Params.make(cfg.quick), cfg.out_dir, pythons, log)
    res.extra["online"] = doc
    for name, ratio, target, note in _rows(doc):
        if ratio is None:
            res.notes.append(f"{name}: not measured ({note})")
            continue
        den = next((peer for peer in ("reverb", "torchrl") if f"/ {peer}" in name), "target")
        res.ratios.append(Ratio(f"online: {name}", "ours", den, ratio, target))
        res.notes.append(f"{name}: {note}")
    res.notes.append(table(doc, judge=False).splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small counts, not judged")
    ap.add_argument("--out", default="bench_out/online")
    ap.add_argument(
        "--reverb-python",
        default=str(DEFAULT_REVERB),
        help="python of the venv with dm-reverb (make bench-online-peers builds it)",
    )
    ap.add_argument(
        "--torchrl-python",
        default=str(DEFAULT_TORCHRL),
        help="python of the venv with torchrl (.venv-peers)",
    )
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument(
        "--sample-rounds",
        type=int,
        default=0,
        help="only the PER sample case, N rounds of ours and the peers interleaved",
    )
    ap.add_argument("--peers", default="reverb,torchrl", help="which peers run (comma-separated)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def log(m: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {m}", file=sys.stderr, flush=True)

    pythons: dict[str, str | None] = {"reverb": args.reverb_python, "torchrl": args.torchrl_python}
    pythons = {k: v for k, v in pythons.items() if k in args.peers.split(",")}
    if args.no_peers:
        pythons = {k: None for k in pythons}
    if args.sample_rounds:
        doc = run_sample_rounds(Params.make(args.quick), args.out, pythons, args.sample_rounds, log)
        text = rounds_table(doc)
        print(text)
        out = Path(args.out)
        (out / "rounds.md").write_text(text + "\n")
        (out / "rounds.json").write_text(json.dumps(doc, indent=1))
        log(f"results in {out}")
        return 0
    doc = run_all(Params.make(args.quick), args.out, pythons, log)
    text = table(doc, judge=not args.quick)
    print(text)
    out = Path(args.out)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    log(f"results in {out}")
    return 0


if __name__ == "__main__":
    mp.freeze_support()
    sys.exit(main())
