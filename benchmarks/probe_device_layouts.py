"""What sampling inside a jitted training step costs on an accelerator, by ring layout.

The ceiling study behind ``gr.DeviceReplay``'s layouts (#41): the same training steps as
``bench_device_replay.py`` (a 3-layer MLP on 525 B transitions, a DQN conv net on
84x84x4 uint8 frames, batch 256), each fed by a gather from a device ring laid out one way
or another, against the bare step on a fixed device batch. The key is carried in the step's
output, as a training loop does (no per-step host work). Prints steps/s, the ratio to the
bare step and the HBM each ring takes (``memory_stats``; None on CPU).

Usage: python benchmarks/probe_device_layouts.py [--quick] [--steps N] [--repeats N]
         [--only mlp|conv|prio] [--cases REGEX]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_device_replay import conv_params, conv_q, make_train, mlp_params, mlp_q

B = 256


def _in_use() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if stats is None else int(stats.get("bytes_in_use", 0))


def _rate(step: Callable[[Any], Any], carry: Any, steps: int, repeats: int) -> float:
    carry = jax.block_until_ready(step(carry))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(steps):
            carry = step(carry)
        jax.block_until_ready(carry)
        times.append(time.perf_counter() - t)
    return steps / statistics.median(times)


def _put(tree: Any) -> Any:
    before = _in_use()
    out = jax.block_until_ready(jax.device_put(tree, jax.devices()[0]))
    after = _in_use()
    return out, (None if before is None or after is None else after - before)


def _draw(key: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    key, sub = jax.random.split(key)
    return key, jax.random.randint(sub, (B,), 0, n)


def _select(lines: jax.Array, lane_block: jax.Array, k: int) -> jax.Array:
    """Rows ``lane_block`` (B,) of (B, 128) lines holding k rows of 128 // k lanes each."""
    rows = lines.reshape(lines.shape[0], k, lines.shape[1] // k)
    return jnp.take_along_axis(rows, lane_block[:, None, None], 1)[:, 0]


def mlp_cases(n: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((n, 64), dtype=np.float32)
    nxt = rng.standard_normal((n, 64), dtype=np.float32)
    act = rng.integers(0, 8, n).astype(np.int32)
    rew = rng.standard_normal(n, dtype=np.float32)
    done = (rng.random(n) < 0.01).astype(np.float32)
    natural = {"obs": obs, "next_obs": nxt, "action": act, "reward": rew, "done": done}

    def gather_natural(ring: Any, idx: jax.Array) -> Any:
        return {k: v[idx] for k, v in ring.items()}

    # Two 64-float rows a 128-lane line; scalars 128 a line: no tile padding.
    packed = {
        "obs": obs.reshape(n // 2, 128),
        "next_obs": nxt.reshape(n // 2, 128),
        "scalars": np.stack([act.view(np.float32), rew, done], 0).reshape(3, n // 128, 128),
    }

    def gather_packed(ring: Any, idx: jax.Array) -> Any:
        out = {k: _select(ring[k][idx // 2], idx % 2, 2) for k in ("obs", "next_obs")}
        s = ring["scalars"][:, idx // 128]  # (3, B, 128)
        s = jnp.take_along_axis(s, (idx % 128)[None, :, None], 2)[..., 0]
        out["action"] = jax.lax.bitcast_convert_type(s[0], jnp.int32)
        out["reward"], out["done"] = s[1], s[2]
        return out

    return {
        "natural": (natural, gather_natural),
        "packed": (packed, gather_packed),
    }


def frame_cases(n: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 255, (n, 84, 84, 4), dtype=np.uint8)
    act = rng.integers(0, 8, n).astype(np.int32)
    rew = rng.standard_normal(n, dtype=np.float32)
    done = (rng.random(n) < 0.01).astype(np.float32)
    small = {"action": act, "reward": rew, "done": done}

    def with_small(gather_obs: Callable[[Any, jax.Array], jax.Array]) -> Callable[..., Any]:
        def gather(ring: Any, idx: jax.Array) -> Any:
            out = {k: ring[k][idx] for k in small}
            out["obs"] = gather_obs(ring["obs"], idx)
            return out

        return gather

    cases = {
        "flat-u8": (
            {**small, "obs": obs.reshape(n, -1)},
            with_small(lambda r, i: r[i].reshape(B, 84, 84, 4)),
        ),
        "rows-u8 (n,84,336)": (
            {**small, "obs": obs.reshape(n, 84, 336)},
            with_small(lambda r, i: r[i].reshape(B, 84, 84, 4)),
        ),
        "flat-u32+bitcast": (
            {**small, "obs": obs.reshape(n, -1).view(np.uint32)},
            with_small(
                lambda r, i: jax.lax.bitcast_convert_type(r[i], jnp.uint8).reshape(B, 84, 84, 4)
            ),
        ),
    }
    # The gathered rows materialized before the step reads them (no gather fused into the
    # conv's input): what resident replay's separate gather program gets.
    cases["flat-u8+barrier"] = (
        {**small, "obs": obs.reshape(n, -1)},
        with_small(lambda r, i: jax.lax.optimization_barrier(r[i]).reshape(B, 84, 84, 4)),
    )
    # Frames as columns (the ring's minor axis the frame): the gathered batch comes out
    # batch-minor, the layout the chip keeps a (256, 84, 84, 4) uint8 batch in; no tile
    # padding (28,224 rows of 32, frames of 128).
    cols = np.ascontiguousarray(obs.reshape(n, -1).T)
    cases["cols-u8 (28224,n)"] = (
        {**small, "obs": cols},
        with_small(lambda r, i: jnp.transpose(r[:, i].reshape(84, 84, 4, B), (3, 0, 1, 2))),
    )
    words = np.ascontiguousarray(obs.reshape(n, -1).view(np.uint32).T)  # (7056, n)
    cases["cols-u32 (7056,n)"] = (
        {**small, "obs": words},
        with_small(
            lambda r, i: jnp.transpose(
                jax.lax.bitcast_convert_type(r[:, i], jnp.uint8).reshape(84, 84, B, 4),
                (2, 0, 1, 3),
            )
        ),
    )
    del cols, words
    m = min(n, 2048)  # the natural layout pads 4 -> 128 lanes: only a small ring fits
    cases[f"natural (first {m})"] = (
        {**{k: v[:m] for k, v in small.items()}, "obs": obs[:m]},
        with_small(lambda r, i: r[i % m]),
    )
    return cases


def run_model(name: str, cases: dict[str, Any], args: argparse.Namespace) -> None:
    q, make_params, nxt = (
        (mlp_q, mlp_params, "next_obs") if name == "mlp" else (conv_q, conv_params, "obs")
    )
    train = make_train(q, nxt)
    params = make_params(np.random.default_rng(0))
    ones = jnp.ones(B, jnp.float32)
    first_ring, first_gather = next(iter(cases.values()))
    fixed_ring, _ = _put(first_ring)
    fixed = jax.jit(lambda r: first_gather(r, jnp.arange(B)))(fixed_ring)
    del fixed_ring

    bare_jit = jax.jit(
        lambda carry, batch: (train(carry[0], batch, ones)[0], jax.random.split(carry[1])[0])
    )

    def bare(carry: Any) -> Any:  # the batch an argument, as a step fed from outside gets it
        return bare_jit(carry, fixed)

    base = _rate(bare, (params, jax.random.key(1)), args.steps, args.repeats)
    print(f"{name:5s} {'bare step (fixed device batch)':28s} {base:9.1f}/s   1.00")
    for case, (host, gather) in cases.items():
        if args.cases and not re.search(args.cases, case):
            continue
        ring, used = _put(host)
        n = len(jax.tree.leaves(host)[0]) if case != "packed" else len(first_ring["obs"])

        def step(carry: Any, ring: Any, gather: Any = gather, n: int = n) -> Any:
            p, key = carry
            key, idx = _draw(key, n)
            return train(p, gather(ring, idx), ones)[0], key

        step_jit = jax.jit(step)
        rate = _rate(
            lambda c, r=ring, s=step_jit: s(c, r),
            (params, jax.random.key(1)),
            args.steps,
            args.repeats,
        )
        host_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(host))
        mem = "n/a" if used is None else f"{used / host_bytes:.2f}x"
        size = f"{host_bytes >> 20} MiB"
        print(f"{name:5s} {case:28s} {rate:9.1f}/s  {rate / base:5.2f}  HBM {mem} of {size}")
        jax.tree.map(lambda x: x.delete(), ring)


def prioritized_cases(cap: int, args: argparse.Namespace) -> None:
    """The draw alone: a full cumsum over the ring vs a 3-level sum tree of 128-wide blocks."""
    rng = np.random.default_rng(0)
    p = jnp.asarray(rng.random(cap, dtype=np.float32))

    @jax.jit
    def full(carry: Any) -> Any:
        key, acc = carry
        key, sub = jax.random.split(key)
        c = jnp.cumsum(p)
        idx = jnp.searchsorted(c, jax.random.uniform(sub, (B,)) * c[-1])
        return key, acc + idx.sum()

    l1 = p.reshape(-1, 128).sum(1)  # cap/128
    l2 = jnp.pad(l1, (0, (-l1.size) % 128)).reshape(-1, 128).sum(1)
    tri = jnp.triu(jnp.ones((128, 128), jnp.float32))
    hi = jax.lax.Precision.HIGHEST

    def descend(blocks: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = jnp.dot(blocks, tri, precision=hi)  # (B, 128) inclusive sums
        j = jnp.minimum((c < u[:, None]).sum(1), 127)
        before = jnp.where(j > 0, jnp.take_along_axis(c, (j - 1)[:, None], 1)[:, 0], 0.0)
        return j, u - before

    l1p = jnp.pad(l1, (0, (-l1.size) % 128))

    @jax.jit
    def tree(carry: Any) -> Any:
        key, acc = carry
        key, sub = jax.random.split(key)
        c2 = jnp.cumsum(l2)
        u = jax.random.uniform(sub, (B,)) * c2[-1]
        b2 = jnp.minimum(jnp.searchsorted(c2, u, side="right"), l2.size - 1)
        u = u - jnp.where(b2 > 0, c2[b2 - 1], 0.0)
        j1, u = descend(l1p.reshape(-1, 128)[b2], u)
        b1 = b2 * 128 + j1
        j0, _ = descend(p.reshape(-1, 128)[b1], u)
        return key, acc + (b1 * 128 + j0).sum()

    for label, fn in (("full cumsum", full), ("3-level tree", tree)):
        rate = _rate(fn, (jax.random.key(0), jnp.int32(0)), args.steps, args.repeats)
        print(f"prio  {label:28s} {1e6 / rate:9.1f} us a draw of {B} over {cap} rows")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="mlp, conv or prio")
    ap.add_argument("--cases", default="", help="a regex: only the ring layouts it matches")
    args = ap.parse_args()
    n_rows, n_frames = (4096, 64) if args.quick else (1 << 20, 50_000)
    if args.quick:
        args.steps = min(args.steps, 5)
    print(f"device: {jax.devices()[0].device_kind}, batch {B}")
    if args.only in ("", "mlp"):
        run_model("mlp", mlp_cases(n_rows), args)
    if args.only in ("", "conv"):
        run_model("conv", frame_cases(n_frames), args)
    if args.only in ("", "prio"):
        prioritized_cases(n_rows, args)


if __name__ == "__main__":
    main()
