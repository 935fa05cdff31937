"""gr.DeviceReplay: what sampling inside the training step's jit costs the step.

For two workloads, in the same run, a jitted training step timed three ways:

- ``bare``: the step on a fixed device batch (the limit: no sampling at all);
- ``uniform``: ``replay.sample(state, key, B)`` (uniform) inside the same jit;
- ``prioritized``: ``sample`` + ``update_priorities(|td|)`` inside the jit (the state
  donated, so the priorities are updated in place).

Workloads: ``mlp``, a 3-layer MLP (256 units) Q-learning step on 525-byte transitions
(obs float32[64], next_obs float32[64], action int32, reward float32, discount float32,
done bool); ``conv``, a Nature-DQN-sized conv net on 84x84x4 uint8 frames. Batch 256.
Each rate is the median of ``--repeats`` timings of ``--steps`` steps; the ratio is
the rate with sampling / the bare rate (1.0: sampling is free). Also: the device's
``memory_stats()`` before and after ``init()`` where the backend reports them (TPU,
GPU; not CPU), and the ring's bytes against the store's bytes.

Each step carries ``(params, key)`` and splits the key inside its jit (as a training loop
does: no per-step host work); the bare step gets its batch as an argument, not a constant.

``--peers`` also times flashbax 0.1.3 (when installed) in the same steps: its item
buffer (uniform ``sample`` inside the jit) and its prioritised flat buffer (``sample`` +
``set_priorities``), their states donated, and prints our rate over theirs. Its conv
buffer holds ``--peer-frames`` frames (its natural ``(n, 84, 84, 4)`` layout pads the 4
channels to 128 lanes on a TPU: 50,000 frames would not fit).

    python benchmarks/bench_device_replay.py [--quick] [--rows N] [--frames N]
        [--batch B] [--steps S] [--repeats R] [--peers] [--peer-frames N] [--out FILE]

``--out FILE`` also writes the results as JSON: per workload its rates (``bare``,
``uniform``, ``prioritized``, steps/s) and ratios, and flashbax's rates under ``peers``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import grain_replay as gr

ACTIONS = 8


def transitions(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """525 bytes a row."""
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n, 64), dtype=np.float32),
        "next_obs": rng.standard_normal((n, 64), dtype=np.float32),
        "action": rng.integers(0, ACTIONS, n).astype(np.int32),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "discount": np.full(n, 0.99, np.float32),
        "done": rng.random(n) < 0.01,
    }


def frames(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.integers(0, 255, (n, 84, 84, 4), dtype=np.uint8),
        "action": rng.integers(0, ACTIONS, n).astype(np.int32),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "done": rng.random(n) < 0.01,
    }


# The parameters are drawn on the host (numpy) and put once: jax.random outside a jit
# compiles a program per shape (seconds on a CPU), untimed but a third of a --quick run.
def _dense(rng: np.random.Generator, n_in: int, n_out: int) -> dict[str, jax.Array]:
    return {
        "w": jnp.asarray((rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)),
        "b": jnp.asarray(np.zeros(n_out, np.float32)),
    }


def mlp_params(rng: np.random.Generator) -> list[dict[str, jax.Array]]:
    return [_dense(rng, 64, 256), _dense(rng, 256, 256), _dense(rng, 256, ACTIONS)]


def mlp_q(params: Any, obs: jax.Array) -> jax.Array:
    x = obs
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def conv_params(rng: np.random.Generator) -> dict[str, Any]:
    conv = [(4, 32, 8), (32, 64, 4), (64, 64, 3)]
    return {
        "conv": [
            jnp.asarray((rng.standard_normal((s, s, i, o)) / np.sqrt(s * s * i)).astype(np.float32))
            for i, o, s in conv
        ],
        "fc": _dense(rng, 7 * 7 * 64, 512),
        "out": _dense(rng, 512, ACTIONS),
    }


def conv_q(params: Any, obs: jax.Array) -> jax.Array:
    x = obs.astype(jnp.float32) / 255.0
    for w, stride in zip(params["conv"], (4, 2, 1), strict=True):
        x = jax.lax.conv_general_dilated(
            x, w, (stride, stride), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        x = jax.nn.relu(x)
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(x @ params["fc"]["w"] + params["fc"]["b"])
    return x @ params["out"]["w"] + params["out"]["b"]


def make_train(q: Callable[[Any, jax.Array], jax.Array], next_key: str) -> Callable[..., Any]:
    """One SGD step of Q-learning; returns (params, |td|)."""

    def loss(params: Any, batch: Any, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
        qa = jnp.take_along_axis(q(params, batch["obs"]), batch["action"][:, None], 1)[:, 0]
        nxt = batch[next_key]
        target = batch["reward"] + 0.99 * (1.0 - batch["done"]) * q(params, nxt).max(-1)
        td = qa - jax.lax.stop_gradient(target)
        return jnp.mean(weight * td**2), jnp.abs(td)

    def train(params: Any, batch: Any, weight: jax.Array) -> tuple[Any, jax.Array]:
        grads, td = jax.grad(loss, has_aux=True)(params, batch, weight)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), td

    return train


def _rate(step: Callable[[Any], Any], carry: Any, steps: int, repeats: int) -> tuple[float, Any]:
    """Steps/s of ``carry = step(carry)`` (median of ``repeats`` timings), and the carry."""
    carry = jax.block_until_ready(step(carry))  # compile and warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(steps):
            carry = step(carry)
        jax.block_until_ready(carry)
        times.append(time.perf_counter() - t)
    return steps / statistics.median(times), carry


def _mem() -> dict[str, int] | None:
    stats = jax.devices()[0].memory_stats()
    return None if stats is None else {k: int(v) for k, v in stats.items() if "bytes" in k}


def _model(name: str) -> tuple[Callable[..., Any], Any]:
    q, params = (mlp_q, mlp_params) if name == "mlp" else (conv_q, conv_params)
    return make_train(q, "next_obs" if name == "mlp" else "obs"), params(np.random.default_rng(0))


def bench(name: str, tree: dict[str, np.ndarray], args: argparse.Namespace, root: str) -> dict:
    """The three steps; each carries ``(params, key)`` (the key split inside the jit, as a
    training loop does: no per-step host work), the bare one gets its batch as an argument."""
    path = f"{root}/{name}"
    gr.write(path, tree)
    n = len(next(iter(tree.values())))
    store_bytes = sum(a.nbytes for a in tree.values())
    train, params = _model(name)
    b = args.batch
    fixed = jax.device_put({k: v[:b] for k, v in tree.items()}, jax.devices()[0])
    ones = jnp.ones(b, jnp.float32)

    @jax.jit
    def bare_step(carry: Any, batch: Any) -> Any:
        p, key = carry
        key, _ = jax.random.split(key)
        return train(p, batch, ones)[0], key

    rates: dict[str, float] = {}
    carry0 = (params, jax.random.key(1))
    rates["bare"], _ = _rate(lambda c: bare_step(c, fixed), carry0, args.steps, args.repeats)

    before = _mem()
    uni = gr.DeviceReplay(path, sampling=gr.UniformReplay())
    state_u = uni.init()
    after = _mem()

    @jax.jit
    def uniform_step(carry: Any, state: Any) -> Any:
        p, key = carry
        key, sub = jax.random.split(key)
        batch = uni.sample(state, sub, b)
        return train(p, batch.data, batch.weight)[0], key

    rates["uniform"], _ = _rate(
        lambda c: uniform_step(c, state_u), carry0, args.steps, args.repeats
    )
    jax.tree.map(lambda x: x.delete(), state_u)  # its memory back before the prioritized ring

    pri = gr.DeviceReplay(path, sampling=gr.PrioritizedReplay(alpha=0.6, beta=0.4))

    def prioritized_step(carry: Any, state: Any) -> Any:
        p, key = carry
        key, sub = jax.random.split(key)
        batch = pri.sample(state, sub, b)
        p, td = train(p, batch.data, batch.weight)
        return (p, key), pri.update_priorities(state, batch.index, td)

    prioritized_jit = jax.jit(prioritized_step, donate_argnums=1)  # the state in place
    rates["prioritized"], (_, state_p) = _rate(
        lambda c: prioritized_jit(*c), (carry0, pri.init()), args.steps, args.repeats
    )
    jax.tree.map(lambda x: x.delete(), state_p)
    used = None
    if before is not None and after is not None:
        used = after.get("bytes_in_use", 0) - before.get("bytes_in_use", 0)
    return {
        "name": name,
        "rows": n,
        "row_bytes": store_bytes // n,
        "store_bytes": store_bytes,
        "ring_bytes": pri.state_bytes(),
        "hbm_used_by_init": used,
        "memory_before": before,
        "memory_after": after,
        "rates": rates,
    }


def bench_flashbax(name: str, tree: dict[str, np.ndarray], args: argparse.Namespace) -> Any:
    """flashbax's item buffer (uniform) and prioritised flat buffer (sample +
    ``set_priorities``) in the same steps, their states donated. ``{"skipped": why}``
    where it does not import."""
    try:
        import flashbax as fbx  # the optional peer
    except ImportError as e:
        if getattr(e, "name", None) == "flashbax":
            return {"skipped": "flashbax is not installed (pip install flashbax==0.1.3)"}
        return {"skipped": f"flashbax does not import ({e})"}
    n = len(next(iter(tree.values())))
    train, params = _model(name)
    b = args.batch
    carry0 = (params, jax.random.key(1))
    chunk = max(b, (64 << 20) // max(1, sum(a[0].nbytes for a in tree.values())))
    example = {k: v[0] for k, v in tree.items()}
    rates: dict[str, float] = {}

    def fill(buffer: Any, state: Any, seq_axis: bool) -> Any:
        add = jax.jit(buffer.add, donate_argnums=0)
        for lo in range(0, n, chunk):
            part = {k: v[lo : lo + chunk] for k, v in tree.items()}
            state = add(state, jax.tree.map(lambda x: x[None], part) if seq_axis else part)
        return state

    item = fbx.make_item_buffer(max_length=n, min_length=b, sample_batch_size=b, add_sequences=True)
    state = fill(item, item.init(example), seq_axis=False)

    def uniform_step(carry: Any, state: Any) -> Any:
        p, key = carry
        key, sub = jax.random.split(key)
        batch = item.sample(state, sub).experience
        return (train(p, batch, jnp.ones(b, jnp.float32))[0], key), state

    uniform_jit = jax.jit(uniform_step, donate_argnums=1)
    rates["uniform"], (_, state) = _rate(
        lambda c: uniform_jit(*c), (carry0, state), args.steps, args.repeats
    )
    jax.tree.map(lambda x: x.delete(), state)
    backend = jax.default_backend()
    prio = fbx.make_prioritised_flat_buffer(
        max_length=n,
        min_length=b,
        sample_batch_size=b,
        add_sequences=True,
        add_batch_size=1,
        priority_exponent=0.6,
        device=backend if backend in ("cpu", "gpu", "tpu") else "cpu",
    )
    state = fill(prio, prio.init(example), seq_axis=True)

    def prioritised_step(carry: Any, state: Any) -> Any:
        p, key = carry
        key, sub = jax.random.split(key)
        s = prio.sample(state, sub)
        w = (s.probabilities * n) ** -0.4  # importance weights, normalised by the max
        p, td = train(p, s.experience.first, w / w.max())
        return (p, key), prio.set_priorities(state, s.indices, td)

    prioritised_jit = jax.jit(prioritised_step, donate_argnums=1)
    rates["prioritized"], (_, state) = _rate(
        lambda c: prioritised_jit(*c), (carry0, state), args.steps, args.repeats
    )
    jax.tree.map(lambda x: x.delete(), state)
    return {"rows": n, "rates": rates, "version": metadata.version("flashbax")}


def _peers(ours: dict[str, dict], trees: dict[str, Any], args: argparse.Namespace) -> dict:
    """flashbax's rates and ours over theirs (a line saying so when it is not installed);
    returns its results per workload, or ``{"skipped": why}``."""
    found: dict[str, Any] = {}
    for name, tree in trees.items():
        if name == "conv":  # its natural layout pads 4 -> 128 lanes on a TPU: 36x the bytes
            tree = {k: v[: args.peer_frames] for k, v in tree.items()}
        r = bench_flashbax(name, tree, args)
        if "skipped" in r:
            print(f"peers: {r['skipped']}: skipped")
            return r
        found[name] = r
        theirs, mine = r["rates"], ours[name]["rates"]
        print(
            f"flashbax {r['version']} {name:<5}{r['rows']:>8} rows: uniform "
            f"{theirs['uniform']:.1f}/s (ours/theirs {mine['uniform'] / theirs['uniform']:.2f}), "
            f"prioritised {theirs['prioritized']:.1f}/s "
            f"(ours/theirs {mine['prioritized'] / theirs['prioritized']:.2f})"
        )
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="transitions (mlp)")
    parser.add_argument("--frames", type=int, default=50_000, help="frames (conv)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50, help="steps per timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--peers", action="store_true", help="also time flashbax 0.1.3 (if installed)"
    )
    parser.add_argument(
        "--peer-frames", type=int, default=2048, help="frames in flashbax's conv buffer"
    )
    parser.add_argument("--out", default="", help="also write the results to FILE (JSON)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.frames = min(args.rows, 20_000), min(args.frames, 1_000)
        args.steps, args.repeats = min(args.steps, 5), min(args.repeats, 3)
        args.batch = min(args.batch, 64)  # the conv step on a CPU: seconds at 256
        args.peer_frames = min(args.peer_frames, args.frames)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), batch {args.batch}")
    print(
        f"{'workload':<9}{'rows':>10}{'B/row':>7}{'bare/s':>10}{'uniform/s':>11}{'ratio':>7}"
        f"{'prio/s':>10}{'ratio':>7}{'store MB':>10}{'ring MB':>9}{'HBM MB':>8}"
    )
    trees = {"mlp": transitions(args.rows), "conv": frames(args.frames)}
    ours = {}
    with tempfile.TemporaryDirectory() as root:
        for name, tree in trees.items():
            r = ours[name] = bench(name, tree, args, root)
            rate = r["rates"]
            used = r["hbm_used_by_init"]
            print(
                f"{name:<9}{r['rows']:>10}{r['row_bytes']:>7}{rate['bare']:>10.1f}"
                f"{rate['uniform']:>11.1f}{rate['uniform'] / rate['bare']:>7.2f}"
                f"{rate['prioritized']:>10.1f}{rate['prioritized'] / rate['bare']:>7.2f}"
                f"{r['store_bytes'] / 2**20:>10.1f}{r['ring_bytes'] / 2**20:>9.1f}"
                f"{'n/a' if used is None else f'{used / 2**20:.1f}':>8}"
            )
            if r["memory_after"] is not None:
                print(f"  memory_stats before init: {r['memory_before']}")
                print(f"  memory_stats after init:  {r['memory_after']}")
    print("ratio: steps/s with sampling inside the jit / steps/s of the bare step (1.0: free)")
    peers = _peers(ours, trees, args) if args.peers else {"skipped": "--peers not given"}
    if args.out:
        for r in ours.values():
            r["ratios"] = {
                m: r["rates"][m] / r["rates"]["bare"] for m in ("uniform", "prioritized")
            }
        doc = {
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "device_kind": jax.devices()[0].device_kind,
            "batch": args.batch,
            "workloads": ours,
            "peers": peers,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
