"""Frame stacking: store single 84x84 frames, train on 4-frame stacks built at read time.

Atari agents look at the last 4 frames. Storing those stacks repeats every
frame 4 times; this example stores each uint8[84, 84] frame once (written
episode by episode with ``gr.ReplayWriter``, as an actor would) and stacks at
read time with ``gr.SequenceDataSource(steps, {"frame": [-3, -2, -1, 0]})``:
each batch reads its B x 4 frames in one vectorized read, stacks them to
``(B, 4, 84, 84)`` and adds ``frame_is_pad`` (True where a stack reaches before
the episode's first frame; those positions repeat the first frame, as the
usual Atari wrappers do at reset).

The frames show a bright square that moves with a hidden velocity; one frame
cannot tell the velocity, a stack can. A small MLP (pure JAX, Adam) learns to
read the velocity at the last frame of each stack from the 4 frames, from
batches of ``gr.make_data_loader`` through ``gr.sharded_device_put``
(``jax.Array``s sharded over every device). The loss masks anchors whose
previous frame is padding (``frame_is_pad[:, -2]``: no motion to see).

Finally it prints the bytes of the store against a store of the same steps
with pre-stacked observations (``(4, 84, 84)`` per step), about 4x larger.

Run it::

    python examples/frame_stack.py                         # npy store in a temp dir
    python examples/frame_stack.py --store frames.zarr --format zarr --workers 2
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/frame_stack.py

The global batch size must be a multiple of the device count (default 256).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import grain_replay as gr

_SUFFIX = {"hdf5": ".h5", "npy": "", "zarr": ".zarr"}
SIZE = 84
BALL = 8
STACK = [-3, -2, -1, 0]
# Frames are average-pooled by this factor before the MLP (84 / 4 = 21).
POOL = 4
# Training steps dispatched ahead of the host before it waits for one to finish.
_MAX_IN_FLIGHT = 8


# -- data -----------------------------------------------------------------------------------


def episode_frames(length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One episode: a square bouncing in the frame at a constant hidden velocity."""
    velocity = rng.integers(-4, 5, 2)
    pos = rng.integers(0, SIZE - BALL, 2).astype(np.int64)
    frames = np.zeros((length, SIZE, SIZE), np.uint8)
    vel = np.zeros((length, 2), np.float32)
    for t in range(length):
        if t:
            nxt = pos + velocity
            bounce = (nxt < 0) | (nxt > SIZE - BALL)
            velocity = np.where(bounce, -velocity, velocity)
            pos = np.clip(pos + velocity, 0, SIZE - BALL)
        frames[t, pos[0] : pos[0] + BALL, pos[1] : pos[1] + BALL] = 255
        vel[t] = velocity if t else 0  # the motion that led to frame t
    return {"frame": frames, "velocity": vel}


def record(path: str, episodes: int, *, format: str, seed: int) -> int:
    """Writes ``episodes`` episodes of single frames with ``gr.ReplayWriter``; returns steps."""
    rng = np.random.default_rng(seed)
    steps = 0
    with gr.ReplayWriter(path, format=format) as writer:
        for _ in range(episodes):
            length = int(rng.integers(20, 120))
            ep = episode_frames(length, rng)
            ep["action"] = rng.integers(0, 6, length).astype(np.int32)
            ep["terminated"] = np.arange(length) == length - 1
            writer.append(ep)
            writer.flush()  # a reader could train on the episodes written so far
            steps += length
    return steps


def store_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(path)
        for f in files
        if not f.endswith((".lock", ".episodes.npz"))
    )


def prestacked_bytes(view: gr.SequenceDataSource, path: str, format: str) -> int:
    """Bytes of the same steps stored with each observation pre-stacked (written, measured)."""
    steps = view.source
    stacked_path = path.rstrip("/") + "-prestacked" + _SUFFIX[format]
    with gr.ReplayWriter(stacked_path, format=format) as writer:
        block = 4096
        for lo in range(0, len(steps), block):
            rows = np.arange(lo, min(lo + block, len(steps)))
            tree = steps.read_batch(rows)
            # Every step's stack, as SequenceDataSource builds it (edge-padded).
            stacks = steps.read_leaf("frame", view.sequence_steps(rows)["frame"][0].reshape(-1))
            tree["frame"] = stacks.reshape(len(rows), len(STACK), SIZE, SIZE)
            writer.append(tree)
    return store_bytes(stacked_path)


# -- the model ----------------------------------------------------------------------------


def init_params(seed: int, hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = len(STACK) * (SIZE // POOL) ** 2

    def dense(i: int, o: int) -> np.ndarray:
        return (rng.standard_normal((i, o)) / np.sqrt(i)).astype(np.float32)

    return {
        "w1": dense(features, hidden),
        "b1": np.zeros(hidden, np.float32),
        "w2": dense(hidden, 2),
        "b2": np.zeros(2, np.float32),
    }


def predict(params: dict[str, Any], frames: jax.Array) -> jax.Array:
    """``(B, 4, 84, 84)`` uint8 stacks -> ``(B, 2)`` velocities."""
    b = frames.shape[0]
    x = frames.astype(jnp.float32) / 255.0
    k = SIZE // POOL
    x = x.reshape(b, len(STACK), k, POOL, k, POOL).mean(axis=(3, 5)).reshape(b, -1)
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    # Anchors whose previous frame is padding (an episode's first step) show no motion.
    weight = 1.0 - batch["frame_is_pad"][:, -2].astype(jnp.float32)
    err = jnp.sum((predict(params, batch["frame"]) - batch["velocity"][:, -1]) ** 2, axis=-1)
    return jnp.sum(weight * err) / jnp.maximum(jnp.sum(weight), 1.0)


def make_train_step(learning_rate: float, b1: float = 0.9, b2: float = 0.999) -> Any:
    @jax.jit
    def train_step(
        params: dict[str, Any], opt: dict[str, Any], batch: dict[str, jax.Array]
    ) -> tuple[dict[str, Any], dict[str, Any], jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        count = opt["count"] + 1
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, opt["mu"], grads)
        nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["nu"], grads)
        lr = learning_rate * jnp.sqrt(1 - b2**count) / (1 - b1**count)
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), params, mu, nu
        )
        return params, {"count": count, "mu": mu, "nu": nu}, loss

    return train_step


# -- script -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--store", help="replay store of single frames; recorded there if missing")
    p.add_argument("--format", choices=sorted(_SUFFIX), default="npy")
    p.add_argument("--episodes", type=int, default=100, help="episodes to record")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=256, help="global batch size")
    p.add_argument("--workers", type=int, default=0, help="grain worker processes")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="0: only the first and last loss")
    p.add_argument("--no-compare", action="store_true", help="skip writing the pre-stacked store")
    args = p.parse_args(argv)
    if args.batch_size % jax.device_count():
        p.error(
            f"--batch-size {args.batch_size} does not split over {jax.device_count()} devices; "
            f"use a multiple of {jax.device_count()}"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or os.path.join(tmp, "frames" + _SUFFIX[args.format])
        if not os.path.exists(store):
            steps = record(store, args.episodes, format=args.format, seed=args.seed)
            print(f"recorded {args.episodes} episodes, {steps} single frames to {store}")
        return train(args, store)


def train(args: argparse.Namespace, store: str) -> dict[str, Any]:
    steps = gr.open_source(store)
    view = gr.SequenceDataSource(steps, {"frame": STACK, "velocity": [0]})
    single = store_bytes(store)
    stacked = None
    if not args.no_compare:
        stacked = prestacked_bytes(view, store, args.format)
        print(
            f"storage: single frames {single / 1e6:.1f} MB, pre-stacked observations "
            f"{stacked / 1e6:.1f} MB ({stacked / single:.2f}x; saved {(stacked - single) / 1e6:.1f}"
            " MB)"
        )
    loader = gr.make_data_loader(
        view,
        batch_size=args.batch_size // jax.process_count(),
        seed=args.seed,
        num_epochs=None,
        worker_count=args.workers,
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    host_params = init_params(args.seed, args.hidden)
    zeros = jax.tree_util.tree_map(np.zeros_like, host_params)
    params = jax.device_put(host_params, replicated)
    opt = jax.device_put({"count": np.zeros((), np.int32), "mu": zeros, "nu": zeros}, replicated)
    train_step = make_train_step(args.learning_rate)
    losses: list[jax.Array] = []
    start = time.perf_counter()
    with gr.sharded_device_put(loader, mesh, prefetch=2) as batches:
        for step, batch in zip(range(args.steps), batches):
            params, opt, loss = train_step(params, opt, batch)
            losses.append(loss)
            if len(losses) > _MAX_IN_FLIGHT:
                # Bound the steps dispatched ahead (XLA's CPU collectives can stall otherwise).
                losses[-_MAX_IN_FLIGHT - 1].block_until_ready()
            if step == 0:  # compilation stays out of the rate
                print(f"step {step:5d}  loss {float(loss):.4f}  (initial)", flush=True)
                start = time.perf_counter()
            elif args.log_every and step % args.log_every == 0:
                print(f"step {step:5d}  loss {float(loss):.4f}", flush=True)
        jax.block_until_ready(params)
        elapsed = time.perf_counter() - start
    values = [float(x) for x in jax.device_get(losses)]
    tail = max(1, min(20, len(values) // 5))
    result = {
        "steps": len(values),
        "records": len(view),
        "initial_loss": values[0],
        "final_loss": float(np.mean(values[-tail:])),
        "losses": values,
        "single_bytes": single,
        "prestacked_bytes": stacked,
        "steps_per_s": (len(values) - 1) / elapsed if elapsed > 0 else float("nan"),
    }
    print(
        f"initial loss {result['initial_loss']:.4f} -> final loss {result['final_loss']:.4f} "
        f"({result['steps_per_s']:.1f} steps/s on {jax.device_count()} devices)"
    )
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
