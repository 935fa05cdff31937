"""Limiter accuracy: observed samples per insert against ``samples_per_insert``, both directions.

A learner samples a bounded store (``gr.UniformReplay(min_size=, samples_per_insert=)``,
batch 256) while writer processes insert 525-byte transitions (64 a call, a flush
every 1,024 rows):

- ``fast_writer``: writers insert as fast as they can; the learner spends 10 ms a
  batch (the writers are held back in ``flush()``);
- ``fast_learner``: one writer sleeps 50 ms after each flush; the learner draws
  as fast as it can (it waits before drawing).

Both sides are given one ``gr.RateLimit(min_size=, samples_per_insert=)``: the
writers declare it in the store and start before the learner exists (they hold at
``min_size + tolerance / samples_per_insert`` rows, plus a flush each, until the
learner's loader is built: the rows committed before its first draw are reported).

Each reports the observed samples per insert, ``sampled / (inserted - min_size)``
at the end (target: within 5 % of ``samples_per_insert``), the largest excursion
outside ``r * (inserted - min_size) +- tolerance`` seen after any batch (rows;
0 is exact), the time each side waited, and whether the run finished in time (no
deadlock).

Usage::

    python benchmarks/bench_rate_limit.py [--quick] [--inserts N]

``run(quick)`` returns the rows (``bench_online.py`` calls it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

# This checkout's package, in spawned writers too (they inherit sys.path).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

BATCH = 256
APPEND = 64
FLUSH_ROWS = 1024
RATIO = 2.0
MIN_SIZE = 10_000
CAPACITY = 250_000


def _rows(n: int) -> dict[str, np.ndarray]:
    """``n`` transitions of 525 bytes."""
    rng = np.random.default_rng(0)
    return {
        "obs": rng.standard_normal((n, 64), dtype=np.float32),
        "next_obs": rng.standard_normal((n, 64), dtype=np.float32),
        "action": rng.integers(0, 4, n, dtype=np.int32),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "discount": np.ones(n, np.float32),
        "done": np.zeros(n, bool),
    }


def _limit() -> Any:
    import grain_replay as gr

    return gr.RateLimit(min_size=MIN_SIZE, samples_per_insert=RATIO)


def _writer(path: str, writer_id: str, rows: int, pause: float, report: str) -> None:
    import grain_replay as gr

    block = _rows(APPEND)
    waited = 0.0
    with gr.ReplayWriter(
        path, "npy", capacity=CAPACITY, writer_id=writer_id, rate_limit=_limit()
    ) as w:
        done = 0
        while done < rows:
            w.append(block)
            done += APPEND
            if done % FLUSH_ROWS == 0 or done >= rows:
                t = time.perf_counter()
                w.flush()
                waited += time.perf_counter() - t
                if pause:
                    time.sleep(pause)
    with open(report + ".tmp", "w") as f:
        json.dump({"rows": done, "flush_s": waited, "wait_s": w.rate_limit_wait_s}, f)
    os.replace(report + ".tmp", report)


def _scenario(
    name: str, inserts: int, writers: int, pause: float, work: float, hold_s: float = 3.0
) -> dict[str, Any]:
    import grain_replay as gr
    from grain_replay.sampling.rate.options import default_tolerance
    from grain_replay.store.progress import InsertedCount

    root = tempfile.mkdtemp(prefix="bench_rate_limit_")
    seed = MIN_SIZE - 4 * FLUSH_ROWS  # the writers bring it to min_size
    path = os.path.join(root, "store")
    try:
        with gr.ReplayWriter(
            path, "npy", capacity=CAPACITY, writer_id="seed", rate_limit=_limit()
        ) as w:
            w.append(_rows(seed))
        per = (inserts - seed) // writers // FLUSH_ROWS * FLUSH_ROWS
        ctx = multiprocessing.get_context("spawn")
        reports = [os.path.join(root, f"w{i}.json") for i in range(writers)]
        procs = [
            ctx.Process(target=_writer, args=(path, f"w{i}", per, pause, reports[i]))
            for i in range(writers)
        ]
        count = InsertedCount(path)
        for p in procs:  # before the learner exists: the declared limit holds them
            p.start()
        held = MIN_SIZE + _limit().writer_tolerance() / RATIO
        until = time.monotonic() + 600
        while count.read()[0] < MIN_SIZE and time.monotonic() < until:
            time.sleep(0.05)
        time.sleep(hold_s)  # a benchmark, not a test: the writers' next flushes find the hold
        opts = gr.UniformReplay(rate_limit=_limit(), timeout=120)
        it = iter(
            gr.make_data_loader(
                gr.open_source(path), batch_size=BATCH, num_epochs=None, sampling=opts
            )
        )
        e = default_tolerance(BATCH, RATIO, MIN_SIZE)
        t0 = time.perf_counter()
        before_first = count.read()[0]
        next(it)
        handed, above, below, caught = BATCH, 0.0, 0.0, False
        learner_s, deadline, deadlock = 0.0, time.monotonic() + 1800, False
        total = seed + per * writers
        while True:
            inserted = count.read()[0]
            gap = RATIO * (inserted - MIN_SIZE) - handed
            above = max(above, -gap - e)  # sampled past the ceiling
            if gap <= e:
                caught = True
            if caught:
                below = max(below, gap - e)  # sampled below the floor
            if inserted >= total and handed + BATCH > RATIO * (inserted - MIN_SIZE) + e:
                break
            if time.monotonic() > deadline:
                deadlock = True
                break
            t = time.perf_counter()
            next(it)
            learner_s += time.perf_counter() - t
            handed += BATCH
            if work:
                time.sleep(work)
        seconds = time.perf_counter() - t0
        it.close()
        for p in procs:
            p.join(60)
        done = [json.load(open(r)) if os.path.exists(r) else {} for r in reports]
        inserted = count.read()[0]
        observed = handed / (inserted - MIN_SIZE)
        return {
            "name": f"rate_limit_{name}",
            "writers": writers,
            "inserts": inserted,
            "samples_per_insert": RATIO,
            "tolerance": e,
            "committed_before_first_draw": before_first,
            "held_at": held,
            "sampled": handed,
            "observed": round(observed, 5),
            "error_pct": round(100 * (observed / RATIO - 1), 3),
            "within_5pct": abs(observed / RATIO - 1) <= 0.05,
            "max_above_ceiling_rows": max(0.0, above),
            "max_below_floor_rows": max(0.0, below),
            "learner_next_s": round(learner_s, 2),
            "writer_flush_s": [round(d.get("flush_s", -1), 2) for d in done],
            "writer_wait_s": [round(d.get("wait_s", -1), 2) for d in done],
            "seconds": round(seconds, 2),
            "deadlock": deadlock,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(quick: bool, inserts: int | None = None, hold_s: float = 3.0) -> list[dict[str, Any]]:
    """Both directions; ``inserts`` rows in all (default 10**5 quick, 10**6 full).
    ``hold_s``: seconds the writers are left to reach the hold before the learner starts
    (``run.py --quick`` gives them less: its rows are a smoke run, not judged)."""
    n = inserts or (100_000 if quick else 1_000_000)
    return [
        _scenario("fast_writer", n, writers=2, pause=0.0, work=0.01, hold_s=hold_s),
        _scenario("fast_learner", n, writers=1, pause=0.05, work=0.0, hold_s=hold_s),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--inserts", type=int, default=None)
    args = ap.parse_args(argv)
    ok = True
    for row in run(args.quick, args.inserts):
        print(json.dumps(row))
        print(
            f"{row['name']}: observed samples per insert {row['observed']:.4f} vs target "
            f"{row['samples_per_insert']:g} ({row['error_pct']:+.2f} %), over {row['inserts']} "
            f"inserts in {row['seconds']:.1f} s; band excursions {row['max_above_ceiling_rows']:g} "
            f"/ {row['max_below_floor_rows']:g} rows; writers waited {row['writer_wait_s']} s, "
            f"learner in next() {row['learner_next_s']} s; deadlock: {row['deadlock']}; "
            f"{row['committed_before_first_draw']} rows committed before the first draw "
            f"(held at {row['held_at']:g} + a flush of {FLUSH_ROWS} per writer)"
        )
        ok = ok and row["within_5pct"] and not row["deadlock"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
