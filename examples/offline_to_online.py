"""Offline-to-online fine-tuning on CartPole with an annealed mixture of two stores.

An offline store holds episodes of a noisy scripted controller. A Q-network (DQN
loss, small MLP, Adam, pure JAX) first learns from it, then acts in the
environment, appending its own transitions to an online store with a
``gr.ReplayWriter``. One loader mixes both::

    gr.make_data_loader(
        {"offline": offline, "online": online},
        weights=lambda step: {"offline": 1 - f(step), "online": f(step)},
        sampling=gr.UniformReplay(),     # each source with replacement; online grows
        source_leaf="source",             # which store each row came from
        batch_size=...)

where ``f`` anneals the online share from 0 to ``--final-online`` over
``--anneal-steps`` (as torchrl's ``OfflineToOnlineReplayBuffer.anneal()`` does). Every
batch holds exactly the rounded share of each store (largest remainder, no drift);
the script checks it from the ``source`` leaf.

Run it::

    python examples/offline_to_online.py
    python examples/offline_to_online.py --offline-steps 20000 --online-steps 10000
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


def scripted_episodes(steps: int, epsilon: float, seed: int) -> dict[str, np.ndarray]:
    """``steps`` transitions of a push-toward-the-pole controller with ``epsilon`` noise."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(seed)
    rows: dict[str, list[Any]] = {k: [] for k in ("obs", "action", "reward", "next_obs", "done")}
    obs, _ = env.reset(seed=seed)
    for _ in range(steps):
        action = int(obs[2] + 0.5 * obs[3] > 0)
        if rng.random() < epsilon:
            action = int(rng.integers(2))
        next_obs, reward, terminated, truncated, _ = env.step(action)
        for key, value in zip(rows, (obs, action, reward, next_obs, terminated)):
            rows[key].append(value)
        obs = next_obs
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    dtypes = {"obs": np.float32, "action": np.int64, "reward": np.float32}
    dtypes.update({"next_obs": np.float32, "done": np.bool_})
    return {k: np.asarray(v, dtype=dtypes[k]) for k, v in rows.items()}


def q_values(params: dict[str, Any], obs: jax.Array) -> jax.Array:
    x = jax.nn.relu(obs.astype(jnp.float32) @ params["w1"] + params["b1"])
    return x @ params["w2"] + params["b2"]


def init_params(seed: int, hidden: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((4, hidden)) / 2).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 2)) * 0.1 / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(2, np.float32),
    }


def make_train_step(learning_rate: float, gamma: float) -> Any:
    def loss(params: Any, target: Any, batch: dict[str, jax.Array]) -> jax.Array:
        q = q_values(params, batch["obs"])
        q_sa = jnp.take_along_axis(q, batch["action"].astype(jnp.int32)[:, None], axis=1)[:, 0]
        bootstrap = jnp.max(q_values(target, batch["next_obs"]), axis=1)
        y = batch["reward"] + gamma * (1.0 - batch["done"].astype(jnp.float32)) * bootstrap
        delta = q_sa - jax.lax.stop_gradient(y)
        return jnp.mean(jnp.where(jnp.abs(delta) <= 1.0, 0.5 * delta**2, jnp.abs(delta) - 0.5))

    @jax.jit
    def step(params: Any, opt: Any, target: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, target, batch)
        count = opt["count"] + 1
        mu = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt["mu"], grads)
        nu = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["nu"], grads)
        lr = learning_rate * jnp.sqrt(1 - 0.999**count) / (1 - 0.9**count)
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), params, mu, nu
        )
        return params, {"count": count, "mu": mu, "nu": nu}, value

    return step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--dir", help="where the two stores go (default: a temporary directory)")
    parser.add_argument("--offline-rows", type=int, default=5000, help="scripted transitions")
    parser.add_argument("--offline-steps", type=int, default=1500, help="updates before acting")
    parser.add_argument("--online-steps", type=int, default=3000, help="environment steps")
    parser.add_argument("--anneal-steps", type=int, default=2000, help="updates to the final mix")
    parser.add_argument("--final-online", type=float, default=0.75, help="final online share")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--flush-every", type=int, default=25)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--target-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains offline, then online with the annealed mixture; returns what it measured."""
    import gymnasium as gym

    args = parse_args(argv)
    tmp = None
    root = args.dir
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="offline_to_online_")
        root = tmp.name
    offline_path, online_path = os.path.join(root, "offline"), os.path.join(root, "online")
    gr.write_npy(offline_path, scripted_episodes(args.offline_rows, 0.3, args.seed), overwrite=True)
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=args.seed + 1)
    writer = gr.ReplayWriter(online_path, format="npy")

    def act_and_append(action: int) -> tuple[bool, float]:
        nonlocal obs
        next_obs, reward, terminated, truncated, _ = env.step(action)
        pending.append((obs, action, reward, next_obs, terminated))
        obs = next_obs
        if terminated or truncated:
            obs, _ = env.reset()
        if len(pending) >= args.flush_every:
            keys = ("obs", "action", "reward", "next_obs", "done")
            dtypes = (np.float32, np.int64, np.float32, np.float32, np.bool_)
            writer.append(
                {
                    k: np.asarray([p[i] for p in pending], d)
                    for i, (k, d) in enumerate(zip(keys, dtypes))
                }
            )
            writer.flush()
            pending.clear()
        return terminated or truncated, float(reward)

    pending: list[tuple[Any, ...]] = []
    rng = np.random.default_rng(args.seed)
    while not os.path.exists(online_path):  # the online store exists before the loader
        act_and_append(int(rng.integers(2)))

    offline_steps, anneal = args.offline_steps, max(args.anneal_steps, 1)

    def online_share(step: int) -> float:
        return args.final_online * min(1.0, max(0, step - offline_steps) / anneal)

    loader = gr.make_data_loader(
        {"offline": gr.NpyDataSource(offline_path), "online": gr.NpyDataSource(online_path)},
        weights=lambda step: {"offline": 1.0 - online_share(step), "online": online_share(step)},
        batch_size=args.batch_size,
        seed=args.seed,
        sampling=gr.UniformReplay(refresh_every=10),
        source_leaf="source",
    )
    params = jax.device_put(init_params(args.seed, args.hidden))
    target = params
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    opt = {"count": jnp.zeros((), jnp.int32), "mu": zeros, "nu": zeros}
    train_step = make_train_step(args.learning_rate, args.gamma)
    act = jax.jit(lambda p, o: jnp.argmax(q_values(p, o[None])[0]))
    shares: list[float] = []
    exact = True
    returns: list[float] = []
    episode = 0.0
    start = time.perf_counter()
    try:
        with gr.sharded_device_put(loader, prefetch=1) as batches:
            for step in range(offline_steps + args.online_steps):
                if step >= offline_steps:  # online: act with the current Q (10% random)
                    if rng.random() < 0.1:
                        action = int(rng.integers(2))
                    else:
                        action = int(act(params, jnp.asarray(obs, jnp.float32)))
                    done, reward = act_and_append(action)
                    episode += reward
                    if done:
                        returns.append(episode)
                        episode = 0.0
                batch = next(batches)
                online = int(np.sum(np.asarray(batch["source"]) == 1))
                want = args.batch_size * online_share(step)
                exact &= abs(online - want) < 1.0  # the rounded share, every batch
                shares.append(online / args.batch_size)
                params, opt, _ = train_step(params, opt, target, batch)
                if step % 8 == 7:
                    # Bound the steps dispatched ahead (XLA's CPU collectives can stall otherwise).
                    jax.block_until_ready(params)
                if step % args.target_every == 0:
                    target = params
    finally:
        writer.close()
        env.close()
    result = {
        "offline_rows": args.offline_rows,
        "online_rows": len(gr.NpyDataSource(online_path)),
        "first_online_share": shares[offline_steps] if len(shares) > offline_steps else 0.0,
        "final_online_share": shares[-1],
        "exact_counts": bool(exact),
        "episodes": len(returns),
        "mean_return": float(np.mean(returns)) if returns else 0.0,
        "seconds": time.perf_counter() - start,
    }
    print(result)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
