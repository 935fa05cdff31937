"""Behaviour cloning on a replay store: grain_replay's whole pipeline feeding a jitted JAX step.

The store is read in a fresh random order every epoch by ``gr.make_data_loader``
(``num_epochs=None``: forever), each host batch becomes a ``jax.Array`` sharded
over every local device by ``gr.sharded_device_put``, and a ``jax.jit`` SGD step
fits a small MLP policy ``obs -> action`` (softmax cross-entropy) on the global
batch. Pure JAX: no flax or optax.

Run it::

    python examples/train_loop.py                       # synthetic store in a temp dir
    python examples/train_loop.py --workers 2 --steps 500
    python examples/train_loop.py --store replay.h5     # written there if missing
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_loop.py

A store of your own needs a float leaf ``obs`` of shape ``[N, obs_dim]`` and an
integer leaf ``action`` of shape ``[N]`` with values in ``[0, --num-actions)``.
The global batch size must be a multiple of the device count (default 256).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import grain_replay as gr

_SUFFIX = {"hdf5": ".h5", "npy": "", "zarr": ".zarr"}


def make_synthetic_replay(
    num_records: int, obs_dim: int, num_actions: int, seed: int = 0
) -> dict[str, np.ndarray]:
    """Transitions from an expert whose action is a fixed linear function of the observation."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((num_records, obs_dim)).astype(np.float32)
    expert = rng.standard_normal((obs_dim, num_actions)).astype(np.float32)
    action = np.argmax(obs @ expert, axis=1).astype(np.int32)
    return {
        "obs": obs,
        "action": action,
        "reward": rng.standard_normal(num_records).astype(np.float32),
        "next_obs": np.roll(obs, -1, axis=0),
        "done": rng.random(num_records) < 0.01,
    }


def init_params(seed: int, obs_dim: int, hidden: int, num_actions: int) -> dict[str, np.ndarray]:
    """Host-side (numpy) initial weights: no device computation to compile before training."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((obs_dim, hidden)) / np.sqrt(obs_dim)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, num_actions)) * 0.01).astype(np.float32),
        "b2": np.zeros(num_actions, np.float32),
    }


def loss_fn(params: dict[str, Any], obs: jax.Array, action: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of the policy's logits against the logged actions."""
    hidden = jnp.tanh(obs @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    log_probs = jax.nn.log_softmax(logits)
    picked = jnp.take_along_axis(log_probs, action[:, None].astype(jnp.int32), axis=1)
    return -jnp.mean(picked)


def make_train_step(learning_rate: float, momentum: float) -> Any:
    """SGD with momentum, written out; the batch mean is a collective over all devices."""

    @jax.jit
    def train_step(
        params: dict[str, Any], velocity: dict[str, Any], batch: dict[str, jax.Array]
    ) -> tuple[dict[str, Any], dict[str, Any], jax.Array]:
        obs = batch["obs"].astype(jnp.float32)
        loss, grads = jax.value_and_grad(loss_fn)(params, obs, batch["action"])
        velocity = jax.tree_util.tree_map(lambda v, g: momentum * v + g, velocity, grads)
        params = jax.tree_util.tree_map(lambda p, v: p - learning_rate * v, params, velocity)
        return params, velocity, loss

    return train_step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--store", help="replay store; a synthetic one is written if missing")
    parser.add_argument(
        "--format", choices=sorted(_SUFFIX), default="hdf5", help="format of the synthetic store"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="global batch size, a multiple of the device count",
    )
    parser.add_argument("--workers", type=int, default=0, help="grain worker processes")
    parser.add_argument(
        "--num-records", type=int, default=16_384, help="records in the synthetic store"
    )
    parser.add_argument("--obs-dim", type=int, default=16)
    parser.add_argument("--num-actions", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)
    devices = jax.device_count()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2, got {args.steps}")
    if args.batch_size <= 0 or args.batch_size % devices:
        parser.error(
            f"--batch-size {args.batch_size} does not split over {devices} device(s); "
            f"use a positive multiple of {devices}"
        )
    return args


_MAX_IN_FLIGHT = 8


def train(args: argparse.Namespace, store: str) -> dict[str, Any]:
    source = gr.open_source(store, keys=["obs", "action"])
    per_process_batch = args.batch_size // jax.process_count()
    loader = gr.make_data_loader(
        source,
        batch_size=per_process_batch,
        seed=args.seed,
        num_epochs=None,
        worker_count=args.workers,
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    obs_dim = source.spec["obs"].shape[0]
    host_params = init_params(args.seed, obs_dim, args.hidden, args.num_actions)
    params = jax.device_put(host_params, replicated)
    velocity = jax.device_put(jax.tree_util.tree_map(np.zeros_like, host_params), replicated)
    train_step = make_train_step(args.learning_rate, args.momentum)

    device_losses: list[jax.Array] = []
    start = time.perf_counter()
    with gr.sharded_device_put(loader, mesh, prefetch=2) as batches:
        for step, batch in zip(range(args.steps), batches):
            params, velocity, loss = train_step(params, velocity, batch)
            device_losses.append(loss)  # fetched at the end: no host sync per step
            if step >= _MAX_IN_FLIGHT:
                # Bound the steps queued ahead of the host: JAX's CPU backend can
                # deadlock in collectives with an unbounded queue (seen with 8
                # fake devices), and a real accelerator gains nothing past a few.
                device_losses[step - _MAX_IN_FLIGHT].block_until_ready()
            if step == 0:  # compilation and worker start-up stay out of the rate
                print(f"step {step:5d}  loss {float(loss):.4f}  (initial)", flush=True)
                start = time.perf_counter()
            elif args.log_every and step % args.log_every == 0:
                print(f"step {step:5d}  loss {float(loss):.4f}", flush=True)
        jax.block_until_ready(params)
        elapsed = time.perf_counter() - start
    losses = [float(x) for x in jax.device_get(device_losses)]
    steps_per_s = (len(losses) - 1) / elapsed if elapsed > 0 else float("inf")
    tail = losses[-min(10, len(losses) - 1) :]
    result = {
        "store": store,
        "steps": len(losses),
        "devices": jax.device_count(),
        "batch_size": args.batch_size,
        "workers": args.workers,
        "initial_loss": losses[0],
        "final_loss": float(np.mean(tail)),
        "steps_per_s": steps_per_s,
        "losses": losses,
    }
    print(
        f"initial loss {result['initial_loss']:.4f} -> final loss {result['final_loss']:.4f} "
        f"(mean of last {len(tail)}); {steps_per_s:.1f} steps/s on {result['devices']} "
        f"device(s), global batch {args.batch_size}, {args.workers} worker(s)",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses ``argv`` (default: ``sys.argv[1:]``), trains, and returns the results."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="train_loop_") as tmp:
        store = args.store or os.path.join(tmp, f"replay{_SUFFIX[args.format]}")
        if not os.path.exists(store):
            replay = make_synthetic_replay(
                args.num_records, args.obs_dim, args.num_actions, args.seed
            )
            gr.write(store, replay, format=args.format)
            print(f"wrote a synthetic store of {args.num_records} records to {store}")
        return train(args, store)


if __name__ == "__main__":
    main()
