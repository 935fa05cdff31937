# ruff: noqa: B023  (an ad hoc probe: loops of closures timed on the spot)
"""Probe: what the host pays a jax call, and where a host-fed step's time goes.

The ceiling study behind issue 41's host-fed and ``DeviceReplay`` targets. On whatever
backend jax runs (the numbers in ``benchmarks/README.md`` are a TPU v5e's), each case is
timed as ``[wall ms, calling thread's CPU ms]`` a call (median of 3 windows):

- ``jit-in{k}-out{1,k}``, ``jit-donated{k}``: an elementwise jitted call with ``k`` small
  inputs returning 1 or ``k`` arrays (donated: the inputs' buffers reused): the host cost
  of a call and of each array it returns;
- ``{mlp,conv}-step-chip``: the chip's time of one training step (100 in one jitted loop);
  ``-step-loop``: the benchmark's step loop (one call a step, batches on the device);
- ``{w}-g{n}-put-unpack`` / ``-unpack`` / ``-put``: a packed transfer of ``n`` batches
  (``grain_replay.device.packed``): the host's pack + put + unpack program, the unpack
  program alone, the asynchronous put alone (a group each);
- ``{w}-loader-w{0,4}``: ``make_data_loader`` alone, a batch;
- ``{w}-fed-w{0,4}-pre{2,8}`` (and ``-nostep``): the step fed by ``make_data_loader`` +
  ``sharded_device_put(prefetch=...)`` (without the step: the producer's rate alone).

    python benchmarks/probe_host_dispatch.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
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


def _timed(fn: Callable[[int], Any], k: int) -> list[float]:
    """``[wall ms, thread CPU ms]`` a call of ``fn(k)`` (which makes ``k`` calls), median of 3."""
    fn(min(k, 8))
    runs = []
    for _ in range(3):
        t, c = time.perf_counter(), time.thread_time()
        fn(k)
        runs.append(((time.perf_counter() - t) / k, (time.thread_time() - c) / k))
    wall, cpu = sorted(runs)[1]
    return [round(wall * 1e3, 4), round(cpu * 1e3, 4)]


def dispatch(out: dict[str, Any], k: int) -> None:
    for n in (1, 6, 12, 24):
        xs = [jnp.zeros((8, 128)) + i for i in range(n)]
        one = jax.jit(lambda *a: a[0] + 1)
        each = jax.jit(lambda *a: tuple(x + 1 for x in a))

        def call(f: Any) -> Callable[[int], None]:
            def run(m: int) -> None:
                for _ in range(m):
                    r = f(*xs)
                jax.block_until_ready(r)

            return run

        out[f"jit-in{n}-out1"] = _timed(call(one), k)
        out[f"jit-in{n}-out{n}"] = _timed(call(each), k)
        donated = jax.jit(lambda *a: tuple(x + 1 for x in a), donate_argnums=tuple(range(n)))
        held = {"ys": donated(*[x + 0 for x in xs])}

        def chained(m: int) -> None:
            ys = held["ys"]
            for _ in range(m):
                ys = donated(*ys)
            held["ys"] = jax.block_until_ready(ys)

        out[f"jit-donated{n}"] = _timed(chained, k)


def workload(name: str, tree: dict[str, np.ndarray], root: str, k: int, out: dict) -> None:
    path = f"{root}/{name}"
    gr.write(path, tree)
    src = gr.open_source(path)
    b = 256 if len(next(iter(tree.values()))) >= 4096 else 32
    n = len(next(iter(tree.values())))
    rng = np.random.default_rng(0)
    host = [src.read_batch(np.sort(rng.choice(n, b, replace=False))) for _ in range(8)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    on_device = [jax.device_put(h, sharding) for h in host]
    q, params, next_key = (
        (mlp_q, mlp_params, "next_obs") if name == "mlp" else (conv_q, conv_params, "obs")
    )
    train = make_train(q, next_key)
    ones = jnp.ones(b, jnp.float32)

    def body(p: Any, batch: Any) -> Any:
        return train(p, {c: v for c, v in batch.items() if c != "discount"}, ones)[0]

    step = jax.jit(body)
    many = jax.jit(lambda p, batch: jax.lax.fori_loop(0, 100, lambda i, p: body(p, batch), p))
    state = {"p": jax.block_until_ready(step(params(np.random.default_rng(0)), on_device[0]))}
    jax.block_until_ready(many(state["p"], on_device[0]))
    t = time.perf_counter()
    jax.block_until_ready(many(state["p"], on_device[0]))
    out[f"{name}-step-chip"] = round((time.perf_counter() - t) * 1e3 / 100, 4)

    def steps(source: Callable[[], Any]) -> Callable[[int], None]:
        def run(m: int) -> None:
            p = state["p"]
            for _ in range(m):
                p = step(p, source())
            state["p"] = jax.block_until_ready(p)

        return run

    turn = iter(range(1 << 60))
    out[f"{name}-step-loop"] = _timed(steps(lambda: on_device[next(turn) % 8]), k)
    leaves = [jax.tree_util.tree_leaves(h) for h in host]
    for g in (1, 7, 16) if name == "mlp" else (1,):
        arrays = [a for i in range(g) for a in leaves[i % 8]]
        layout = packing.plan(arrays, [sharding] * len(arrays))
        if layout is None:
            continue
        flat = np.zeros((layout.rows, 128), np.uint32)
        buf = jax.device_put(flat, layout.buffer_sharding)

        def loop(f: Callable[[], Any]) -> Callable[[int], None]:
            def run(m: int) -> None:
                for _ in range(m):
                    r = f()
                jax.block_until_ready(r)

            return run

        per = max(8, k // 4)
        out[f"{name}-g{g}-put-unpack"] = _timed(loop(lambda: layout.put(arrays)), per)
        out[f"{name}-g{g}-unpack"] = _timed(loop(lambda: layout.unpack(buf)), per)
        out[f"{name}-g{g}-put"] = _timed(
            loop(lambda: jax.device_put(flat, layout.buffer_sharding)), per
        )
    for w in (0, 4):
        it = iter(gr.make_data_loader(src, batch_size=b, num_epochs=None, seed=1, worker_count=w))

        def pull(m: int) -> None:
            for _ in range(m):
                next(it)

        out[f"{name}-loader-w{w}"] = _timed(pull, k)
        for pre in (2, 8):
            loader = gr.make_data_loader(src, batch_size=b, num_epochs=None, seed=1, worker_count=w)
            fed = gr.sharded_device_put(loader, sharding, prefetch=pre)
            next(fed)
            out[f"{name}-fed-w{w}-pre{pre}"] = _timed(steps(lambda: next(fed)), k)

            def drain(m: int) -> None:
                for _ in range(m):
                    r = next(fed)
                jax.block_until_ready(r)

            out[f"{name}-fed-w{w}-pre{pre}-nostep"] = _timed(drain, k)
        print(json.dumps(out), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="toy sizes (a CPU smoke run)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    rows, images, k = (2_000, 200, 20) if args.quick else (200_000, 20_000, 1500)
    out: dict[str, Any] = {"backend": jax.default_backend(), "jax": jax.__version__}
    dispatch(out, 200 if args.quick else 2000)
    with tempfile.TemporaryDirectory() as root:
        workload("mlp", transitions(rows), root, k, out)
        workload("conv", frames(images), root, max(8, k // 4), out)
    for c, v in out.items():
        print(f"{c:28s} {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
