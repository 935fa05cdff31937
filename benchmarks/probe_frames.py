# ruff: noqa: E501, B007, B023  (an ad hoc probe: loops of closures timed on the spot)
"""Probe: the TPU layout of a uint8[256, 84, 84, 4] frame batch, ways to build it, what each costs."""

from __future__ import annotations

import concurrent.futures
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def timeit(fn, n=40, repeats=5):
    for _ in range(5):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def mem():
    return (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0)


def main():
    dev = jax.devices()[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    rng = np.random.default_rng(0)
    b = 256
    frames = rng.integers(0, 256, (b, 84, 84, 4), dtype=np.uint8)
    m0 = mem()
    x = jax.device_put(frames, s)
    x.block_until_ready()
    print(
        "plain put format:",
        getattr(x, "format", None),
        "bytes",
        mem() - m0,
        "of",
        frames.nbytes,
        flush=True,
    )
    for shape in [(b, 84, 336), (b, 28224), (b * 28224 // 128, 128), (b, 84, 84, 4)]:
        y = jnp.zeros(shape, jnp.uint8)
        print(shape, getattr(y, "format", None), flush=True)
    per = 28224
    pad_rows = -(-per // 128)  # 221
    flat = np.zeros((b, pad_rows * 128), np.uint8)
    flat[:, :per] = frames.reshape(b, per)
    flat2 = flat.reshape(b * pad_rows, 128)
    dflat = jax.device_put(flat2, s)
    tight = frames.reshape(-1, 128)
    dtight = jax.device_put(tight, s)
    variants = {
        "1d": (lambda x: x.reshape(-1).reshape(b, 84, 84, 4), dtight),
        "rows-padded": (
            lambda x: x.reshape(b, pad_rows * 128)[:, :per].reshape(b, 84, 84, 4),
            dflat,
        ),
        "via-336": (lambda x: x.reshape(b, 84, 336).reshape(b, 84, 84, 4), dtight),
        "u32-bitcast": (
            lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(b, 84, 84, 4),
            jax.device_put(frames.reshape(b, 84, 84, 4).view(np.uint32).reshape(b, 84, 84), s),
        ),
        "copy-same-shape": (lambda x: x + 1, x),
    }
    for name, (f, arg) in variants.items():
        jf = jax.jit(f)
        try:
            out = jf(arg)
            ok = name == "copy-same-shape" or np.array_equal(np.asarray(out), frames)
            t = timeit(lambda: jax.block_until_ready(jf(arg)))
            print(
                f"unpack {name:16s} {t * 1e3:.3f} ms ok={ok} out format {getattr(out, 'format', None)}",
                flush=True,
            )
        except Exception as e:
            print(f"unpack {name} failed {e!r}"[:300], flush=True)
    # many plain puts in flight from threads
    for threads in (1, 2, 4, 8):
        pool = concurrent.futures.ThreadPoolExecutor(threads)

        def put_one(_):
            return jax.block_until_ready(jax.device_put(frames, s))

        def burst(k=threads * 4):
            list(pool.map(put_one, range(k)))

        t = timeit(burst, n=5, repeats=5) / (threads * 4)
        print(
            f"plain put, {threads} threads: {1 / t:.1f} batches/s {frames.nbytes / t / 1e9:.2f} GB/s",
            flush=True,
        )
        pool.shutdown()
    # async puts from one thread, k in flight
    for k in (2, 4, 8, 16):

        def burst2(k=k):
            jax.block_until_ready([jax.device_put(frames, s) for _ in range(k)])

        t = timeit(burst2, n=5, repeats=5) / k
        print(
            f"plain put, {k} issued then blocked: {1 / t:.1f} batches/s {frames.nbytes / t / 1e9:.2f} GB/s",
            flush=True,
        )
    # row-split puts then concatenate on device
    parts = np.split(frames, 4)
    cat = jax.jit(lambda *p: jnp.concatenate(p))
    t = timeit(lambda: jax.block_until_ready(cat(*[jax.device_put(p, s) for p in parts])))
    print(f"4 row-parts + concat: {1 / t:.1f} batches/s", flush=True)
    d = jax.device_put(frames, s)
    t = timeit(lambda: jax.block_until_ready(cat(d[:64], d[64:128], d[128:192], d[192:])))
    print(f"concat alone: {t * 1e3:.3f} ms", flush=True)


def transitions():
    dev = jax.devices()[0]
    s = jax.sharding.SingleDeviceSharding(dev)
    rng = np.random.default_rng(0)
    b = 256
    batch = {
        "obs": rng.standard_normal((b, 64), dtype=np.float32),
        "action": rng.integers(0, 18, b, dtype=np.int32),
        "reward": rng.random(b, dtype=np.float32),
        "next_obs": rng.standard_normal((b, 64), dtype=np.float32),
        "done": rng.random(b) < 0.01,
    }
    layout, row = [], 0
    for k, v in batch.items():
        rows = -(-v.nbytes // 512)
        layout.append((k, v.dtype, v.shape, row, rows))
        row += rows
    buf = np.zeros((row, 128), np.uint32)
    for k, dt, shape, r0, rows in layout:
        buf.reshape(-1).view(np.uint8)[r0 * 512 : r0 * 512 + batch[k].nbytes] = (
            batch[k].reshape(-1).view(np.uint8)
        )

    def unpack(x):
        out = {}
        for k, dt, shape, r0, rows in layout:
            slab = x[r0 : r0 + rows]
            n = int(np.prod(shape))
            if dt.itemsize == 4:
                out[k] = jax.lax.bitcast_convert_type(slab, dt).reshape(-1)[:n].reshape(shape)
            else:
                u8 = jax.lax.bitcast_convert_type(slab, jnp.uint8).reshape(-1)[:n]
                out[k] = (u8 != 0).reshape(shape) if dt == np.bool_ else u8.reshape(shape)
        return out

    ju = jax.jit(unpack)
    d = jax.device_put(buf, s)
    got = ju(d)
    ok = all(np.array_equal(np.asarray(got[k]), v) for k, v in batch.items())
    t = timeit(lambda: jax.block_until_ready(ju(d)), n=200)
    print(f"transitions u32 unpack {t * 1e3:.3f} ms ok={ok}", flush=True)
    noop = jax.jit(lambda x: x[0, 0] + 1)
    t = timeit(lambda: jax.block_until_ready(noop(d)), n=200)
    print(f"a tiny jit, blocked: {t * 1e3:.3f} ms", flush=True)
    from collections import deque

    q = deque()

    def piped():
        q.append(ju(jax.device_put(buf, s)))
        while len(q) > 4:
            jax.block_until_ready(q.popleft())

    t = timeit(piped, n=400)
    print(f"transitions u32 put+unpack 4 in flight: {1 / t:.1f} batches/s", flush=True)

    def piped_put():
        q.append(jax.device_put(buf, s))
        while len(q) > 4:
            jax.block_until_ready(q.popleft())

    t = timeit(piped_put, n=400)
    print(f"transitions u32 put 4 in flight: {1 / t:.1f} batches/s", flush=True)


if __name__ == "__main__":
    transitions()
    main()
