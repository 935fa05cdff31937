"""Actor-learner DQN on CartPole-v1: K actor processes, one bounded store, one learner.

``--actors K`` processes (``multiprocessing``, spawn) each play gymnasium's
``CartPole-v1`` epsilon-greedily with the newest parameters the learner published
(an ``.npz`` file replaced atomically: written beside it, then ``os.replace``; an
actor reloads it when its mtime changes) and append every transition to one
bounded store, ``gr.ReplayWriter(store, capacity=..., writer_id="actor-<k>")``,
committing every ``--flush-every`` steps. Each actor logs every finished
episode (return, env step) to ``episodes/actor-<k>.jsonl`` once its last step is
committed.

The learner (this process) trains a double-Q DQN (two 256-unit layers, Adam in
pure JAX, Huber loss weighted by the importance weights) on batches of
``gr.make_data_loader(gr.open_source(store), sampling=gr.PrioritizedReplay(...,
rate_limit=limit))`` through ``gr.sharded_device_put``, giving ``|TD error|`` back
as the new priorities. The rate limit is the library's, one
``gr.RateLimit(min_size=--min-size, samples_per_insert=--samples-per-insert)`` given
to both sides: each actor's ``ReplayWriter(..., rate_limit=limit)`` declares it in
the store before its first row, so the actors hold in ``flush()`` from the start,
before the learner exists (at ``min_size + tolerance / samples_per_insert`` rows,
~1,100 with the defaults, plus a flush each), and the learner's loader holds them
from the moment it is built; then no batch comes before ``--min-size`` rows are
live, the learner waits when it is ahead of ``--samples-per-insert`` and the actors
wait when they are ahead of it. Without that hold ~8k rows would go in played by
the untrained network (half the exploration schedule) before the first update. An
actor's ``flush()`` waits at most 1 s at a time (``rate_limit_timeout``): between
waits it checks that the learner still runs, and stops when it does not. The
learner publishes its parameters every ``--publish-every`` updates and checkpoints
the model and the whole replay state (priorities, rate-limit counters, every
writer's watermark) as one Orbax checkpoint (items ``model`` and ``data``) every ``--ckpt-every``
updates and at the end. ``--resume`` continues from the newest checkpoint: the
model, the optimizer and the replay iterator are restored, every writer part is cut
back to the checkpoint's watermark (``gr.truncate_to_watermark``: no row written
after it is replayed), and the actors reopen their writer ids there.

The settings start from rl-baselines3-zoo's for DQN on CartPole-v1: lr 2.3e-3,
batch 64, learning from 1,000 rows, 128 gradient steps per 256 env steps (32
sampled rows per inserted row at batch 64), epsilon to 0.04 over the first 16 %
of the run, gamma 0.99, 100k rows of replay, a hard target copy every 128
updates (what the zoo's "every 10 env steps" amounts to between its bursts of
128 gradient steps), Huber loss, gradients clipped to norm 10, double Q. Changes
for a run twice the zoo's 5e4 steps, scored on the actors' own epsilon-greedy
play: the learning rate falls linearly to 0 over the run (``--lr-end``);
prioritized replay (alpha 0.6, beta 0.4 annealed to 1); after the zoo's
schedule epsilon goes on falling, 0.04 -> 0.01 at the last step
(``--end-epsilon``; the zoo's 500 is a greedy evaluation); and ``--keep-best``:
every ``--eval-every`` 1,000 updates the learner plays ``--eval-episodes`` 5
greedy episodes with its newest parameters, and while they score below the best
evaluation so far the actors play the best parameters instead (DQN on CartPole
tends to unlearn after it first balances: seed 1 scored 500 greedy at update
25,000 and 248 at 45,000 without it). The best parameters, their score and
whether the actors play them are part of the model checkpoint.

Run it::

    python examples/actor_learner.py --actors 2 --env-steps 100000 --seed 0 \\
        --store /tmp/al --plot /tmp/al/returns.png
    # kill it (or not), then continue from the newest checkpoint:
    python examples/actor_learner.py --actors 2 --env-steps 100000 --seed 0 \\
        --store /tmp/al --plot /tmp/al/returns.png --resume

The last line printed is ``final mean return (last 20 episodes): <float>``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import grain_replay as gr

# This module is imported again by every spawned actor: JAX, grain and Orbax are
# imported inside the learner's functions only, so an actor starts in well under a
# second and holds no XLA thread pool.

OBS_DIM, ACTIONS = 4, 2


# ---------------------------------------------------------------------------
# The Q network, shared by both sides (numpy here; the learner jits the same math)


def init_params(seed: int, hidden: int) -> dict[str, np.ndarray]:
    """Two hidden layers, He-initialized; a small output layer."""
    rng = np.random.default_rng(seed)

    def dense(i: int, o: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((i, o)) * scale / np.sqrt(i)).astype(np.float32)

    return {
        "w1": dense(OBS_DIM, hidden, np.sqrt(2.0)),
        "b1": np.zeros(hidden, np.float32),
        "w2": dense(hidden, hidden, np.sqrt(2.0)),
        "b2": np.zeros(hidden, np.float32),
        "w3": dense(hidden, ACTIONS, 0.1),
        "b3": np.zeros(ACTIONS, np.float32),
    }


def q_numpy(params: dict[str, np.ndarray], obs: np.ndarray) -> np.ndarray:
    x = np.maximum(obs @ params["w1"] + params["b1"], 0.0)
    x = np.maximum(x @ params["w2"] + params["b2"], 0.0)
    return x @ params["w3"] + params["b3"]


def publish_params(path: Path, params: dict[str, Any], updates: int) -> None:
    """Replaces ``path`` atomically: readers see the old file or the new one, whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, updates=np.int64(updates), **{k: np.asarray(v) for k, v in params.items()})
    os.replace(tmp, path)


def load_params(path: Path) -> tuple[dict[str, np.ndarray], int]:
    with np.load(path) as npz:
        params = {k: npz[k] for k in npz.files if k != "updates"}
        return params, int(npz["updates"])


# ---------------------------------------------------------------------------
# Actors


def actor_quota(env_steps: int, actors: int, k: int) -> int:
    """Env steps of actor ``k``: the run's steps split as evenly as they go."""
    return env_steps // actors + (1 if k < env_steps % actors else 0)


def epsilon_at(step: int, quota: int, fraction: float, final: float, end: float) -> float:
    """Epsilon at an actor's ``step`` of ``quota``: 1 -> ``final`` over the first
    ``fraction`` of the steps (the zoo's schedule), then ``final`` -> ``end`` linearly
    over the rest (the actors' play at the end is the run's score)."""
    explore = max(1, int(fraction * quota))
    if step < explore:
        return 1.0 - (1.0 - final) * step / explore
    return final + (end - final) * min(1.0, (step - explore) / max(1, quota - explore))


def flush(writer: gr.ReplayWriter, parent: int) -> bool:
    """Commits the appended rows, waiting for the learner as long as it runs (the rate
    limit holds a flush that would put the actors ahead); False when the learner died."""
    while True:
        try:
            writer.flush()
            return True
        except gr.RateLimitTimeoutError:  # waited rate_limit_timeout: still a learner?
            if os.getppid() != parent:
                return False


def actor_main(k: int, cfg: dict[str, Any], counter: Any, parent: int) -> None:
    """One actor: plays its quota of env steps, appending each to its part of the store."""
    import gymnasium as gym

    store, params_path = Path(cfg["store"]), Path(cfg["params"])
    quota = actor_quota(cfg["env_steps"], cfg["actors"], k)
    writer = gr.ReplayWriter(
        store / "replay",
        format="npy",
        capacity=cfg["capacity_per_actor"],
        writer_id=f"actor-{k}",
        # Declared in the store before the first row: the actors hold from the start.
        rate_limit=gr.RateLimit(
            min_size=cfg["min_size"], samples_per_insert=cfg["samples_per_insert"]
        ),
        rate_limit_timeout=1.0,  # a flush waits 1 s at a time: then is the learner alive?
    )
    step = writer.committed  # after --resume: continue after the last committed row
    rng = np.random.default_rng([cfg["seed"], k, step])
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=int(rng.integers(2**31)))
    log = open(store / "episodes" / f"actor-{k}.jsonl", "a", encoding="utf-8")
    params, stamp = None, None
    rows: list[tuple[np.ndarray, int, float, np.ndarray, bool]] = []
    finished: list[dict[str, Any]] = []
    episode_return = 0.0
    try:
        while step < quota:
            if step % 8 == 0:  # a stat every few steps: new parameters published?
                try:
                    now = os.stat(params_path).st_mtime_ns
                except FileNotFoundError:
                    now = None
                if now is not None and now != stamp:
                    params, _ = load_params(params_path)
                    stamp = now
            epsilon = epsilon_at(
                step, quota, cfg["exploration_fraction"], cfg["final_epsilon"], cfg["end_epsilon"]
            )
            if params is None or rng.random() < epsilon:
                action = int(rng.integers(ACTIONS))
            else:
                action = int(np.argmax(q_numpy(params, np.asarray(obs, np.float32))))
            next_obs, reward, terminated, truncated, _ = env.step(action)
            rows.append((obs, action, float(reward), next_obs, bool(terminated)))
            episode_return += float(reward)
            step += 1
            with counter.get_lock():
                counter.value += 1
                total = counter.value
            obs = next_obs
            if terminated or truncated:
                finished.append({"return": episode_return, "env_step": total, "time": time.time()})
                episode_return = 0.0
                obs, _ = env.reset()
            if len(rows) >= cfg["flush_every"] or step == quota:
                writer.append(
                    {
                        "obs": np.stack([r[0] for r in rows]).astype(np.float32),
                        "action": np.array([r[1] for r in rows], np.int64),
                        "reward": np.array([r[2] for r in rows], np.float32),
                        "next_obs": np.stack([r[3] for r in rows]).astype(np.float32),
                        "terminated": np.array([r[4] for r in rows], np.bool_),
                    }
                )
                if not flush(writer, parent):  # the learner died: stop (its rows are safe)
                    return
                rows.clear()
                for episode in finished:  # logged once its last step is committed
                    log.write(json.dumps({"actor": k, **episode}) + "\n")
                log.flush()
                finished.clear()
                if os.getppid() != parent:  # the learner died: stop (its rows are safe)
                    return
    finally:
        log.close()
        writer.close()
        env.close()


# ---------------------------------------------------------------------------
# The learner


def make_train_step(
    learning_rate: float, lr_end: float, total_updates: int, gamma: float, max_grad_norm: float
) -> Any:
    """One Adam step on the importance-weighted double-Q Huber loss; returns ``|TD error|``.

    The learning rate falls linearly from ``learning_rate`` to ``lr_end * learning_rate``
    over ``total_updates``: the policy the actors play at the end settles.
    """
    import jax
    import jax.numpy as jnp

    def q_values(params: Any, obs: jax.Array) -> jax.Array:
        x = jax.nn.relu(obs @ params["w1"] + params["b1"])
        x = jax.nn.relu(x @ params["w2"] + params["b2"])
        return x @ params["w3"] + params["b3"]

    def loss(params: Any, target: Any, data: Any, weight: jax.Array) -> Any:
        q = q_values(params, data["obs"])
        q_sa = jnp.take_along_axis(q, data["action"].astype(jnp.int32)[:, None], axis=1)[:, 0]
        # Double Q: the online network picks the next action, the target network rates it.
        best = jnp.argmax(q_values(params, data["next_obs"]), axis=1)
        q_next = jnp.take_along_axis(q_values(target, data["next_obs"]), best[:, None], axis=1)
        done = data["terminated"].astype(jnp.float32)
        y = data["reward"] + gamma * (1.0 - done) * q_next[:, 0]
        delta = q_sa - jax.lax.stop_gradient(y)
        huber = jnp.where(jnp.abs(delta) <= 1.0, 0.5 * delta**2, jnp.abs(delta) - 0.5)
        return jnp.mean(weight / jnp.max(weight) * huber), delta

    @jax.jit
    def step(params: Any, opt: Any, target: Any, data: Any, weight: Any) -> Any:
        (_, delta), grads = jax.value_and_grad(loss, has_aux=True)(params, target, data, weight)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        grads = jax.tree_util.tree_map(lambda g: g * jnp.minimum(1.0, max_grad_norm / norm), grads)
        count = opt["count"] + 1
        mu = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt["mu"], grads)
        nu = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, opt["nu"], grads)
        frac = jnp.minimum(count / total_updates, 1.0)
        lr = learning_rate * (1.0 - (1.0 - lr_end) * frac)
        lr = lr * jnp.sqrt(1 - 0.999**count) / (1 - 0.9**count)
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - lr * m / (jnp.sqrt(v) + 1e-8), params, mu, nu
        )
        return params, {"count": count, "mu": mu, "nu": nu}, jnp.abs(delta)

    return step


def greedy_return(params: dict[str, np.ndarray], episodes: int, seed: int) -> float:
    """Mean return of the greedy policy (epsilon 0) over ``episodes`` fresh episodes.

    Only printed beside the actors' epsilon-greedy mean: it tells a policy that is
    bad from one that is good but knocked over by its exploration.
    """
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    total = 0.0
    try:
        for i in range(episodes):
            obs, _ = env.reset(seed=seed + i)
            done = False
            while not done:
                action = int(np.argmax(q_numpy(params, np.asarray(obs, np.float32))))
                obs, reward, terminated, truncated, _ = env.step(action)
                total += float(reward)
                done = terminated or truncated
    finally:
        env.close()
    return total / episodes


def read_episodes(episodes: Path) -> list[dict[str, Any]]:
    """Every logged episode of every actor, in order of the run's env steps."""
    out = []
    for path in sorted(episodes.glob("actor-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            out.extend(json.loads(line) for line in f if line.strip())
    return sorted(out, key=lambda e: (e["env_step"], e["actor"]))


def plot_returns(path: str, episodes: list[dict[str, Any]], title: str) -> None:
    """A PNG of the episode returns (and their running mean of 20) against env steps."""
    steps = np.array([e["env_step"] for e in episodes], np.float64)
    returns = np.array([e["return"] for e in episodes], np.float64)
    window = min(20, max(1, len(returns)))
    mean = np.convolve(returns, np.ones(window) / window, mode="valid") if len(returns) else returns
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the rl extra brings Pillow: a plainer chart without matplotlib
        _plot_with_pillow(path, steps, returns, steps[window - 1 :], mean, title)
        return
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, returns, ".", markersize=2, alpha=0.4, label="episode return")
    ax.plot(steps[window - 1 :], mean, "-", label=f"mean of the last {window}")
    ax.set_xlabel("env steps (all actors)")
    ax.set_ylabel("return")
    ax.set_ylim(0, 520)
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_with_pillow(
    path: str, x: np.ndarray, y: np.ndarray, xm: np.ndarray, ym: np.ndarray, title: str
) -> None:
    from PIL import Image, ImageDraw

    w, h, pad = 700, 400, 40
    image = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(image)
    xmax = max(float(x.max()) if len(x) else 1.0, 1.0)

    def to_px(xs: np.ndarray, ys: np.ndarray) -> list[tuple[float, float]]:
        px = pad + xs / xmax * (w - 2 * pad)
        py = h - pad - np.clip(ys, 0, 520) / 520 * (h - 2 * pad)
        return list(zip(px.tolist(), py.tolist(), strict=True))

    draw.rectangle([pad, pad, w - pad, h - pad], outline="black")
    for px, py in to_px(x, y):
        draw.point((px, py), fill=(90, 130, 200))
    if len(xm) > 1:
        draw.line(to_px(xm, ym), fill=(220, 100, 20), width=2)
    draw.text((pad, 10), f"{title} (return 0-520 vs env steps 0-{int(xmax)})", fill="black")
    image.save(path, format="PNG")


def mean_last(episodes: list[dict[str, Any]], n: int = 20) -> float:
    returns = [e["return"] for e in episodes[-n:]]
    return float(np.mean(returns)) if returns else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = parser.add_argument_group("run")
    run.add_argument("--actors", type=int, default=2, help="actor processes")
    run.add_argument("--env-steps", type=int, default=100_000, help="env steps, all actors")
    run.add_argument("--capacity", type=int, default=100_000, help="replay rows, all actors")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--store", help="run directory (default: a temporary one)")
    run.add_argument("--plot", help="write a PNG of the returns against env steps here")
    run.add_argument("--resume", action="store_true", help="continue from --store's checkpoint")
    run.add_argument("--flush-every", type=int, default=32, help="actor commit interval, steps")
    run.add_argument("--ckpt-every", type=int, default=10_000, help="updates between checkpoints")
    run.add_argument("--publish-every", type=int, default=16, help="updates between publishes")
    dqn = parser.add_argument_group("DQN")
    dqn.add_argument("--batch-size", type=int, default=64)
    dqn.add_argument("--learning-rate", type=float, default=2.3e-3)
    dqn.add_argument("--gamma", type=float, default=0.99)
    dqn.add_argument("--hidden", type=int, default=256)
    dqn.add_argument("--min-size", type=int, default=1_000, help="rows before learning")
    dqn.add_argument(
        "--samples-per-insert", type=float, default=32.0, help="sampled rows per inserted row"
    )
    dqn.add_argument("--lr-end", type=float, default=0.0, help="final lr, a fraction of it")
    dqn.add_argument("--target-every", type=int, default=128, help="updates between target copies")
    dqn.add_argument("--tau", type=float, default=1.0, help="target <- tau*online + (1-tau)*target")
    dqn.add_argument("--exploration-fraction", type=float, default=0.16)
    dqn.add_argument(
        "--final-epsilon", type=float, default=0.04, help="epsilon after --exploration-fraction"
    )
    dqn.add_argument("--end-epsilon", type=float, default=0.01, help="epsilon at the last step")
    dqn.add_argument("--max-grad-norm", type=float, default=10.0)
    dqn.add_argument("--alpha", type=float, default=0.6, help="how much priorities count")
    dqn.add_argument("--beta", type=float, default=0.4, help="annealed to 1 over the run")
    dqn.add_argument(
        "--eval-every", type=int, default=1000, help="updates between greedy evaluations (0: none)"
    )
    dqn.add_argument("--eval-episodes", type=int, default=5, help="episodes per evaluation")
    dqn.add_argument(
        "--keep-best",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="actors play the best-evaluated parameters while the newest evaluate worse",
    )
    run.add_argument(
        "--timeout", type=float, default=300.0, help="seconds the learner may wait for rows"
    )
    args = parser.parse_args(argv)
    if args.eval_every < 0:
        parser.error(f"--eval-every must be 0 (none) or positive, got {args.eval_every}")
    if args.keep_best and not args.eval_every:
        parser.error("--keep-best needs evaluations: pass --eval-every N, or --no-keep-best")
    positive = ("actors", "env_steps", "capacity", "batch_size", "flush_every", "ckpt_every")
    for name in (*positive, "eval_episodes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.capacity < args.actors:
        parser.error(f"--capacity {args.capacity} is below one row per actor ({args.actors})")
    if args.min_size < 0:
        parser.error(f"--min-size must be 0 or more, got {args.min_size}")
    for name in ("final_epsilon", "end_epsilon"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.min_size >= args.env_steps:
        parser.error(f"--min-size {args.min_size} must be below --env-steps {args.env_steps}")
    if args.resume and not args.store:
        parser.error("--resume needs the --store of the run to continue")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs actors and learner; returns what the run reached (also printed)."""
    args = parse_args(argv)
    tmp = None
    if args.store is None:
        tmp = tempfile.mkdtemp(prefix="actor_learner_")
        args.store = tmp
    try:
        return _run(args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    store = Path(args.store).absolute()
    replay, ckpt_dir, episodes = store / "replay", store / "ckpt", store / "episodes"
    params_path = store / "params.npz"
    if not args.resume and (replay.exists() or ckpt_dir.exists()):
        raise SystemExit(
            f"{store} already holds a run (replay/ or ckpt/): pass --resume to continue it, "
            "or another --store"
        )
    import grain
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    episodes.mkdir(parents=True, exist_ok=True)
    batch = args.batch_size
    total_updates = math.floor((args.env_steps - args.min_size) * args.samples_per_insert / batch)

    params = init_params(args.seed, args.hidden)
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    model: dict[str, Any] = {
        "params": params,
        "target": params,
        "opt": {"count": np.zeros((), np.int32), "mu": zeros, "nu": zeros},
        "updates": np.zeros((), np.int64),
        # The best greedy evaluation so far, and whether the actors play it now.
        "best": {"params": params, "score": np.array(-1.0), "playing": np.array(False)},
    }
    mgr = ocp.CheckpointManager(
        ckpt_dir, item_names=("model", "data"), options=ocp.CheckpointManagerOptions(max_to_keep=2)
    )
    resume_step = mgr.latest_step() if args.resume else None
    if args.resume and resume_step is None:
        print(f"--resume: no checkpoint under {ckpt_dir} yet; starting the learner afresh")
    if resume_step is not None:
        model = mgr.restore(
            resume_step, args=ocp.args.Composite(model=ocp.args.StandardRestore(model))
        ).model
        print(f"resumed from the checkpoint at update {int(model['updates'])}")
    best = model["best"]
    publish_params(
        params_path, best["params"] if best["playing"] else model["params"], int(model["updates"])
    )

    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)  # env steps of all actors, for the episode log
    if resume_step is not None and replay.exists():  # drop the rows of the dead run's actors
        gr.truncate_to_watermark(replay, gr.read_watermark(ckpt_dir / str(resume_step) / "data"))
    if replay.exists():  # --resume: every actor continues after its committed rows
        counter.value = sum(m.committed for m in gr.open_source(replay).writers)
    cfg = {
        "store": str(store),
        "params": str(params_path),
        "env_steps": args.env_steps,
        "actors": args.actors,
        "capacity_per_actor": max(1, args.capacity // args.actors),
        "seed": args.seed,
        "flush_every": args.flush_every,
        "exploration_fraction": args.exploration_fraction,
        "final_epsilon": args.final_epsilon,
        "end_epsilon": args.end_epsilon,
        "min_size": args.min_size,
        "samples_per_insert": args.samples_per_insert,
    }
    train_step = make_train_step(
        args.learning_rate, args.lr_end, total_updates, args.gamma, args.max_grad_norm
    )
    blend = jax.jit(
        lambda t, o: jax.tree_util.tree_map(lambda a, b: args.tau * b + (1.0 - args.tau) * a, t, o)
    )
    state = jax.device_put(model)
    _compile(train_step, blend, state, batch)  # before the actors start: they wait on no compile
    procs = [
        ctx.Process(target=actor_main, args=(k, cfg, counter, os.getpid()), daemon=True)
        for k in range(args.actors)
    ]
    start = time.perf_counter()
    for p in procs:
        p.start()

    updates = first_update = int(model["updates"])
    first_batch_at: int | None = None  # env steps (all actors) when the first batch came
    first_batch_rows: int | None = None  # rows committed (all actors) then
    beta0 = args.beta
    sampling = gr.PrioritizedReplay(
        alpha=args.alpha,
        beta=lambda step: min(1.0, beta0 + (1.0 - beta0) * step / total_updates),
        # The actors' limit (no batch before min_size rows are live; the learner waits
        # when ahead, the actors when they are): a learner whose limit differed from the
        # store's would be refused.
        rate_limit=gr.RateLimit(min_size=args.min_size, samples_per_insert=args.samples_per_insert),
        timeout=args.timeout,  # how long the learner may wait for rows
    )
    td: list[float] = []
    batches = None
    try:
        while not any(replay.glob("writers/*/manifest.json")):  # no actor committed yet
            _check_actors(procs)
            time.sleep(0.05)
        loader = gr.make_data_loader(
            gr.open_source(replay), batch_size=batch, seed=args.seed, sampling=sampling
        )
        batches = gr.sharded_device_put(loader, prefetch=1)
        if resume_step is not None:
            mgr.restore(
                resume_step,
                args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(batches)),
            )
        while updates < total_updates:
            sampled = next(batches)  # gr.Sampled(data, index, weight)
            if first_batch_at is None:
                first_batch_at = counter.value
                first_batch_rows = sum(m.committed for m in gr.open_source(replay).writers)
                print(
                    f"first batch after {time.perf_counter() - start:.1f} s, "
                    f"at env step {first_batch_at}, {first_batch_rows} rows committed",
                    flush=True,
                )
            new, opt, td_abs = train_step(
                state["params"], state["opt"], state["target"], sampled.data, sampled.weight
            )
            batches.update_priorities(sampled.index, td_abs)
            updates += 1
            state = {**state, "params": new, "opt": opt, "updates": jnp.asarray(updates)}
            if updates % args.target_every == 0:
                state["target"] = blend(state["target"], new)
            if args.eval_every and updates % args.eval_every == 0:
                state["best"] = _evaluate(args, state, updates, params_path)
            playing = bool(state["best"]["playing"])
            if (updates % args.publish_every == 0 or updates == 1) and not playing:  # 1: at once
                publish_params(params_path, jax.device_get(state["params"]), updates)
            if updates % 1000 == 0:
                td.append(float(jnp.mean(td_abs)))
                recent = read_episodes(episodes)
                print(
                    f"update {updates}/{total_updates} env steps {counter.value} "
                    f"mean return (last 20) {mean_last(recent):.1f} |td| {td[-1]:.3f} "
                    f"{time.perf_counter() - start:.0f} s",
                    flush=True,
                )
            if updates % args.ckpt_every == 0 or updates == total_updates:
                _save(mgr, updates, state, batches)
        if not bool(state["best"]["playing"]):
            publish_params(params_path, jax.device_get(state["params"]), updates)
        # The store declares the limit: the closed learner's count goes on holding the
        # actors, and it lets them commit what is left of their quota.
        batches.close()
        batches = None
        for p in procs:
            p.join()
    finally:
        if batches is not None:
            batches.close()
        mgr.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    seconds = time.perf_counter() - start
    history = read_episodes(episodes)
    final = mean_last(history)
    if args.plot:
        title = f"actor-learner DQN, CartPole-v1, {args.actors} actors, seed {args.seed}"
        plot_returns(args.plot, history, title)
    result = {
        "env_steps": counter.value,
        "updates": updates,
        "episodes": len(history),
        "seconds": seconds,
        "updates_per_s": (updates - first_update) / seconds,
        "resumed_from": None if resume_step is None else resume_step,
        "first_batch_at_env_step": first_batch_at,
        "first_batch_committed_rows": first_batch_rows,
        "final_mean_return": final,
    }
    print(json.dumps(result))
    print(f"final mean return (last 20 episodes): {final}")
    return result


def _compile(train_step: Any, blend: Any, state: Any, batch: int) -> None:
    """Compiles the steps for the batches ``sharded_device_put`` will hand out."""
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    obs = np.zeros((batch, OBS_DIM), np.float32)
    data = {
        "action": np.zeros(batch, np.int64),
        "next_obs": obs,
        "obs": obs,
        "reward": np.zeros(batch, np.float32),
        "terminated": np.zeros(batch, np.bool_),
    }
    data, weight = jax.device_put((data, np.ones(batch, np.float32)), rows)
    jax.block_until_ready(train_step(state["params"], state["opt"], state["target"], data, weight))
    jax.block_until_ready(blend(state["target"], state["params"]))


def _evaluate(args: argparse.Namespace, state: Any, updates: int, params_path: Path) -> Any:
    """Scores the newest parameters greedily; returns the new ``best`` entry.

    With ``--keep-best``, an evaluation below the best so far switches the actors
    to the best parameters (published now); one that matches or beats it makes
    those the best and the actors follow the newest parameters again. DQN on
    CartPole tends to unlearn after it first balances; the actors' play (the
    run's score, and the data) stays with the policy that balanced.
    """
    import jax

    current = jax.device_get(state["params"])
    score = greedy_return(current, args.eval_episodes, 10_000 * args.seed + updates)
    best = state["best"]
    if score >= float(best["score"]):
        best = {"params": current, "score": np.array(score), "playing": np.array(False)}
    elif args.keep_best:
        if not bool(best["playing"]):
            publish_params(params_path, jax.device_get(best["params"]), updates)
        best = {**best, "playing": np.array(True)}
    print(
        f"update {updates} greedy return ({args.eval_episodes} episodes) {score:.1f}, "
        f"best {float(best['score']):.1f}; actors play the "
        f"{'best' if bool(best['playing']) else 'newest'} parameters",
        flush=True,
    )
    return best


def _check_actors(procs: list[Any]) -> None:
    for k, p in enumerate(procs):
        if p.exitcode not in (None, 0):
            raise RuntimeError(f"actor-{k} exited with code {p.exitcode}; see its error above")


def _save(mgr: Any, updates: int, state: Any, batches: Any) -> None:
    import grain
    import jax
    import orbax.checkpoint as ocp

    mgr.save(
        updates,
        args=ocp.args.Composite(
            model=ocp.args.StandardSave(jax.device_get(state)),
            data=grain.checkpoint.CheckpointSave(batches),
        ),
    )
    mgr.wait_until_finished()


if __name__ == "__main__":
    main()
