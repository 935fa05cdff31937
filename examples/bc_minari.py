"""Behaviour cloning from a Minari dataset: windows of T steps through grain_replay into JAX.

A small Minari dataset is recorded on CartPole-v1 with minari's own
``DataCollector`` (a pole-angle heuristic "expert" with ``--epsilon`` random
actions), in a temporary ``MINARI_DATASETS_PATH`` unless ``--dataset`` names a
dataset folder. It is read in place, without conversion:

    gr.MinariDataSource(dataset)              # flat transitions, episodes known
    -> gr.WindowDataSource(length=T)          # T consecutive steps inside one episode
    -> gr.make_data_loader(batch_size=B/P)    # fresh seeded order every epoch, per process
    -> gr.sharded_device_put(mesh)            # jax.Arrays sharded over every device

and a small MLP policy on the flattened window of T observations is trained
to predict the window's last action (softmax cross-entropy, SGD with
momentum written out in pure JAX, no flax or optax).

Run it::

    python examples/bc_minari.py                          # 30 episodes in a temp dir
    python examples/bc_minari.py --episodes 100 --steps 1000 --window 8
    python examples/bc_minari.py --dataset /data/cartpole-expert-v0   # recorded there if missing
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/bc_minari.py

A dataset of your own needs a Box observation space (any shape; it is
flattened) and a Discrete action space. The global batch size must be a
multiple of the device count (default 64).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import grain_replay as gr

_DATASET_ID = "cartpole/heuristic-v0"

# Training steps dispatched ahead of the host before it waits for one to finish.
_MAX_IN_FLIGHT = 8


@contextlib.contextmanager
def _minari_root(root: str) -> Iterator[None]:
    """Points minari at ``root`` for the duration (minari reads the variable per call)."""
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = root
    try:
        yield
    finally:
        if old is None:
            del os.environ["MINARI_DATASETS_PATH"]
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


def collect_dataset(
    dest: str, episodes: int, *, seed: int = 0, epsilon: float = 0.1, max_steps: int = 200
) -> str:
    """Records ``episodes`` CartPole-v1 episodes with minari's DataCollector into folder ``dest``.

    Returns:
      ``dest``, a Minari dataset folder (``data/main_data.hdf5`` inside).
    """
    import gymnasium as gym
    import minari

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="minari_") as root, _minari_root(root):
        env = minari.DataCollector(gym.make("CartPole-v1", max_episode_steps=max_steps))
        env.action_space.seed(seed)
        for e in range(episodes):
            obs, _ = env.reset(seed=seed * 100_003 + e)
            done = False
            while not done:
                if rng.random() < epsilon:
                    action = int(env.action_space.sample())
                else:
                    action = int(obs[2] + 0.5 * obs[3] > 0.0)  # push toward the falling side
                obs, _, terminated, truncated, _ = env.step(action)
                done = terminated or truncated
        env.create_dataset(
            dataset_id=_DATASET_ID,
            eval_env="CartPole-v1",
            algorithm_name="pole-angle heuristic, epsilon-greedy",
            author="grain_replay examples",
            author_email="examples@example.com",
            code_permalink="https://example.com/grain_replay/examples/bc_minari.py",
            description=f"CartPole-v1, {episodes} episodes, epsilon={epsilon}",
        )
        env.close()
        built = os.path.join(root, *_DATASET_ID.split("/"))
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        shutil.move(built, dest)
    return dest


def init_params(seed: int, in_dim: int, hidden: int, num_actions: int) -> dict[str, np.ndarray]:
    """Host-side (numpy) initial weights of a one-hidden-layer MLP."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((in_dim, hidden)) / np.sqrt(in_dim)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, num_actions)) * 0.01).astype(np.float32),
        "b2": np.zeros(num_actions, np.float32),
    }


def policy_logits(params: dict[str, Any], norm: dict[str, Any], windows: jax.Array) -> jax.Array:
    """Logits from a ``(B, T, *obs_shape)`` window of observations, normalized and flattened."""
    x = (windows.astype(jnp.float32) - norm["mean"]) / norm["std"]
    x = x.reshape(windows.shape[0], -1)
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def loss_and_accuracy(
    params: dict[str, Any], norm: dict[str, Any], windows: jax.Array, actions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy and accuracy against the last action of each window."""
    logits = policy_logits(params, norm, windows)
    target = actions[:, -1].astype(jnp.int32)
    log_probs = jax.nn.log_softmax(logits)
    loss = -jnp.mean(jnp.take_along_axis(log_probs, target[:, None], axis=1))
    return loss, jnp.mean(jnp.argmax(logits, axis=1) == target)


def make_train_step(learning_rate: float, momentum: float) -> Any:
    """SGD with momentum; the batch mean is a collective over every device of the mesh."""

    @jax.jit
    def train_step(
        params: dict[str, Any],
        velocity: dict[str, Any],
        norm: dict[str, Any],
        batch: dict[str, jax.Array],
    ) -> tuple[dict[str, Any], dict[str, Any], jax.Array, jax.Array]:
        (loss, acc), grads = jax.value_and_grad(loss_and_accuracy, has_aux=True)(
            params, norm, batch["observations"], batch["actions"]
        )
        velocity = jax.tree_util.tree_map(lambda v, g: momentum * v + g, velocity, grads)
        params = jax.tree_util.tree_map(lambda p, v: p - learning_rate * v, params, velocity)
        return params, velocity, loss, acc

    return train_step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--dataset", help="Minari dataset folder; recorded there if missing (default: temp dir)"
    )
    parser.add_argument("--episodes", type=int, default=30, help="episodes to record")
    parser.add_argument("--max-episode-steps", type=int, default=200)
    parser.add_argument("--epsilon", type=float, default=0.1, help="expert's random-action rate")
    parser.add_argument("--window", type=int, default=4, help="steps per window (T)")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch size, a multiple of the devices"
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--workers", type=int, default=0, help="grain worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args(argv)
    for name in ("episodes", "max_episode_steps", "window", "steps", "hidden"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    devices = jax.device_count()
    if args.batch_size <= 0 or args.batch_size % devices:
        parser.error(
            f"--batch-size {args.batch_size} does not split over {devices} device(s); "
            f"use a positive multiple of {devices}"
        )
    return args


def train(args: argparse.Namespace, dataset: str) -> dict[str, Any]:
    steps_src = gr.MinariDataSource(dataset, keys=["observations", "actions"])
    spec = steps_src.spec
    if not np.issubdtype(spec["actions"].dtype, np.integer) or spec["actions"].shape != ():
        raise SystemExit(
            f"{dataset}: actions are {spec['actions'].dtype}{list(spec['actions'].shape)}; "
            "behaviour cloning here needs a Discrete action space (one integer per step)."
        )
    windows = gr.WindowDataSource(steps_src, length=args.window)
    if len(windows) < args.batch_size:
        raise SystemExit(
            f"{dataset} has {len(windows)} windows of {args.window} steps, fewer than one "
            f"batch of {args.batch_size}. Fix: record more --episodes or lower --window."
        )
    loader = gr.make_data_loader(
        windows,
        batch_size=args.batch_size // jax.process_count(),
        seed=args.seed,
        num_epochs=None,
        worker_count=args.workers,
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    in_dim = args.window * int(np.prod(spec["observations"].shape, dtype=np.int64))
    # Input statistics and the action count from a sample of at most 10k transitions.
    rng = np.random.default_rng(args.seed)
    sample = steps_src.read_batch(
        np.sort(rng.choice(len(steps_src), min(len(steps_src), 10_000), replace=False))
    )
    obs = sample["observations"].astype(np.float32)
    mean, std = obs.mean(axis=0), obs.std(axis=0) + 1e-3
    num_actions = max(int(sample["actions"].max()) + 1, 2)
    host_params = init_params(args.seed, in_dim, args.hidden, num_actions)
    norm = jax.device_put({"mean": mean, "std": std}, replicated)
    params = jax.device_put(host_params, replicated)
    velocity = jax.device_put(jax.tree_util.tree_map(np.zeros_like, host_params), replicated)
    train_step = make_train_step(args.learning_rate, args.momentum)

    device_losses: list[jax.Array] = []
    device_accs: list[jax.Array] = []
    start = time.perf_counter()
    with gr.sharded_device_put(loader, mesh, prefetch=2) as batches:
        for step, batch in zip(range(args.steps), batches):
            if step == 0:
                shape = batch["observations"].shape
                print(f"global batch: observations {shape} over {len(jax.devices())} device(s)")
            params, velocity, loss, acc = train_step(params, velocity, norm, batch)
            device_losses.append(loss)
            if len(device_losses) > _MAX_IN_FLIGHT:
                # Bound the steps dispatched ahead (XLA's CPU collectives can stall otherwise).
                device_losses[-_MAX_IN_FLIGHT - 1].block_until_ready()
            device_accs.append(acc)
            if step == 0:  # compilation stays out of the rate
                print(f"step {step:5d}  loss {float(loss):.4f}  (initial)", flush=True)
                start = time.perf_counter()
            elif args.log_every and step % args.log_every == 0:
                print(f"step {step:5d}  loss {float(loss):.4f}  acc {float(acc):.3f}", flush=True)
        jax.block_until_ready(params)
        elapsed = time.perf_counter() - start
    losses = [float(x) for x in jax.device_get(device_losses)]
    accs = [float(x) for x in jax.device_get(device_accs)]
    tail = max(1, min(20, len(losses) // 5))
    result = {
        "dataset": dataset,
        "steps": len(losses),
        "transitions": len(steps_src),
        "episodes": steps_src.episodes.num_episodes,
        "windows": len(windows),
        "window": args.window,
        "devices": jax.device_count(),
        "batch_size": args.batch_size,
        "initial_loss": losses[0],
        "final_loss": float(np.mean(losses[-tail:])),
        "final_accuracy": float(np.mean(accs[-tail:])),
        "steps_per_s": (len(losses) - 1) / elapsed if elapsed > 0 else float("inf"),
        "losses": losses,
    }
    print(
        f"initial loss {result['initial_loss']:.4f} -> final loss {result['final_loss']:.4f}, "
        f"accuracy {result['final_accuracy']:.3f} (mean of last {tail}); "
        f"{result['steps_per_s']:.1f} steps/s on {result['devices']} device(s), "
        f"{result['windows']:,} windows of {args.window} steps from {result['episodes']} "
        f"episodes",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses ``argv`` (default: ``sys.argv[1:]``), records if needed, trains, returns results."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bc_minari_") as tmp:
        dataset = args.dataset or os.path.join(tmp, "cartpole-heuristic-v0")
        if not os.path.exists(dataset):
            t0 = time.perf_counter()
            collect_dataset(
                dataset, args.episodes, seed=args.seed, epsilon=args.epsilon,
                max_steps=args.max_episode_steps,
            )  # fmt: skip
            print(
                f"recorded {args.episodes} episodes with minari.DataCollector into {dataset} "
                f"({time.perf_counter() - t0:.1f}s)",
                flush=True,
            )
        return train(args, dataset)


if __name__ == "__main__":
    main()
