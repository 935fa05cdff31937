"""Runs the multi-process tests N times in a row and reports every job's time.

    PYTHONPATH=$PWD python tests/helpers/soak_multihost.py --runs 20 [--limit 30] [pytest args]

Each run is one ``pytest -s -n 0 tests/device/test_multihost*.py``; the job runner
(``procs.run_job``) prints one ``multihost job:`` line per job. Prints each run's
job times, then the median and maximum over all jobs, and exits non-zero when a run
fails or any job took ``--limit`` seconds or more.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import time

JOB = re.compile(r"multihost job: (\d+) processes, ([\d.]+) s \(processes ended at ([^)]*) s\)")


def _spread(ends: str) -> float:
    values = [float(e) for e in ends.split(", ") if e != "-"]
    return max(values) - min(values) if values else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--limit", type=float, default=30.0, help="seconds a job must stay under")
    args, pytest_args = parser.parse_known_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    default = sorted(glob.glob(os.path.join(root, "tests/device/test_multihost*.py")))
    files = pytest_args or default
    times: list[float] = []
    bad = 0
    for run in range(1, args.runs + 1):
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "-p", "no:cacheprovider"]
        proc = subprocess.run([*cmd, *files], cwd=root, capture_output=True, text=True)
        found = list(JOB.finditer(proc.stdout))
        jobs = [float(m.group(2)) for m in found]
        # A teardown stall shows as one process ending long after the others.
        spreads = [_spread(m.group(3)) for m in found]
        times += jobs
        over = [t for t in jobs if t >= args.limit]
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "(no output)"
        ok = proc.returncode == 0 and not over
        bad += not ok
        print(
            f"run {run:2d}: {'ok ' if ok else 'BAD'} {time.monotonic() - t0:6.1f} s, "
            f"{len(jobs)} jobs: {' '.join(f'{t:.1f}' for t in jobs)}; "
            f"last-first process end: max {max(spreads, default=0):.1f} s | {summary}",
            flush=True,
        )
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    if times:
        print(
            f"{args.runs} runs, {len(times)} jobs: median {statistics.median(times):.1f} s, "
            f"max {max(times):.1f} s; {sum(t >= args.limit for t in times)} at or over "
            f"{args.limit:.0f} s; {bad} bad runs",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
