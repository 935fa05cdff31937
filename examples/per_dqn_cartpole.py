"""DQN on CartPole from a growing on-disk store with prioritized replay.

The actor plays CartPole-v1 (epsilon-greedy) and appends every transition to a
``gr.ReplayWriter`` store, committing every ``--flush-every`` steps; the learner
reads the same store through ``gr.make_data_loader(...,
sampling=gr.PrioritizedReplay(...))``, which looks for newly committed rows every
``--refresh-every`` batches (new rows get the largest priority given so far). Each
batch is a ``gr.Sampled(data, index, weight)``: the TD loss is weighted by the
importance weights, and ``|TD error|`` goes back with
``batches.update_priorities(batch.index, ...)`` on the ``sharded_device_put``
iterator (jax arrays are fine). ``beta`` anneals to 1 over the run. The Q network
is a small MLP with Adam, in pure JAX; a target network is refreshed every
``--target-every`` steps. Cheap on CPU: a few thousand steps take well under a minute.

Run it::

    python examples/per_dqn_cartpole.py
    python examples/per_dqn_cartpole.py --steps 20000 --store /tmp/cartpole_replay
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

import grain_replay as gr


def init_params(seed: int, obs_dim: int, hidden: int, actions: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def dense(i: int, o: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((i, o)) * scale / np.sqrt(i)).astype(np.float32)

    return {
        "w1": dense(obs_dim, hidden),
        "b1": np.zeros(hidden, np.float32),
        "w2": dense(hidden, actions, 0.1),
        "b2": np.zeros(actions, np.float32),
    }


def q_values(params: dict[str, Any], obs: jax.Array) -> jax.Array:
    x = jax.nn.relu(obs.astype(jnp.float32) @ params["w1"] + params["b1"])
    return x @ params["w2"] + params["b2"]


def make_train_step(learning_rate: float, gamma: float) -> Any:
    """One Adam step on the importance-weighted Huber TD loss; returns the TD errors."""

    def loss(params: Any, target: Any, batch: gr.Sampled) -> tuple[jax.Array, jax.Array]:
        data = batch.data
        q = q_values(params, data["obs"])
        q_sa = jnp.take_along_axis(q, data["action"].astype(jnp.int32)[:, None], axis=1)[:, 0]
        bootstrap = jnp.max(q_values(target, data["next_obs"]), axis=1)
        y = data["reward"] + gamma * (1.0 - data["terminated"].astype(jnp.float32)) * bootstrap
        delta = q_sa - jax.lax.stop_gradient(y)
        huber = jnp.where(jnp.abs(delta) <= 1.0, 0.5 * delta**2, jnp.abs(delta) - 0.5)
        # Normalizing by the batch's largest weight inside the step keeps the scale the
        # same on every process (the global batch is one sharded array).
        weight = batch.weight / jnp.max(batch.weight)
        return jnp.mean(weight * huber), delta

    @jax.jit
    def step(params: Any, opt: Any, target: Any, batch: gr.Sampled) -> tuple[Any, Any, Any]:
        (_, delta), grads = jax.value_and_grad(loss, has_aux=True)(params, target, batch)
        count = opt["count"] + 1
        mu = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt["mu"], grads)
        nu = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["nu"], grads)
        lr = learning_rate * jnp.sqrt(1 - 0.999**count) / (1 - 0.9**count)
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), params, mu, nu
        )
        return params, {"count": count, "mu": mu, "nu": nu}, delta

    return step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--store", help="replay store (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=6000, help="environment steps")
    parser.add_argument("--warmup", type=int, default=500, help="steps before learning")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--flush-every", type=int, default=50, help="actor commit interval")
    parser.add_argument("--refresh-every", type=int, default=10, help="loader looks, batches")
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--beta", type=float, default=0.4, help="annealed to 1 over the run")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--target-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains; returns the episode returns, TD statistics and the store's final size."""
    import gymnasium as gym

    args = parse_args(argv)
    tmp = None
    store = args.store
    if store is None:
        tmp = tempfile.TemporaryDirectory(prefix="per_dqn_")
        store = os.path.join(tmp.name, "replay")
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(args.seed)
    params = jax.device_put(init_params(args.seed, 4, args.hidden, 2))
    target = params
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    opt = {"count": jnp.zeros((), jnp.int32), "mu": zeros, "nu": zeros}
    train_step = make_train_step(args.learning_rate, args.gamma)
    act = jax.jit(lambda p, o: jnp.argmax(q_values(p, o[None])[0]))
    total = args.steps - args.warmup
    sampling = gr.PrioritizedReplay(
        alpha=args.alpha,
        beta=lambda step: min(1.0, args.beta + (1.0 - args.beta) * step / max(total, 1)),
        refresh_every=args.refresh_every,
    )
    returns: list[float] = []
    td: list[float] = []
    episode_return = 0.0
    obs, _ = env.reset(seed=args.seed)
    batches = None
    start = time.perf_counter()
    writer = gr.ReplayWriter(store, format="npy")
    pending: list[dict[str, np.ndarray]] = []
    try:
        for t in range(args.steps):
            epsilon = max(0.05, 1.0 - t / (0.5 * args.steps))
            if rng.random() < epsilon:
                action = int(rng.integers(2))
            else:
                action = int(act(params, jnp.asarray(obs, jnp.float32)))
            next_obs, reward, terminated, truncated, _ = env.step(action)
            pending.append(
                {
                    "obs": np.asarray(obs, np.float32),
                    "action": np.int64(action),
                    "reward": np.float32(reward),
                    "next_obs": np.asarray(next_obs, np.float32),
                    "terminated": np.bool_(terminated),
                }
            )
            episode_return += float(reward)
            obs = next_obs
            if terminated or truncated:
                returns.append(episode_return)
                episode_return = 0.0
                obs, _ = env.reset()
            if len(pending) >= args.flush_every:  # the actor commits a block of rows
                writer.append({k: np.stack([p[k] for p in pending]) for k in pending[0]})
                writer.flush()
                pending.clear()
            if t < args.warmup:
                continue
            if batches is None:  # the learner starts once rows are committed
                loader = gr.make_data_loader(
                    gr.NpyDataSource(store),
                    batch_size=args.batch_size,
                    seed=args.seed,
                    sampling=sampling,
                )
                batches = gr.sharded_device_put(loader, prefetch=1)
            batch = next(batches)
            params, opt, delta = train_step(params, opt, target, batch)
            batches.update_priorities(batch.index, jnp.abs(delta))
            td.append(float(jnp.mean(jnp.abs(delta))))
            if t % args.target_every == 0:
                target = params
    finally:
        if batches is not None:
            batches.close()
        writer.close()
        env.close()
    result = {
        "steps": args.steps,
        "episodes": len(returns),
        "first_returns": float(np.mean(returns[:10])) if returns else 0.0,
        "last_returns": float(np.mean(returns[-10:])) if returns else 0.0,
        "mean_abs_td": float(np.mean(td)) if td else 0.0,
        "rows": len(gr.NpyDataSource(store)),
        "seconds": time.perf_counter() - start,
    }
    print(result)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
