"""Probe (TPU only): 256 frames gathered from a ring of 20,000, by XLA and by DMA, and the
conv step fed by each inside its jit.

``take2d``: XLA's gather from ``uint32[n, 7056]`` (a frame's words, one row each);
``take4d``: from ``uint32[1, n, 56, 128]`` (each frame whole ``(8, 128)`` tiles, the ring's
"tiles" layout); ``dma_d{k}``: ``grain_replay.device.row_dma.gather_rows`` with ``k`` copies
in flight (bit-exactness checked); ``*_frames``: the gather plus the relayout to
``uint8[256, 84, 84, 4]``; ``conv_*``: the Nature-DQN step with its batch gathered inside
the jit. ms, medians of 30 (steps: of 3 windows of 200). Prints one JSON object.

    python benchmarks/probe_row_gather.py
"""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from grain_replay.device import row_dma


def med(f, *a, n=30):
    jax.block_until_ready(f(*a))
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return round(float(np.median(ts)) * 1e3, 4)


N, W, B = 20000, 7056, 256
rng = np.random.default_rng(0)
host = rng.integers(0, 2**32, size=(N, 7168), dtype=np.uint32)
buf2 = jax.device_put(host[:, :W])
buf4 = jax.device_put(host.reshape(1, N, 56, 128))
slots = jax.device_put(rng.integers(0, N, B).astype(np.int32))
want = host[:, :W][np.asarray(slots)]
res = {}
res["take2d_ms"] = med(jax.jit(lambda b, s: jnp.take(b, s, axis=0, mode="clip")), buf2, slots)
res["take4d_ms"] = med(jax.jit(lambda b, s: jnp.take(b, s, axis=1, mode="clip")), buf4, slots)
for d in (4, 8, 16, 32, 64, 128):
    row_dma.IN_FLIGHT = d
    f = jax.jit(row_dma.gather_rows)
    try:
        res[f"dma_d{d}_ms"] = med(f, buf4, slots)
        got = np.asarray(f(buf4, slots)).reshape(B, 7168)[:, :W]
        res[f"dma_d{d}_ok"] = bool((got == want).all())
    except Exception as e:
        res[f"dma_d{d}_err"] = repr(e)[:400]
    print(json.dumps(res), flush=True)
row_dma.IN_FLIGHT = 16


def frames4(x):
    x = x.reshape(x.shape[1], 7168)[:, :W]
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], 84, 84, 4)


def frames2(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[0], 84, 84, 4)


res["dma_frames_ms"] = med(jax.jit(lambda b, s: frames4(row_dma.gather_rows(b, s))), buf4, slots)
res["take2d_frames_ms"] = med(jax.jit(lambda b, s: frames2(jnp.take(b, s, axis=0))), buf2, slots)
g = jax.jit(row_dma.gather_rows)(buf4, slots)
res["unpack_only_ms"] = med(jax.jit(frames4), g)
print(json.dumps(res), flush=True)


def init(key):
    ks = jax.random.split(key, 5)
    return {
        "c1": jax.random.normal(ks[0], (8, 8, 4, 32)) * 0.05,
        "c2": jax.random.normal(ks[1], (4, 4, 32, 64)) * 0.05,
        "c3": jax.random.normal(ks[2], (3, 3, 64, 64)) * 0.05,
        "d1": jax.random.normal(ks[3], (7 * 7 * 64, 512)) * 0.01,
        "d2": jax.random.normal(ks[4], (512, 6)) * 0.01,
    }


def net(p, x):
    x = x.astype(jnp.float32) / 255.0
    dn = ("NHWC", "HWIO", "NHWC")
    x = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c1"], (4, 4), "VALID", dimension_numbers=dn))
    x = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c2"], (2, 2), "VALID", dimension_numbers=dn))
    x = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c3"], (1, 1), "VALID", dimension_numbers=dn))
    x = jax.nn.relu(x.reshape(x.shape[0], -1) @ p["d1"])
    return x @ p["d2"]


def upd(p, x):
    g = jax.grad(lambda p, x: jnp.mean(net(p, x) ** 2))(p, x)
    return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)


p = init(jax.random.key(0))
xdev = frames2(buf2[:B])


def loop(step, p, *a, n=200):
    p = step(p, *a)
    jax.block_until_ready(p)
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            p = step(p, *a)
        jax.block_until_ready(p)
        ts.append((time.perf_counter() - t) / n)
    return round(float(np.median(ts)) * 1e3, 4), p


res["conv_bare_ms"], p = loop(jax.jit(upd, donate_argnums=0), p, xdev)


@functools.partial(jax.jit, donate_argnums=0)
def step4(p, b, key):
    s = jax.random.randint(key, (B,), 0, N, jnp.int32)
    return upd(p, frames4(row_dma.gather_rows(b, s)))


@functools.partial(jax.jit, donate_argnums=0)
def step2(p, b, key):
    s = jax.random.randint(key, (B,), 0, N, jnp.int32)
    return upd(p, frames2(jnp.take(b, s, axis=0)))


k = jax.random.key(1)
res["conv_dma_ms"], p = loop(step4, p, buf4, k)
res["conv_take2d_ms"], p = loop(step2, p, buf2, k)
print("FINAL", json.dumps(res, indent=1), flush=True)
