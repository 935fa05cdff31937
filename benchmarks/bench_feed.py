"""The host-fed path against the link: does the chip wait for the loader and its puts?

For two workloads (``mlp``: a 3-layer MLP Q-learning step on 525-byte transitions;
``conv``: a Nature-DQN conv net on 84x84x4 uint8 frames; the models and data of
``bench_device_replay.py``), batch 256, in one run:

- ``step``: the jitted training step on batches already on the device (8, in turns);
- ``link``: the fastest way this run finds to move one batch's bytes into HBM, the best
  of: ``jax.device_put`` of the numpy batch (1 and 4 in flight), and the same bytes as
  one flat ``uint8[n, 128]`` buffer, 4 puts in flight (batches/s);
- ``loader-w{0,4}``: ``make_data_loader`` alone (host batches/s; the read is a ceiling too);
- ``ceiling-g{g}``: the most a host-fed feed of per-batch device arrays can give on this
  host: the step fed from batches already in memory (no loader), ``g`` batches a packed
  put and one unpack program (``sharded_device_put``'s grouping), all on the step's
  thread; what it adds to ``step`` is the put, the unpack and the arrays it returns;
- ``fed-w{0,4}-...``: the step fed by ``make_data_loader(worker_count=w)`` +
  ``sharded_device_put``: ``before``, one put per leaf on one thread (until 2026-12);
  ``leaves``, one put per leaf, batches of 1 MiB or more 4 at once on their own threads;
  ``packed``, one lane-aligned buffer per transfer, small batches several to a transfer
  (these three read ahead on a producer thread); ``thread``: ``packed=None`` on a producer
  thread; ``default``: what a user gets (on a TPU: packed when batches group, read ahead
  in the caller's thread, ``device/inline_feed.py``).

Ratio (issue 41's target >= 0.9): fed steps/s / min(step, link). Rates are medians of
``--repeats`` windows of ``--seconds`` each; the cases of one workload are timed in turns
(one window each per round), so that they see the same machine.

    python benchmarks/bench_feed.py [--quick] [--repeats R] [--seconds S] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from bench_device_replay import (
    conv_params,
    conv_q,
    frames,
    make_train,
    mlp_params,
    mlp_q,
    transitions,
)

import grain_replay as gr
from grain_replay.device import packed as packing
from grain_replay.device import put_options

LINK = ("put-plain-1", "put-plain-4", "put-flat-u8-4")  # the link rate: the best of these
WORKERS = (0, 4)


class InFlight:
    """Keeps ``depth`` results in flight: blocks on the one ``depth`` calls earlier."""

    def __init__(self, depth: int) -> None:
        self.q: collections.deque[Any] = collections.deque()
        self.depth = depth

    def push(self, x: Any) -> None:
        self.q.append(x)
        while len(self.q) > self.depth:
            jax.block_until_ready(self.q.popleft())

    def flush(self) -> None:
        while self.q:
            jax.block_until_ready(self.q.popleft())


def _window(run: Callable[[int], Any], seconds: float, per_call: float) -> float:
    """Calls/s of ``run(k)`` (which does ``k`` calls and blocks) over about ``seconds``."""
    k = max(8, int(seconds / max(per_call, 1e-6)))
    t = time.perf_counter()
    run(k)
    return k / (time.perf_counter() - t)


def _ceiling(
    step: Any, state: dict[str, Any], lay: Any, group: list[Any], g: int, treedef: Any
) -> Callable[[int], None]:
    nl = treedef.num_leaves

    def run(k: int) -> None:
        p, done = state["p"], 0
        while done < k:
            outs = lay.put(group)
            for i in range(min(g, k - done)):
                p = step(p, jax.tree_util.tree_unflatten(treedef, outs[i * nl : (i + 1) * nl]))
            done += g
        state["p"] = jax.block_until_ready(p)

    return run


def bench(name: str, tree: dict[str, np.ndarray], args: argparse.Namespace, root: str) -> dict:
    path = f"{root}/{name}"
    gr.write(path, tree)
    src = gr.open_source(path)
    b = args.batch
    n = len(next(iter(tree.values())))
    rng = np.random.default_rng(0)
    host_batches = [src.read_batch(np.sort(rng.choice(n, b, replace=False))) for _ in range(8)]
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
        jax.sharding.PartitionSpec("data"),
    )
    on_device = [jax.device_put(h, sharding) for h in host_batches]
    q, params_fn, next_key = (
        (mlp_q, mlp_params, "next_obs") if name == "mlp" else (conv_q, conv_params, "obs")
    )
    train = make_train(q, next_key)
    ones = jnp.ones(b, jnp.float32)

    @jax.jit
    def step(p: Any, batch: Any) -> Any:
        batch = {k: v for k, v in batch.items() if k != "discount"}
        return train(p, batch, ones)[0]

    params = params_fn(np.random.default_rng(0))
    params = jax.block_until_ready(step(params, on_device[0]))
    state = {"p": params}

    def steps_on(source: Callable[[], Any]) -> Callable[[int], Any]:
        def run(k: int) -> Any:
            p = state["p"]
            for _ in range(k):
                p = step(p, source())
            state["p"] = jax.block_until_ready(p)

        return run

    cyc = iter(range(1 << 62))
    cases: dict[str, Callable[[int], Any]] = {
        "step": steps_on(lambda: on_device[next(cyc) % 8]),
    }
    host = host_batches[0]
    flat = np.zeros((-(-sum(v.nbytes for v in host.values()) // 128), 128), np.uint8)
    dev = jax.devices()[0]

    def plain1(k: int) -> None:
        for _ in range(k):
            jax.block_until_ready(jax.device_put(host, sharding))

    def in_flight(make: Callable[[], Any]) -> Callable[[int], None]:
        def run(k: int) -> None:
            f = InFlight(4)
            for _ in range(k):
                f.push(make())
            f.flush()

        return run

    cases["put-plain-1"] = plain1
    cases["put-plain-4"] = in_flight(lambda: jax.device_put(host, sharding))
    cases["put-flat-u8-4"] = in_flight(lambda: jax.device_put(flat, dev))
    iters: dict[str, Iterator[Any]] = {}
    # the ceiling of any host-fed feed of per-batch device arrays: no loader (the batches
    # already in memory), one packed put + one unpack per group of batches (the grouping
    # sharded_device_put uses), all on the step's thread: what is left is the put, the
    # unpack program and its outputs, one jax call each, beside the step's own dispatch
    batch_bytes = sum(v.nbytes for v in host.values())
    treedef = jax.tree_util.tree_structure(host)
    g_default = max(1, min(packing.MAX_GROUP, packing.GROUP_BYTES // batch_bytes))
    for g in sorted({g_default, packing.MAX_GROUP if g_default > 1 else 1}):
        group = [a for i in range(g) for a in jax.tree_util.tree_leaves(host_batches[i % 8])]
        lay = packing.plan(group, [sharding] * len(group))
        if lay is not None:
            cases[f"ceiling-g{g}"] = _ceiling(step, state, lay, group, g, treedef)

    def feed(w: int, packed: bool | None, **consts: Any) -> Iterator[Any]:
        loader = gr.make_data_loader(src, batch_size=b, num_epochs=None, seed=1, worker_count=w)
        where = {k: put_options if k == "INLINE" else packing for k in consts}
        saved = {k: getattr(where[k], k) for k in consts}
        for k, v in consts.items():
            setattr(where[k], k, v)
        try:
            fed = gr.sharded_device_put(loader, sharding, packed=packed)
            next(fed)  # how it moves batches is fixed at the first one
        finally:
            for k, v in saved.items():
                setattr(where[k], k, v)
        return fed

    def wanted(case: str) -> bool:
        return not args.cases or re.search(args.cases, case) is not None

    for w in WORKERS:
        labels = ("before", "leaves", "packed", "thread", "default", "default-g16")
        if not any(wanted(c) for c in [f"loader-w{w}"] + [f"fed-w{w}-{x}" for x in labels]):
            continue
        it = iter(gr.make_data_loader(src, batch_size=b, num_epochs=None, seed=1, worker_count=w))
        iters[f"loader-w{w}"] = it

        def pull(k: int, it: Iterator[Any] = it) -> None:
            for _ in range(k):
                next(it)

        cases[f"loader-w{w}"] = pull
        variants = {
            "before": (False, {"PUT_THREADS": 1, "INLINE": False}),  # a put a leaf, 1 thread
            "leaves": (False, {"INLINE": False}),
            "packed": (True, {"INLINE": False}),
            "thread": (None, {"INLINE": False}),  # the default's moves, on a producer thread
            "default": (None, {}),
            "default-g16": (None, {"GROUP_BYTES": 1 << 24}),  # MAX_GROUP batches a transfer
        }
        for label, (packed, consts) in variants.items():
            if not wanted(f"fed-w{w}-{label}"):
                continue
            fed = feed(w, packed, **consts)
            iters[f"fed-w{w}-{label}"] = fed
            cases[f"fed-w{w}-{label}"] = steps_on(lambda fed=fed: next(fed))
    if args.cases:
        keep = re.compile(args.cases)
        # the ratio's bound, min(step, link), is timed whatever the pattern: a run of some
        # cases never reports a ratio against the step alone as if it were the link's
        cases = {c: f for c, f in cases.items() if c in ("step", *LINK) or keep.search(c)}
    # warm up every case (compiles, worker start-up), then time the per-call cost
    per_call = {}
    for c, run in cases.items():
        run(16)
        t = time.perf_counter()
        run(16)
        per_call[c] = (time.perf_counter() - t) / 16
    rates: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):
        for c, run in cases.items():
            rates[c].append(_window(run, args.seconds, per_call[c]))
    for it in iters.values():
        close = getattr(it, "close", None)
        if close:
            close()
    med = {c: statistics.median(r) for c, r in rates.items()}
    puts = [med[c] for c in LINK if c in med]
    link = max(puts) if puts else float("inf")
    bound = min(med["step"], link)
    out = {
        "batch_bytes": int(sum(v.nbytes for v in host.values())),
        "rates": med,
        "all": rates,
        "link": link,
        "bound": bound,
        "ratios": {c: med[c] / bound for c in med if c.startswith(("fed", "ceiling"))},
    }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small stores, short windows")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--frames", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--only", default="", help="mlp or conv")
    p.add_argument("--out", default="")
    p.add_argument(
        "--cases", default="", help="a regex: time only these cases (and step and the link's)"
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval(S) first (the interpreter's 5 ms by default)",
    )
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.quick:
        args.rows, args.frames, args.seconds, args.batch = 4_000, 1_000, 0.3, 64
    print(
        f"jax {jax.__version__} backend {jax.default_backend()} device {jax.devices()[0]}",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name, tree in (("mlp", transitions(args.rows)), ("conv", frames(args.frames))):
            if args.only and name != args.only:
                continue
            r = bench(name, tree, args, root)
            results[name] = r
            print(f"\n{name}: batch {r['batch_bytes']:,} B", flush=True)
            for c, v in r["rates"].items():
                extra = f"  ratio {r['ratios'][c]:.3f}" if c in r["ratios"] else ""
                print(f"  {c:22s} {v:9.1f} /s{extra}", flush=True)
            print(
                f"  switch interval {sys.getswitchinterval() * 1e3:g} ms;"
                f" link {r['link']:.1f}/s, step {r['rates']['step']:.1f}/s: "
                f"bound min(step, link) = {r['bound']:.1f}/s",
                flush=True,
            )
    if args.out:  # per workload: rates, ratios (fed cases), link, bound; the run's backend
        meta = {"backend": jax.default_backend(), "jax": jax.__version__}
        with open(args.out, "w") as f:
            json.dump({**meta, **results}, f, indent=1)


if __name__ == "__main__":
    main()
