"""Record CartPole-v1 episodes into a growing replay store with ``gr.ReplayWriter``, then check it.

A gymnasium CartPole-v1 environment is played by a simple policy (a pole-angle
heuristic with ``--epsilon`` random actions, or uniformly random actions). Each
finished episode is appended to the store as one block of rows
(``obs, action, reward, [next_obs,] terminated, truncated``) and the writer
commits (``flush``) every ``--flush-every`` episodes, so a reader opening the
store while it grows sees whole episodes only. Afterwards the store is reopened
with ``gr.open_source``, summarised as ``grain-replay info`` does, and its
episode index (``gr.build_episode_index``) is checked against what was
recorded: episode count, lengths and termination flags.

Run it::

    python examples/record_cartpole.py                    # 20 episodes, .npy store in a temp dir
    python examples/record_cartpole.py --episodes 200 --out cartpole       # a .npy directory
    python examples/record_cartpole.py --format zarr --out cartpole.zarr --policy random
    python examples/record_cartpole.py --format hdf5 --out cartpole.h5 --no-next-obs

An existing ``--out`` store is appended to (the writer continues after its
committed rows); the new episodes are then the last ones of the index.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np

import grain_replay as gr

_SUFFIX = {"hdf5": ".h5", "npy": "", "zarr": ".zarr"}


def heuristic_action(obs: np.ndarray) -> int:
    """Push the cart toward the side the pole is falling to (keeps it up for ~hundreds of steps)."""
    return int(obs[2] + 0.5 * obs[3] > 0.0)


def play_episode(
    env: Any, rng: np.random.Generator, seed: int, policy: str, epsilon: float
) -> dict[str, np.ndarray]:
    """One episode as a block of rows, every leaf with a leading time axis."""
    obs, _ = env.reset(seed=seed)
    rows: dict[str, list[Any]] = {k: [] for k in ("obs", "action", "reward", "next_obs")}
    terminated = truncated = False
    while not (terminated or truncated):
        if policy == "random" or rng.random() < epsilon:
            action = int(rng.integers(env.action_space.n))
        else:
            action = heuristic_action(obs)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        rows["obs"].append(obs)
        rows["action"].append(action)
        rows["reward"].append(reward)
        rows["next_obs"].append(next_obs)
        obs = next_obs
    t = len(rows["action"])
    end = np.arange(t) == t - 1
    return {
        "obs": np.asarray(rows["obs"], np.float32),
        "action": np.asarray(rows["action"], np.int32),
        "reward": np.asarray(rows["reward"], np.float32),
        "next_obs": np.asarray(rows["next_obs"], np.float32),
        "terminated": end & bool(terminated),
        "truncated": end & bool(truncated) & (not terminated),
    }


def record_episodes(
    path: str,
    num_episodes: int,
    *,
    format: str | None = None,
    seed: int = 0,
    policy: str = "heuristic",
    epsilon: float = 0.1,
    max_steps: int = 500,
    flush_every: int = 4,
    next_obs: bool = True,
    verbose: bool = False,
) -> dict[str, Any]:
    """Plays ``num_episodes`` CartPole-v1 episodes and appends them to the store at ``path``.

    Args:
      path: the store; created on the first append, appended to if it exists.
      num_episodes: episodes to record.
      format: ``"hdf5"``, ``"npy"``, ``"zarr"``, or None (from the path).
      seed: seeds the environment resets and the policy's random actions.
      policy: ``"heuristic"`` (pole-angle rule with ``epsilon`` random actions)
        or ``"random"``.
      epsilon: probability of a random action under the heuristic policy.
      max_steps: time limit of an episode (then it is truncated).
      flush_every: commit the store every this many episodes (and at the end).
      next_obs: also store ``next_obs`` (else it can be derived from ``obs``
        by ``gr.TransitionDataSource``/``gr.NStepDataSource``).
      verbose: print a line at every commit.

    Returns:
      ``lengths``, ``terminated``, ``truncated`` and ``returns`` of the recorded
      episodes (numpy arrays), ``committed_before`` (rows already in the
      store), ``committed_seen`` (rows a fresh reader saw after each commit),
      ``steps`` and ``steps_per_s``.
    """
    import gymnasium as gym

    if num_episodes <= 0:
        raise ValueError(f"num_episodes must be positive, got {num_episodes}")
    if flush_every <= 0:
        raise ValueError(f"flush_every must be positive, got {flush_every}")
    env = gym.make("CartPole-v1", max_episode_steps=max_steps)
    env.action_space.seed(seed)
    rng = np.random.default_rng(seed)
    lengths, terminated, truncated, returns, seen = [], [], [], [], []
    start = time.perf_counter()
    with gr.ReplayWriter(path, format=format) as writer:
        committed_before = writer.committed
        for e in range(num_episodes):
            block = play_episode(env, rng, seed * 100_003 + e, policy, epsilon)
            if not next_obs:
                del block["next_obs"]
            writer.append(block)
            lengths.append(len(block["action"]))
            terminated.append(bool(block["terminated"][-1]))
            truncated.append(bool(block["truncated"][-1]))
            returns.append(float(block["reward"].sum()))
            if (e + 1) % flush_every == 0 or e + 1 == num_episodes:
                committed = writer.flush()
                # A reader opened now sees exactly the committed rows: whole episodes.
                with gr.open_source(writer.path) as reader:
                    seen.append(len(reader))
                if verbose:
                    print(f"  committed {committed:,} rows after episode {e + 1}", flush=True)
    elapsed = time.perf_counter() - start
    env.close()
    steps = int(sum(lengths))
    return {
        "lengths": np.asarray(lengths, np.int64),
        "terminated": np.asarray(terminated, bool),
        "truncated": np.asarray(truncated, bool),
        "returns": np.asarray(returns, np.float64),
        "committed_before": committed_before,
        "committed_seen": seen,
        "steps": steps,
        "steps_per_s": steps / elapsed if elapsed > 0 else float("inf"),
    }


def check_store(path: str, recorded: dict[str, Any]) -> dict[str, Any]:
    """Reopens the store and checks its episode index against what was recorded.

    Raises:
      AssertionError: a count, length or flag differs (the message says which).
    """
    from grain_replay.cli import main as cli_main

    cli_main(["info", path])  # what `grain-replay info <path>` prints
    with gr.open_source(path) as src:
        index = gr.build_episode_index(src)
        num_records = len(src)
    e = len(recorded["lengths"])
    before = recorded["committed_before"]
    if num_records != before + recorded["steps"]:
        raise AssertionError(
            f"store has {num_records} rows, recorded {before} + {recorded['steps']}"
        )
    new = index.ends > before
    if int(new.sum()) != e:
        raise AssertionError(f"index has {int(new.sum())} new episodes, recorded {e}")
    if not np.array_equal(index.lengths[new], recorded["lengths"]):
        raise AssertionError("episode lengths differ from the recorded ones")
    if not np.array_equal(index.terminated[new], recorded["terminated"]):
        raise AssertionError("episode termination flags differ from the recorded ones")
    if index.open_last:
        raise AssertionError("the last episode has no end flag")
    committed = before + np.cumsum(recorded["lengths"])
    if not set(recorded["committed_seen"]) <= set(committed.tolist()):
        raise AssertionError(f"a reader saw a partial episode: {recorded['committed_seen']}")
    return {
        "num_records": num_records,
        "num_episodes": index.num_episodes,
        "index_lengths": index.lengths[new],
        "index_terminated": index.terminated[new],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--episodes", type=int, default=20, help="episodes to record")
    parser.add_argument("--out", help="the store (appended to if it exists); default: temp dir")
    parser.add_argument(
        "--format", choices=sorted(_SUFFIX), default="npy", help="format of a new store"
    )
    parser.add_argument("--policy", choices=["heuristic", "random"], default="heuristic")
    parser.add_argument("--epsilon", type=float, default=0.1, help="random-action rate")
    parser.add_argument("--max-steps", type=int, default=500, help="time limit per episode")
    parser.add_argument("--flush-every", type=int, default=4, help="episodes per commit")
    parser.add_argument(
        "--no-next-obs", dest="next_obs", action="store_false", help="do not store next_obs"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("episodes", "max_steps", "flush_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses ``argv`` (default: ``sys.argv[1:]``), records, checks, and returns the numbers."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="record_cartpole_") as tmp:
        out = args.out or os.path.join(tmp, f"cartpole{_SUFFIX[args.format]}")
        fmt = args.format if args.out is None or not os.path.exists(out) else None
        print(f"recording {args.episodes} episodes ({args.policy} policy) into {out}", flush=True)
        recorded = record_episodes(
            out, args.episodes, format=fmt, seed=args.seed, policy=args.policy,
            epsilon=args.epsilon, max_steps=args.max_steps, flush_every=args.flush_every,
            next_obs=args.next_obs, verbose=True,
        )  # fmt: skip
        checked = check_store(out, recorded)
    lengths = recorded["lengths"]
    result = {
        "store": out,
        "episodes": len(lengths),
        "steps": recorded["steps"],
        "lengths": lengths.tolist(),
        "terminated": int(recorded["terminated"].sum()),
        "truncated": int(recorded["truncated"].sum()),
        "mean_return": float(recorded["returns"].mean()),
        "commits": len(recorded["committed_seen"]),
        "steps_per_s": recorded["steps_per_s"],
        **{k: v for k, v in checked.items() if not k.startswith("index_")},
        "index_lengths": checked["index_lengths"].tolist(),
    }
    print(
        f"recorded {result['episodes']} episodes, {result['steps']:,} steps "
        f"({result['terminated']} terminated, {result['truncated']} truncated, mean return "
        f"{result['mean_return']:.1f}) in {result['commits']} commits at "
        f"{result['steps_per_s']:,.0f} steps/s; episode index matches "
        f"({result['num_episodes']} episodes in the store)",
        flush=True,
    )
    return result


if __name__ == "__main__":
    main()
