# ruff: noqa: E501, B023  (an ad hoc probe: loops of closures timed on the spot)
"""Probe: where the host-fed MLP step loses its rate (issue 41 point 1); ad hoc, on TPU."""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from bench_device_replay import make_train, mlp_params, mlp_q, transitions

import grain_replay as gr
from grain_replay.device.packed import plan


def rate(run, k=2000, repeats=3):
    run(50)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        run(k)
        out.append(k / (time.perf_counter() - t))
    return statistics.median(out)


def main():
    b = 256
    tree = transitions(20_000)
    rng = np.random.default_rng(0)
    hosts = [{k: v[rng.choice(20_000, b)] for k, v in tree.items()} for _ in range(16)]
    sh = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
        jax.sharding.PartitionSpec("data"),
    )
    train = make_train(mlp_q, "next_obs")
    ones = jnp.ones(b, jnp.float32)

    @jax.jit
    def step(p, batch):
        batch = {k: v for k, v in batch.items() if k != "discount"}
        return train(p, batch, ones)[0]

    keys = list(hosts[0])
    lay = plan([hosts[0][k] for k in keys], [sh] * len(keys))
    dev_batches = [jax.device_put(h, sh) for h in hosts]
    st = {"p": mlp_params(np.random.default_rng(0))}
    st["p"] = jax.block_until_ready(step(st["p"], dev_batches[0]))

    def loop(get):
        def run(k):
            p = st["p"]
            for i in range(k):
                p = step(p, get(i))
            st["p"] = jax.block_until_ready(p)

        return run

    print("step on device batches", rate(loop(lambda i: dev_batches[i % 16])), flush=True)
    print(
        "step + plain put inline",
        rate(loop(lambda i: jax.device_put(hosts[i % 16], sh)), k=500),
        flush=True,
    )

    def packed_inline(i):
        return dict(zip(keys, lay.put([hosts[i % 16][k] for k in keys])))

    print("step + packed put+unpack inline", rate(loop(packed_inline), k=500), flush=True)
    # time of the host calls alone while the device idles
    t = time.perf_counter()
    outs = [lay.put([hosts[i % 16][k] for k in keys]) for i in range(500)]
    t1 = time.perf_counter()
    jax.block_until_ready(outs)
    print(
        f"packed put host time {1e3 * (t1 - t) / 500:.3f} ms/batch, all done {1e3 * (time.perf_counter() - t) / 500:.3f}",
        flush=True,
    )
    buf = np.zeros((lay.rows, 128), np.uint32)
    t = time.perf_counter()
    outs = [jax.device_put(buf, jax.devices()[0]) for i in range(500)]
    t1 = time.perf_counter()
    jax.block_until_ready(outs)
    print(
        f"raw put host time {1e3 * (t1 - t) / 500:.3f} ms/batch, all done {1e3 * (time.perf_counter() - t) / 500:.3f}",
        flush=True,
    )
    d = jax.device_put(buf, jax.devices()[0])
    t = time.perf_counter()
    outs = [lay.unpack(d) for i in range(500)]
    t1 = time.perf_counter()
    jax.block_until_ready(outs)
    print(
        f"unpack dispatch host {1e3 * (t1 - t) / 500:.3f} ms, all done {1e3 * (time.perf_counter() - t) / 500:.3f}",
        flush=True,
    )
    t = time.perf_counter()
    p = st["p"]
    for i in range(500):
        p = step(p, dev_batches[i % 16])
    t1 = time.perf_counter()
    jax.block_until_ready(p)
    print(
        f"step dispatch host {1e3 * (t1 - t) / 500:.3f} ms, all done {1e3 * (time.perf_counter() - t) / 500:.3f}",
        flush=True,
    )
    for prefetch in (2, 8, 32):
        for packed in (False, True):
            it = gr.sharded_device_put(itertools.cycle(hosts), sh, prefetch=prefetch, packed=packed)
            print(
                f"step fed by sharded_device_put(list, prefetch={prefetch}, packed={packed})",
                rate(loop(lambda i: next(it)), k=1000),
                flush=True,
            )
            it.close()
    src_path = "/tmp/pf_store"
    gr.write(src_path, tree, overwrite=True)
    src = gr.open_source(src_path)
    for prefetch in (2, 8):
        for w in (0, 4):
            loader = gr.make_data_loader(src, batch_size=b, num_epochs=None, seed=1, worker_count=w)
            it = gr.sharded_device_put(loader, sh, prefetch=prefetch, packed=True)
            print(
                f"step fed by loader w={w} prefetch={prefetch} packed",
                rate(loop(lambda i: next(it)), k=1000),
                flush=True,
            )
            it.close()


if __name__ == "__main__":
    main()
