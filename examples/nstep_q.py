"""n-step Q-learning (DQN with a target network, pure JAX) through ``gr.NStepDataSource``.

The store holds steps (``obs, action, reward, terminated, truncated``); the
n-step view turns each step ``t`` into a transition with
``n_step_return = sum_{i<k} gamma**i r[t+i]``, the bootstrap observation
``next_obs`` (``k`` steps later) and ``discount`` (``gamma**k``, 0 when the
episode terminated within the ``k`` steps), so the DQN target is
``n_step_return + discount * max_a Q_target(next_obs, a)``. Batches come from
``gr.make_data_loader`` (fresh seeded order every epoch, repeating forever)
through ``gr.sharded_device_put`` as ``jax.Array``s sharded over every device.
The Q network is a small MLP trained with Adam written out in pure JAX; the
target network is a copy refreshed every ``--target-every`` steps.

Two data sets:

* ``--env chain`` (default): a chain of ``--chain-length`` states, one-hot
  observations, actions left/right, reward 1 on reaching the last state
  (which terminates). Episodes use exploring starts: a random start state and
  first action, then the optimal action (right). Every n-step return of this
  data is then an unbiased sample of the optimal return, so Q converges to the
  analytic ``Q*(s, right) = gamma**(L-2-s)``,
  ``Q*(s, left) = gamma * V*(max(s-1, 0))``, which the script checks. The store
  keeps observations once; ``next_obs`` is derived from the next steps.
* ``--env cartpole``: CartPole-v1 episodes recorded with
  ``examples/record_cartpole.py``'s ``record_episodes`` (stored ``next_obs``);
  the greedy policy is evaluated in the environment at the end. Here the TD
  error need not fall: the Q values grow from 0 toward ~1/(1-gamma), and the
  errors with them.

Run it::

    python examples/nstep_q.py                           # chain MDP, checks Q against Q*
    python examples/nstep_q.py --env cartpole --episodes 200 --steps 5000
    python examples/nstep_q.py --store chain.zarr --format zarr   # written there if missing
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/nstep_q.py

The global batch size must be a multiple of the device count (default 256).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import grain_replay as gr

_SUFFIX = {"hdf5": ".h5", "npy": "", "zarr": ".zarr"}
LEFT, RIGHT = 0, 1

# Training steps dispatched ahead of the host before it waits for one to finish.
_MAX_IN_FLIGHT = 8


# -- data -----------------------------------------------------------------------------------


def record_chain(
    path: str,
    num_episodes: int,
    length: int,
    *,
    format: str | None = None,
    seed: int = 0,
    episodes_per_append: int = 100,
) -> dict[str, Any]:
    """Writes exploring-start episodes of the chain MDP to a store with ``gr.ReplayWriter``.

    Returns:
      ``steps`` and ``episodes`` written.
    """
    if length < 3:
        raise ValueError(f"the chain needs at least 3 states, got {length}")
    rng = np.random.default_rng(seed)
    eye = np.eye(length, dtype=np.float32)
    steps = 0
    with gr.ReplayWriter(path, format=format) as writer:
        for first in range(0, num_episodes, episodes_per_append):
            states: list[int] = []
            actions: list[int] = []
            ends: list[int] = []
            for _ in range(min(episodes_per_append, num_episodes - first)):
                s = int(rng.integers(length - 1))
                a = int(rng.integers(2))  # exploring start: any first action
                while True:
                    states.append(s)
                    actions.append(a)
                    s = s + 1 if a == RIGHT else max(s - 1, 0)
                    if s == length - 1:
                        ends.append(len(states) - 1)
                        break
                    a = RIGHT  # then the optimal policy
            n = len(states)
            end = np.zeros(n, bool)
            end[ends] = True
            writer.append(
                {
                    "obs": eye[states],
                    "action": np.asarray(actions, np.int32),
                    "reward": end.astype(np.float32),  # 1 on reaching the goal
                    "terminated": end,
                    "truncated": np.zeros(n, bool),
                }
            )
            writer.flush()
            steps += n
    return {"steps": steps, "episodes": num_episodes}


def chain_q_star(length: int, gamma: float) -> np.ndarray:
    """``(L-1, 2)`` optimal Q of the non-terminal chain states (left, right)."""
    s = np.arange(length - 1)
    v = gamma ** (length - 2 - s).astype(np.float64)
    left = gamma * v[np.maximum(s - 1, 0)]
    return np.stack([left, v], axis=1)


def _sibling(name: str) -> ModuleType:
    """Another example of this folder, imported by path (examples/ is not a package)."""
    key = f"_grain_replay_example_{name}"
    if key not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


# -- the Q network and the update -----------------------------------------------------------


def init_params(seed: int, obs_dim: int, hidden: int, num_actions: int) -> dict[str, np.ndarray]:
    """Host-side (numpy) initial weights of a two-hidden-layer MLP."""
    rng = np.random.default_rng(seed)

    def dense(i: int, o: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((i, o)) * scale / np.sqrt(i)).astype(np.float32)

    return {
        "w1": dense(obs_dim, hidden),
        "b1": np.zeros(hidden, np.float32),
        "w2": dense(hidden, hidden),
        "b2": np.zeros(hidden, np.float32),
        "w3": dense(hidden, num_actions, 0.1),
        "b3": np.zeros(num_actions, np.float32),
    }


def q_values(params: dict[str, Any], obs: jax.Array) -> jax.Array:
    x = obs.reshape(obs.shape[0], -1).astype(jnp.float32)
    x = jax.nn.relu(x @ params["w1"] + params["b1"])
    x = jax.nn.relu(x @ params["w2"] + params["b2"])
    return x @ params["w3"] + params["b3"]


def td_loss(
    params: dict[str, Any], target: dict[str, Any], batch: dict[str, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """Huber loss of the n-step TD error, and the mean squared TD error."""
    q = q_values(params, batch["obs"])
    q_sa = jnp.take_along_axis(q, batch["action"].astype(jnp.int32)[:, None], axis=1)[:, 0]
    bootstrap = jnp.max(q_values(target, batch["next_obs"]), axis=1)
    y = batch["n_step_return"] + batch["discount"] * bootstrap
    delta = q_sa - jax.lax.stop_gradient(y)
    huber = jnp.where(jnp.abs(delta) <= 1.0, 0.5 * delta**2, jnp.abs(delta) - 0.5)
    return jnp.mean(huber), jnp.mean(delta**2)


def make_train_step(learning_rate: float, b1: float = 0.9, b2: float = 0.999) -> Any:
    """One Adam step on the TD loss; the batch mean is a collective over every device."""

    @jax.jit
    def train_step(
        params: dict[str, Any],
        opt: dict[str, Any],
        target: dict[str, Any],
        batch: dict[str, jax.Array],
    ) -> tuple[dict[str, Any], dict[str, Any], jax.Array]:
        (_, td2), grads = jax.value_and_grad(td_loss, has_aux=True)(params, target, batch)
        count = opt["count"] + 1
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, opt["mu"], grads)
        nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["nu"], grads)
        lr = learning_rate * jnp.sqrt(1 - b2**count) / (1 - b1**count)
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), params, mu, nu
        )
        return params, {"count": count, "mu": mu, "nu": nu}, td2

    return train_step


def evaluate_cartpole(params: dict[str, Any], episodes: int, seed: int) -> float:
    """Mean return of the greedy policy on CartPole-v1."""
    import gymnasium as gym

    q = jax.jit(q_values)
    env = gym.make("CartPole-v1")
    host = jax.device_get(params)
    returns = []
    for e in range(episodes):
        obs, _ = env.reset(seed=10_000 + seed + e)
        total, done = 0.0, False
        while not done:
            action = int(np.argmax(np.asarray(q(host, obs[None].astype(np.float32)))[0]))
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


# -- script -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--env", choices=["chain", "cartpole"], default="chain")
    parser.add_argument("--store", help="replay store; recorded there if missing")
    parser.add_argument("--format", choices=sorted(_SUFFIX), default="npy")
    parser.add_argument(
        "--episodes", type=int, help="episodes to record (default: chain 2000, cartpole 50)"
    )
    parser.add_argument("--chain-length", type=int, default=8)
    parser.add_argument("--max-episode-steps", type=int, default=200, help="cartpole time limit")
    parser.add_argument("--epsilon", type=float, default=0.5, help="cartpole random-action rate")
    parser.add_argument("--n", type=int, default=3, help="steps per return")
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--steps", type=int, default=1500, help="training steps")
    parser.add_argument(
        "--batch-size", type=int, default=256, help="global batch size, a multiple of the devices"
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--target-every", type=int, default=100, help="target network refresh")
    parser.add_argument("--workers", type=int, default=0, help="grain worker processes")
    parser.add_argument("--eval-episodes", type=int, default=5, help="cartpole greedy episodes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=250)
    args = parser.parse_args(argv)
    if args.episodes is None:
        args.episodes = 2000 if args.env == "chain" else 50
    for name in ("episodes", "steps", "n", "hidden", "target_every", "max_episode_steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.chain_length < 3:
        parser.error(f"--chain-length must be at least 3, got {args.chain_length}")
    devices = jax.device_count()
    if args.batch_size <= 0 or args.batch_size % devices:
        parser.error(
            f"--batch-size {args.batch_size} does not split over {devices} device(s); "
            f"use a positive multiple of {devices}"
        )
    return args


def record(args: argparse.Namespace, store: str) -> None:
    t0 = time.perf_counter()
    if args.env == "chain":
        got = record_chain(
            store, args.episodes, args.chain_length, format=args.format, seed=args.seed
        )
        steps = got["steps"]
    else:
        got = _sibling("record_cartpole").record_episodes(
            store, args.episodes, format=args.format, seed=args.seed, epsilon=args.epsilon,
            max_steps=args.max_episode_steps, flush_every=10,
        )  # fmt: skip
        steps = got["steps"]
    print(
        f"recorded {args.episodes} {args.env} episodes ({steps:,} steps) into {store} "
        f"({time.perf_counter() - t0:.1f}s)",
        flush=True,
    )


def train(args: argparse.Namespace, store: str) -> dict[str, Any]:
    steps_src = gr.open_source(store)
    nstep = gr.NStepDataSource(steps_src, n=args.n, gamma=args.gamma, keys=["obs", "action"])
    loader = gr.make_data_loader(
        nstep,
        batch_size=args.batch_size // jax.process_count(),
        seed=args.seed,
        num_epochs=None,
        worker_count=args.workers,
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    obs_dim = int(np.prod(nstep.spec["obs"].shape, dtype=np.int64))
    host_params = init_params(args.seed, obs_dim, args.hidden, 2)
    zeros = jax.tree_util.tree_map(np.zeros_like, host_params)
    params = jax.device_put(host_params, replicated)
    target = params
    opt = jax.device_put({"count": np.zeros((), np.int32), "mu": zeros, "nu": zeros}, replicated)
    train_step = make_train_step(args.learning_rate)

    device_td: list[jax.Array] = []
    start = time.perf_counter()
    with gr.sharded_device_put(loader, mesh, prefetch=2) as batches:
        for step, batch in zip(range(args.steps), batches):
            if step % args.target_every == 0:
                target = params  # arrays are immutable: this is the frozen copy
            params, opt, td2 = train_step(params, opt, target, batch)
            device_td.append(td2)
            if len(device_td) > _MAX_IN_FLIGHT:
                # Bound the steps dispatched ahead (XLA's CPU collectives can stall otherwise).
                device_td[-_MAX_IN_FLIGHT - 1].block_until_ready()
            if step == 0:  # compilation stays out of the rate
                print(f"step {step:5d}  td^2 {float(td2):.4f}  (initial)", flush=True)
                start = time.perf_counter()
            elif args.log_every and step % args.log_every == 0:
                print(f"step {step:5d}  td^2 {float(td2):.5f}", flush=True)
        jax.block_until_ready(params)
        elapsed = time.perf_counter() - start
    td = [float(x) for x in jax.device_get(device_td)]
    tail = max(1, min(50, len(td) // 5))
    result: dict[str, Any] = {
        "env": args.env,
        "store": store,
        "steps": len(td),
        "transitions": len(nstep),
        "devices": jax.device_count(),
        "batch_size": args.batch_size,
        "initial_td2": td[0],
        "final_td2": float(np.mean(td[-tail:])),
        "steps_per_s": (len(td) - 1) / elapsed if elapsed > 0 else float("inf"),
        "td2": td,
    }
    summary = (
        f"mean squared TD error {result['initial_td2']:.4f} -> {result['final_td2']:.5f} "
        f"(mean of last {tail}); {result['steps_per_s']:.1f} steps/s on {result['devices']} "
        f"device(s), global batch {args.batch_size}, {len(nstep):,} {args.n}-step transitions"
    )
    if args.env == "chain":
        length = args.chain_length
        q = np.asarray(jax.device_get(q_values(params, jnp.eye(length)[: length - 1])))
        q_star = chain_q_star(length, args.gamma)
        result["q"] = q.tolist()
        result["q_star"] = q_star.tolist()
        result["q_max_abs_error"] = float(np.max(np.abs(q - q_star)))
        result["greedy_is_optimal"] = bool(np.all(np.argmax(q, axis=1) == RIGHT))
        summary += (
            f"\nmax |Q - Q*| over the {2 * (length - 1)} state-actions: "
            f"{result['q_max_abs_error']:.4f}; greedy policy optimal: "
            f"{result['greedy_is_optimal']}"
        )
    elif args.eval_episodes > 0:
        result["greedy_return"] = evaluate_cartpole(params, args.eval_episodes, args.seed)
        summary += f"\ngreedy policy return on CartPole-v1: {result['greedy_return']:.1f}"
    print(summary, flush=True)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses ``argv`` (default: ``sys.argv[1:]``), records if needed, trains, returns results."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nstep_q_") as tmp:
        store = args.store or os.path.join(tmp, f"{args.env}{_SUFFIX[args.format]}")
        if not os.path.exists(store):
            record(args, store)
        return train(args, store)


if __name__ == "__main__":
    main()
