"""An actor whose environments live on the accelerator, saving every step from the device.

1,024 CartPole environments (the dynamics of gymnasium's ``CartPole-v1``, written
in JAX) are stepped together under ``jit`` + ``vmap`` by an epsilon-greedy policy
(a small random Q-network). Every step's transitions (``obs``, ``action``,
``reward``, ``next_obs``, ``done``) are appended, as ``jax.Array``s, to a bounded
replay store: ``ReplayWriter.append`` queues them and returns, a background thread
copies them to host and writes, and ``flush(wait=False)`` every ``--flush-every`` steps
commits the rows so far in the background (they are visible and durable once it
completes; the loop does not wait for it). ``--blocking-flush`` waits at every
flush instead (the durability barrier in the loop); ``--no-write`` runs the same
loop without the writer (the cost of saving is the difference).

Run:  python examples/device_actor.py --envs 1024 --steps 2000 --store /tmp/actor_replay
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import grain_replay as gr

# gymnasium CartPole-v1 (classic_control/cartpole.py), Euler integration.
GRAVITY, MASSCART, MASSPOLE, LENGTH, FORCE_MAG, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS = MASSCART + MASSPOLE
POLEMASS_LENGTH = MASSPOLE * LENGTH
THETA_THRESHOLD = 12 * 2 * np.pi / 360
X_THRESHOLD = 2.4
MAX_EPISODE_STEPS = 500  # the TimeLimit of CartPole-v1


class EnvState(NamedTuple):
    physics: jax.Array  # (envs, 4): x, x_dot, theta, theta_dot
    t: jax.Array  # (envs,) steps since the episode's reset


class Carry(NamedTuple):
    env: EnvState
    key: jax.Array
    returns: jax.Array  # (envs,) return of the running episode
    finished: jax.Array  # () episodes finished so far
    finished_return: jax.Array  # () sum of their returns


def reset(key: jax.Array) -> jax.Array:
    """One environment's initial state: uniform in [-0.05, 0.05], as gymnasium."""
    return jax.random.uniform(key, (4,), jnp.float32, -0.05, 0.05)


def physics_step(s: jax.Array, action: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One environment's next state and whether the pole fell or the cart left."""
    x, x_dot, theta, theta_dot = s[0], s[1], s[2], s[3]
    force = jnp.where(action == 1, FORCE_MAG, -FORCE_MAG)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    temp = (force + POLEMASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
    theta_acc = (GRAVITY * sin - cos * temp) / (
        LENGTH * (4.0 / 3.0 - MASSPOLE * cos**2 / TOTAL_MASS)
    )
    x_acc = temp - POLEMASS_LENGTH * theta_acc * cos / TOTAL_MASS
    x, x_dot = x + TAU * x_dot, x_dot + TAU * x_acc
    theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * theta_acc
    nxt = jnp.stack([x, x_dot, theta, theta_dot]).astype(jnp.float32)
    fell = (jnp.abs(x) > X_THRESHOLD) | (jnp.abs(theta) > THETA_THRESHOLD)
    return nxt, fell


def init_q_network(key: jax.Array, hidden: int = 64) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (4, hidden)) / 2.0,
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, 2)) / np.sqrt(hidden),
        "b2": jnp.zeros(2),
    }


def q_values(params: dict[str, jax.Array], obs: jax.Array) -> jax.Array:
    h = jax.nn.relu(obs @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


@functools.partial(jax.jit, static_argnames=("epsilon",))
def actor_step(
    params: dict[str, jax.Array], c: Carry, epsilon: float
) -> tuple[Carry, dict[str, jax.Array]]:
    """Every environment's step: epsilon-greedy actions, auto-reset, the transitions."""
    envs = c.env.t.shape[0]
    key, k_explore, k_random, k_reset = jax.random.split(c.key, 4)
    obs = c.env.physics
    greedy = jnp.argmax(q_values(params, obs), axis=-1).astype(jnp.int32)
    random = jax.random.randint(k_random, (envs,), 0, 2, jnp.int32)
    explore = jax.random.uniform(k_explore, (envs,)) < epsilon
    action = jnp.where(explore, random, greedy)
    next_obs, fell = jax.vmap(physics_step)(obs, action)
    t = c.env.t + 1
    done = fell | (t >= MAX_EPISODE_STEPS)
    reward = jnp.ones(envs, jnp.float32)
    returns = c.returns + reward
    fresh = jax.vmap(reset)(jax.random.split(k_reset, envs))
    env = EnvState(
        jnp.where(done[:, None], fresh, next_obs), jnp.where(done, 0, t).astype(jnp.int32)
    )
    new = Carry(
        env,
        key,
        jnp.where(done, 0.0, returns),
        c.finished + done.sum(dtype=jnp.int32),
        c.finished_return + jnp.where(done, returns, 0.0).sum(),
    )
    transition = {
        "obs": obs,
        "action": action,
        "reward": reward,
        "next_obs": next_obs,
        "done": fell,  # terminal (not a time limit): what a TD target needs
    }
    return new, transition


def make_actor(
    envs: int, seed: int = 0, epsilon: float = 0.1
) -> tuple[Callable[[Carry], tuple[Carry, dict[str, jax.Array]]], Carry]:
    """The jitted step of ``envs`` environments and its initial carry."""
    key = jax.random.PRNGKey(seed)
    key, k_params, k_reset = jax.random.split(key, 3)
    params = init_q_network(k_params)
    physics = jax.vmap(reset)(jax.random.split(k_reset, envs))
    carry = Carry(
        EnvState(physics, jnp.zeros(envs, jnp.int32)),
        key,
        jnp.zeros(envs, jnp.float32),
        jnp.zeros((), jnp.int32),
        jnp.zeros((), jnp.float32),
    )
    return functools.partial(actor_step, params, epsilon=epsilon), carry


def run_loop(
    step: Callable[[Carry], tuple[Carry, dict[str, jax.Array]]],
    carry: Carry,
    steps: int,
    writer: gr.ReplayWriter | None,
    flush_every: int,
    wait: bool = False,
) -> tuple[Carry, float]:
    """Steps ``steps`` times, appending every step from the device and committing every
    ``flush_every`` steps (in the background unless ``wait``); returns the carry and the
    seconds it took, the writer's last (blocking) flush included."""
    start = time.perf_counter()
    for i in range(steps):
        carry, transition = step(carry)
        if writer is not None:
            writer.append(transition)
            if (i + 1) % flush_every == 0:
                writer.flush(wait=wait)
    if writer is not None:
        writer.flush()  # every row durable before the time is taken
    jax.block_until_ready(carry)
    return carry, time.perf_counter() - start


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", type=int, default=1024, help="parallel environments")
    p.add_argument("--steps", type=int, default=2000, help="steps of every environment")
    p.add_argument("--store", default=None, help="replay store (default: a temporary one)")
    p.add_argument("--format", default="npy", choices=["npy", "hdf5", "zarr"])
    p.add_argument("--capacity", type=int, default=1 << 20, help="rows the store keeps")
    p.add_argument("--flush-every", type=int, default=100, help="steps between flushes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--blocking-flush",
        action="store_true",
        help="wait for every flush in the loop (default: commit in the background)",
    )
    p.add_argument("--no-write", action="store_true", help="step without saving")
    args = p.parse_args(argv)
    for name in ("envs", "steps", "capacity", "flush_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    step, carry = make_actor(args.envs, args.seed)
    carry, _ = step(carry)  # compile outside the timed loop
    jax.block_until_ready(carry)
    tmp = None
    writer = None
    store = args.store
    if not args.no_write:
        if store is None:
            tmp = tempfile.mkdtemp(prefix="device_actor_")
            store = os.path.join(tmp, "replay")
        writer = gr.ReplayWriter(store, format=args.format, capacity=args.capacity)
    try:
        carry, seconds = run_loop(
            step, carry, args.steps, writer, args.flush_every, wait=args.blocking_flush
        )
        rows = None if writer is None else writer.live
    finally:
        if writer is not None:
            writer.close()
        if tmp is not None:
            shutil.rmtree(tmp)
    finished = int(carry.finished)
    mean_return = float(carry.finished_return) / max(1, finished)
    result = {
        "steps": args.steps,
        "envs": args.envs,
        "seconds": seconds,
        "steps_per_s": args.steps / seconds,
        "env_steps_per_s": args.steps * args.envs / seconds,
        "episodes": finished,
        "mean_return": mean_return,
        "rows": rows,
        "store": None if tmp is not None else store,
    }
    saved = "not saved" if writer is None else f"{rows} rows live in {store or 'a temporary store'}"
    print(
        f"{args.steps} steps x {args.envs} envs in {seconds:.2f} s: "
        f"{result['steps_per_s']:.0f} steps/s ({result['env_steps_per_s']:.0f} env steps/s); "
        f"{finished} episodes, mean return {mean_return:.1f}; {saved}"
    )
    return result


if __name__ == "__main__":
    main()
