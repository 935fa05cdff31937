"""Probe: the chip's time of ``DeviceReplay``'s prioritized draw and priority update.

For rings of ``--slots`` (default 10^6 and 5*10^4), 256 draws or 256 updated priorities
per iteration, 100 iterations in one jitted loop (so only the device's time counts), on
whatever backend jax runs: ``draw`` (``replay_draws.prioritized``), ``randint`` (a uniform
draw's random numbers, for scale), ``update-one-hot`` (entries set by one matmul,
``replay_tree.set_entries``, and the levels above level 0 rebuilt in one reduction: what
rings of up to ``replay_tree.ONE_HOT_LINES`` lines do), ``update-rebuilt`` (entries set by
scatters, levels rebuilt: rings up to ``replay_tree.DENSE_SLOTS``) and ``update-touched``
(scatters, and only the touched lines' entries recomputed level by level: larger rings).
ms an iteration, median of 3; every update's trees are checked equal to a rebuild from
the priorities, and the one-hot update's state bit for bit the scatters'.

    python benchmarks/probe_priority_update.py [--slots 1000000,50000]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grain_replay.device import replay_draws as draws
from grain_replay.device import replay_tree as tree
from grain_replay.device.replay_state import StateLayout

B, ALPHA, EPS, BETA = 256, 0.6, 1e-6, 0.4


def _chip_ms(body: Any, carry: Any, n: int = 100) -> tuple[float, Any]:
    loop = jax.jit(lambda c: jax.lax.fori_loop(0, n, body, c))
    out = jax.block_until_ready(loop(carry))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        out = jax.block_until_ready(loop(carry))
        times.append(time.perf_counter() - t)
    return round(sorted(times)[1] / n * 1e3, 4), out


def ring(c: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    priority = jnp.asarray(rng.random(c).astype(np.float32))
    live = jnp.asarray(rng.random(c) < 0.95)
    sums, mins = jax.jit(lambda p, lv: tree.build(p, lv, ALPHA, EPS))(priority, live)
    key = jax.random.key(0)
    out: dict[str, Any] = {}

    def draw(i: Any, acc: Any) -> Any:
        slots, weight = draws.prioritized(jax.random.fold_in(key, i), sums, mins, B, BETA)
        return acc + slots.sum() + weight.sum()

    out["draw"], _ = _chip_ms(draw, jnp.float32(0))
    out["randint"], _ = _chip_ms(
        lambda i, acc: acc + jax.random.randint(jax.random.fold_in(key, i), (B,), 0, c).sum(),
        jnp.int32(0),
    )
    at = StateLayout(c, 1, prioritized=True)
    mass0 = jax.jit(at.mass)(priority, jnp.float32(1), sums, mins)
    saved = tree.DENSE_SLOTS, tree.ONE_HOT_LINES
    masses = {}
    for name, dense, one_hot in (
        ("update-one-hot", 1 << 40, 1 << 30),
        ("update-rebuilt", 1 << 40, 0),
        ("update-touched", 0, 0),
    ):
        tree.DENSE_SLOTS, tree.ONE_HOT_LINES = dense, one_hot

        def update(i: Any, mass: Any) -> Any:
            k = jax.random.fold_in(key, i)
            index = jax.random.randint(k, (B,), 0, c)
            given = jax.random.uniform(k, (B,))
            return draws.updated_priorities(mass, at, live, index, given, ALPHA, EPS)

        try:
            out[name], mass = _chip_ms(update, mass0)
        finally:
            tree.DENSE_SLOTS, tree.ONE_HOT_LINES = saved
        masses[name] = mass
        want_s, want_m = tree.build(at.priority(mass), live, ALPHA, EPS)
        got = (*at.sums(mass), *at.mins(mass))
        out[f"{name}-matches-rebuild"] = all(
            np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4)
            for a, b in zip((*want_s, *want_m), got, strict=True)
        )
    same = masses["update-one-hot"] == masses["update-rebuilt"]
    out["one-hot-is-the-scatter-bit-for-bit"] = bool(jnp.all(same))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", default="1000000,50000")
    args = p.parse_args(argv)
    res = {"backend": jax.default_backend(), "jax": jax.__version__}
    for c in (int(x) for x in args.slots.split(",")):
        res[str(c)] = ring(c)
        print(c, json.dumps(res[str(c)]), flush=True)


if __name__ == "__main__":
    main()
