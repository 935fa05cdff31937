# ruff: noqa: B023  (an ad hoc probe: loops of closures timed on the spot)
"""Probe: how fast can a host batch get into HBM, and what does unpacking it cost on the chip?

The ceiling study behind ``sharded_device_put``'s packed transfers (issue 41, point 1).
For the two batch shapes of ``bench_device.py`` (transitions: 5 leaves, 134 KB a batch of
256; frames: ``uint8[256, 84, 84, 4]``, 7.2 MB) it times, on whatever backend jax runs:

- ``plain``: ``jax.device_put`` of the numpy leaves, blocked on each batch;
- ``plain-4``: the same with 4 batches in flight (block on the one put 4 earlier);
- ``flat-u8`` / ``flat-u8-4``: the batch's bytes as one ``uint8[n, 128]`` buffer, 1 or 4 in flight;
- ``flat-u32-4``: the same bytes as ``uint32[n / 4, 128]``, 4 in flight;
- ``flat-u8-split4``: one batch as 4 ``uint8[n / 4, 128]`` puts issued together;
- ``pinned-fill``: bytes memmoved into a reused ``pinned_host`` buffer, then put to HBM;
- ``unpack``: the jitted unpack of a packed buffer already on the chip into the leaves;
- ``pack``: the host copy of the leaves into a packed buffer (reused);
- ``packed-pipeline``: pack + put (4 in flight) + unpack, what a packed sharded_device_put does.

Prints one line per case: batches/s and GB/s, medians of ``--repeats`` windows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from bench_feed import InFlight


def _batches(kind: str, b: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if kind == "transitions":
        return {
            "obs": rng.standard_normal((b, 64), dtype=np.float32),
            "action": rng.integers(0, 18, b, dtype=np.int32),
            "reward": rng.random(b, dtype=np.float32),
            "next_obs": rng.standard_normal((b, 64), dtype=np.float32),
            "done": rng.random(b) < 0.01,
        }
    return {"obs": rng.integers(0, 256, (b, 84, 84, 4), dtype=np.uint8)}


def _layout(batch: dict[str, np.ndarray]) -> list[tuple[str, np.dtype, tuple[int, ...], int, int]]:
    out, row = [], 0
    for k, v in batch.items():
        rows = -(-v.nbytes // 128)
        out.append((k, v.dtype, v.shape, row, v.nbytes))
        row += rows
    return out


def _pack(batch: dict[str, np.ndarray], layout: Any, buf: np.ndarray) -> np.ndarray:
    flat = buf.reshape(-1)
    for k, _, _, row, nbytes in layout:
        flat[row * 128 : row * 128 + nbytes] = batch[k].reshape(-1).view(np.uint8)
    return buf


def _unpacker(layout: Any) -> Callable[[Any], Any]:
    def unpack(x: Any) -> Any:
        out = {}
        for k, dtype, shape, row, nbytes in layout:
            rows = -(-nbytes // 128)
            part = x[row : row + rows].reshape(-1)[:nbytes]
            if dtype == np.bool_:
                out[k] = (part != 0).reshape(shape)
            elif dtype.itemsize == 1:
                out[k] = jax.lax.bitcast_convert_type(part, dtype).reshape(shape)
            else:
                part = part.reshape(-1, dtype.itemsize)
                out[k] = jax.lax.bitcast_convert_type(part, dtype).reshape(shape)
        return out

    return jax.jit(unpack)


def _time(fn: Callable[[], Any], n: int, repeats: int, flush: Callable[[], Any] | None) -> float:
    """Median seconds per call over ``repeats`` windows of ``n`` calls (after a warm-up)."""
    for _ in range(max(3, n // 4)):
        fn()
    if flush:
        flush()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if flush:
            flush()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", default="")
    args = p.parse_args()
    dev = jax.devices()[0]
    s_dev = jax.sharding.SingleDeviceSharding(dev)
    kinds = {m.kind for m in dev.addressable_memories()}
    print(f"backend {jax.default_backend()} device {dev} memories {sorted(kinds)}", flush=True)
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    for kind, n in (("transitions", 400), ("frames", 60)):
        batch = _batches(kind, args.batch, rng)
        layout = _layout(batch)
        rows = sum(-(-nb // 128) for *_, nb in layout)
        nbytes = sum(v.nbytes for v in batch.values())
        buf = np.zeros((rows, 128), np.uint8)
        _pack(batch, layout, buf)
        unpack = _unpacker(layout)
        got = unpack(jax.device_put(buf, s_dev))
        for k, v in batch.items():
            assert np.array_equal(np.asarray(got[k]), v), k
        u32 = buf.reshape(-1).view(np.uint32).reshape(-1, 128) if rows % 4 == 0 else None
        cases: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = {}
        cases["plain"] = (lambda: jax.block_until_ready(jax.device_put(batch, s_dev)), None)
        f4 = InFlight(4)
        cases["plain-4"] = (lambda: f4.push(jax.device_put(batch, s_dev)), f4.flush)
        cases["flat-u8"] = (lambda: jax.block_until_ready(jax.device_put(buf, s_dev)), None)
        g4 = InFlight(4)
        cases["flat-u8-4"] = (lambda: g4.push(jax.device_put(buf, s_dev)), g4.flush)
        if u32 is not None:
            h4 = InFlight(4)
            cases["flat-u32-4"] = (lambda: h4.push(jax.device_put(u32, s_dev)), h4.flush)
        if rows % 4 == 0:
            parts = np.split(buf, 4)
            i4 = InFlight(4)
            cases["flat-u8-split4"] = (
                lambda: i4.push([jax.device_put(q, s_dev) for q in parts]),
                i4.flush,
            )
        if "pinned_host" in kinds:
            s_pin = s_dev.with_memory_kind("pinned_host")
            s_hbm = s_dev.with_memory_kind("device")
            t0 = time.perf_counter()
            pin = jax.device_put(buf, s_pin)
            jax.block_until_ready(pin)
            results[f"{kind}/numpy->pinned_s"] = time.perf_counter() - t0
            cases["pinned->hbm"] = (lambda: jax.block_until_ready(jax.device_put(pin, s_hbm)), None)
            try:
                ptr = pin.addressable_data(0).unsafe_buffer_pointer()
                src = buf.ctypes.data

                def fill_put() -> Any:
                    ctypes.memmove(ptr, src, buf.nbytes)
                    return jax.block_until_ready(jax.device_put(pin, s_hbm))

                cases["pinned-fill+put"] = (fill_put, None)
            except Exception as e:
                results[f"{kind}/pinned_pointer_error"] = repr(e)
        on = jax.device_put(buf, s_dev)
        cases["unpack"] = (lambda: jax.block_until_ready(unpack(on)), None)
        spare = np.zeros_like(buf)
        cases["pack"] = (lambda: _pack(batch, layout, spare), None)
        k4 = InFlight(4)
        cases["packed-pipeline"] = (
            lambda: k4.push(
                unpack(jax.device_put(_pack(batch, layout, np.empty_like(buf)), s_dev))
            ),
            k4.flush,
        )
        for name, (fn, flush) in cases.items():
            try:
                s = _time(fn, n, args.repeats, flush)
            except Exception as e:
                print(f"{kind:12s} {name:18s} failed: {e!r}", flush=True)
                results[f"{kind}/{name}"] = repr(e)
                continue
            results[f"{kind}/{name}"] = s
            print(
                f"{kind:12s} {name:18s} {1 / s:9.1f} batches/s {nbytes / s / 1e9:7.2f} GB/s"
                f" ({s * 1e3:.3f} ms)",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
