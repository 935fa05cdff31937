"""The peers' side of bench_online.py: Reverb and torchrl with writer processes.

Runs in the peer's own virtual environment, never in grain_replay's:
``make bench-online-peers`` builds ``.venv-reverb/`` (dm-reverb 0.14.0,
tensorflow 2.15, Python 3.11) and uses torchrl from ``.venv-peers/``. One
invocation measures one peer (``--peer reverb|torchrl``) on the protocol that
``bench_online.py`` runs for grain_replay and prints one JSON object on stdout:

- ``inserts``: K writer processes (spawned), each appending ``--rows`` transitions
  of 525 B in appends of ``--envs`` rows (one row per env), "flushing" every
  ``--flush-rows`` rows; the clock runs from the moment every writer is ready to
  the moment the last one is done. Reverb: a server on 127.0.0.1 with a uniform
  table (max_size ``--capacity``, ``MinSize(1)``: a ``SampleToInsertRatio``
  limiter would stop the writers, as no learner samples here), one
  ``TrajectoryWriter`` per process, one item per transition, ``flush()`` every
  ``--flush-rows`` items. torchrl: ``ReplayBuffer(LazyMemmapStorage(capacity),
  shared=True)``, ``extend`` of a TensorDict of ``--envs`` rows (no flush exists).
- ``sample``: ``--prefill`` rows inserted first (by two writers, not timed), then
  two writers insert ``--rate`` rows/s each (paced) while this process draws
  prioritized batches of ``--batch``: Reverb, a ``Prioritized(0.6)`` table read by
  ``TrajectoryDataset.from_table_signature(...).batch(batch)`` in the server's own
  process (Reverb reads its table directly, without gRPC, then); torchrl,
  ``TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, shared=True,
  sync=False)`` (writers get a shareable sampler, the learner's prioritized
  sampler catches up from the write count before each draw, as torchrl documents).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
from bench_common import time_calls, transitions

LEAVES = ("obs", "action", "reward", "next_obs", "done")


def _pace(rows: int, start: float, rate: float | None) -> None:
    """Sleeps until ``rows`` rows are due at ``rate`` rows/s since ``start``."""
    if rate:
        wait = start + rows / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


# -- Reverb -------------------------------------------------------------------


def _reverb_signature() -> dict[str, Any]:
    import tensorflow as tf

    return {
        "obs": tf.TensorSpec([64], tf.float32),
        "action": tf.TensorSpec([], tf.int64),
        "reward": tf.TensorSpec([], tf.float32),
        "next_obs": tf.TensorSpec([64], tf.float32),
        "done": tf.TensorSpec([], tf.bool),
    }


def write_loop(append: Any, flush: Any, cfg: dict[str, Any], go: Any, stop: Any, out: Any) -> None:
    """The writer side of the protocol, for every system.

    After ``go``: ``cfg["fill_rows"]`` rows as fast as possible (then a ``"filled"``
    message), then ``cfg["rows"]`` rows (None: until ``stop``), paced at ``cfg["rate"]``
    rows/s when set, "flushing" every ``cfg["flush_rows"]`` rows; reports rows, seconds
    and the time spent in flushes. ``cfg["commits"]`` also reports each flush's
    start as ``(rows appended so far, time.monotonic())``: the rows become visible
    inside the flush, so a reader may hold them before its return.
    """
    envs, every = cfg["envs"], cfg["flush_rows"]
    go.wait()
    fill = 0
    while fill < cfg.get("fill_rows", 0):
        append()
        fill += envs
        if fill % every < envs:
            flush()
    flush()
    out.put({"filled": fill})
    rows, since, flush_s, commits = 0, 0, 0.0, []
    start = time.perf_counter()
    while (cfg["rows"] is None or rows < cfg["rows"]) and not stop.is_set():
        append()
        rows += envs
        since += envs
        if since >= every:
            asked, t = time.monotonic(), time.perf_counter()
            flush()
            flush_s += time.perf_counter() - t
            since = 0
            if cfg.get("commits"):
                commits.append((fill + rows, asked))
        _pace(rows, start, cfg["rate"])
        if cfg.get("gap_s"):
            time.sleep(cfg["gap_s"][0] + (cfg["gap_s"][1] - cfg["gap_s"][0]) * np.random.random())
    elapsed = time.perf_counter() - start
    flush()
    out.put({"rows": rows, "s": elapsed, "flush_s": flush_s, "commits": commits})


def _reverb_writer(
    address: str, table: str, cfg: dict[str, Any], seed: int, ready: Any, go: Any, stop: Any,
    out: Any,
) -> None:  # fmt: skip
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import reverb

    data = transitions(cfg["envs"], seed)
    steps = [{k: v[i] for k, v in data.items()} for i in range(cfg["envs"])]
    client = reverb.Client(address)
    with client.trajectory_writer(num_keep_alive_refs=1) as w:

        def append() -> None:  # one env step of every env: one item per transition
            for step in steps:
                w.append(step)
                w.create_item(table, 1.0, {k: w.history[k][-1] for k in LEAVES})

        append()
        w.flush()
        ready.set()
        write_loop(append, w.flush, cfg, go, stop, out)


class _Reverb:
    def __init__(self, args: argparse.Namespace) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import reverb

        self.reverb = reverb
        sig = _reverb_signature()
        tables = [
            reverb.Table(
                name="uniform",
                sampler=reverb.selectors.Uniform(),
                remover=reverb.selectors.Fifo(),
                max_size=args.capacity,
                rate_limiter=reverb.rate_limiters.MinSize(1),
                signature=sig,
            ),
            reverb.Table(
                name="prioritized",
                sampler=reverb.selectors.Prioritized(0.6),
                remover=reverb.selectors.Fifo(),
                max_size=args.capacity,
                rate_limiter=reverb.rate_limiters.MinSize(1),
                signature=sig,
            ),
        ]
        self.server = reverb.Server(tables, port=None)
        self.address = f"127.0.0.1:{self.server.port}"
        self.version = f"{_dist_version('dm-reverb')} (tensorflow {_dist_version('tensorflow')})"

    def writers(self, k: int, table: str, cfg: dict[str, Any]) -> Writers:
        return Writers(_reverb_writer, [(self.address, table, cfg, i) for i in range(k)])

    def size(self, table: str) -> int:
        return int(self.reverb.Client(self.address).server_info()[table].current_size)

    def sampler(self, batch: int) -> Any:
        ds = self.reverb.TrajectoryDataset.from_table_signature(
            server_address=self.address,
            table="prioritized",
            max_in_flight_samples_per_worker=2 * batch,
        ).batch(batch)
        it = iter(ds)

        def draw() -> None:
            sample = next(it)
            assert sample.data["obs"].shape == (batch, 64)
            sample.data["obs"].numpy()  # the rows, on the host

        return draw

    def close(self) -> None:
        self.server.stop()


# -- torchrl ------------------------------------------------------------------


def _torchrl_writer(
    rb: Any, cfg: dict[str, Any], seed: int, ready: Any, go: Any, stop: Any, out: Any
) -> None:
    import torch
    from tensordict import TensorDict

    torch.set_num_threads(1)
    data = transitions(cfg["envs"], seed)
    td = TensorDict({k: torch.from_numpy(v) for k, v in data.items()}, batch_size=[cfg["envs"]])
    rb.extend(td)
    ready.set()
    write_loop(lambda: rb.extend(td), lambda: None, cfg, go, stop, out)


class _Torchrl:
    def __init__(self, args: argparse.Namespace) -> None:
        import tensordict
        import torch
        import torchrl

        torch.set_num_threads(1)
        self.args = args
        self.scratch = tempfile.mkdtemp(prefix="torchrl_online_", dir=args.scratch)
        self.version = (
            f"{torchrl.__version__} (tensordict {tensordict.__version__}, "
            f"torch {torch.__version__})"
        )
        self.rbs: dict[str, Any] = {}

    def _buffer(self, table: str) -> Any:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyMemmapStorage, ReplayBuffer, TensorDictPrioritizedReplayBuffer

        scratch = tempfile.mkdtemp(prefix=f"{table}_", dir=self.scratch)
        storage = LazyMemmapStorage(self.args.capacity, scratch_dir=scratch)
        if table == "uniform":
            rb = ReplayBuffer(storage=storage, shared=True)
        else:
            rb = TensorDictPrioritizedReplayBuffer(
                alpha=0.6,
                beta=0.4,
                storage=storage,
                batch_size=self.args.batch,
                shared=True,
                sync=False,
            )
        # The memmap files exist before the buffer goes to the writers (lazy storage).
        one = transitions(1)
        rb.extend(TensorDict({k: torch.from_numpy(v) for k, v in one.items()}, batch_size=[1]))
        return rb

    def writers(self, k: int, table: str, cfg: dict[str, Any]) -> Writers:
        if table not in self.rbs:
            self.rbs[table] = self._buffer(table)
        return Writers(_torchrl_writer, [(self.rbs[table], cfg, i) for i in range(k)])

    def size(self, table: str) -> int:
        return len(self.rbs[table])

    def sampler(self, batch: int) -> Any:
        rb = self.rbs["prioritized"]

        def draw() -> None:
            sample = rb.sample()
            assert sample["obs"].shape == (batch, 64)

        return draw

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


# -- the protocol -------------------------------------------------------------


class Writers:
    """Writer processes (spawned), ready before the clock starts, each running write_loop."""

    def __init__(self, target: Any, argsets: list[tuple[Any, ...]]) -> None:
        ctx = _context(target)
        self.go, self.stop, self.out = ctx.Event(), ctx.Event(), ctx.Queue()
        self.ready = [ctx.Event() for _ in argsets]
        self.procs = [
            ctx.Process(target=target, args=(*a, r, self.go, self.stop, self.out), daemon=True)
            for a, r in zip(argsets, self.ready, strict=True)
        ]
        for p in self.procs:
            p.start()
        for r, p in zip(self.ready, self.procs, strict=True):
            while not r.wait(1.0):
                if not p.is_alive():
                    raise RuntimeError(f"a writer process exited with {p.exitcode} before ready")

    def _get(self) -> dict[str, Any]:
        while True:
            try:
                return dict(self.out.get(timeout=1.0))
            except Exception:  # queue.Empty: is every writer still alive?
                dead = [p.exitcode for p in self.procs if not p.is_alive() and p.exitcode]
                if dead:
                    raise RuntimeError(f"a writer process exited with {dead[0]}") from None

    def start(self) -> float:
        """Starts every writer at once; waits until each has filled; the start time.

        A writer may finish before another has filled (few rows, a loaded machine): its
        result, arriving among the "filled" messages, is kept for :meth:`join`."""
        self.go.set()
        self._done: list[dict[str, Any]] = []
        filled = 0
        while filled < len(self.procs):
            message = self._get()
            if "filled" in message:
                filled += 1
            else:
                self._done.append(message)
        return time.perf_counter()

    def join(self, stop: bool = False) -> list[dict[str, Any]]:
        if stop:
            self.stop.set()
        results = list(getattr(self, "_done", []))
        while len(results) < len(self.procs):
            message = self._get()
            if "filled" not in message:  # start() was not called: skip the fill reports
                results.append(message)
        for p in self.procs:
            p.join(60)
        return results


def _context(target: Any) -> Any:
    if target is _torchrl_writer:
        import torch.multiprocessing as tmp

        return tmp.get_context("spawn")
    return mp.get_context("spawn")


def _dist_version(name: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "?"


def run_inserts(peer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for k in args.writers:
        cfg = {"envs": args.envs, "rows": args.rows, "flush_rows": args.flush_rows, "rate": None}
        w = peer.writers(k, "uniform", cfg)
        t = w.start()
        each = w.join()
        wall = time.perf_counter() - t
        rows = sum(r["rows"] for r in each)
        out.append({"writers": k, "rows": rows, "s": wall, "rows_per_s": rows / wall})
        print(f"{args.peer}: {k} writer(s) {rows / wall:,.0f} rows/s", file=sys.stderr)
    return out


def run_sample(peer: Any, args: argparse.Namespace) -> dict[str, Any]:
    cfg = {
        "envs": args.envs,
        "fill_rows": -(-args.prefill // 2),
        "rows": None,
        "flush_rows": args.flush_rows,
        "rate": args.rate,
    }
    t = time.perf_counter()
    w = peer.writers(2, "prioritized", cfg)
    t0 = w.start()  # both writers have inserted their prefill rows; now paced
    prefill_s = t0 - t
    start_size = peer.size("prioritized")
    repeats = time_calls(peer.sampler(args.batch), args.repeats, args.per_repeat, warmup=5)
    each = w.join(stop=True)
    inserted = sum(r["rows"] for r in each)
    return {
        "batch_s": repeats,
        "samples_per_s": args.batch / statistics.median(repeats),
        "prefill_s": prefill_s,
        "rows_at_start": start_size,
        "rows_at_end": peer.size("prioritized"),
        "inserted_while_sampling": inserted,
        "insert_rows_per_s": inserted / max(r["s"] for r in each),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer", choices=("reverb", "torchrl"), required=True)
    p.add_argument("--cases", default="inserts,sample")
    p.add_argument("--writers", default="1,2")
    p.add_argument("--rows", type=int, default=100_000, help="rows per writer (inserts)")
    p.add_argument("--envs", type=int, default=64)
    p.add_argument("--flush-rows", type=int, default=1024)
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prefill", type=int, default=50_000)
    p.add_argument("--rate", type=float, default=1500.0, help="rows/s per writer (sample)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-repeat", type=int, default=20)
    p.add_argument("--scratch", default=None)
    args = p.parse_args(argv)
    args.writers = [int(k) for k in args.writers.split(",")]
    cases = args.cases.split(",")
    result: dict[str, Any] = {"peer": args.peer}
    try:
        peer = _Reverb(args) if args.peer == "reverb" else _Torchrl(args)
    except ImportError as e:
        print(json.dumps({"peer": args.peer, "skipped": f"not installed: {e}"}))
        return 0
    try:
        result["version"] = peer.version
        if "inserts" in cases:
            result["inserts"] = run_inserts(peer, args)
        if "sample" in cases:
            result["sample"] = run_sample(peer, args)
    finally:
        peer.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
