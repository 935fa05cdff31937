"""Stores with episodes and reference implementations for the rl sources' tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.store.layout import LeafSpec

# -- step stores with episodes ---------------------------------------------------------


def episode_flags(
    lengths: Sequence[int], terminated: Sequence[bool], open_last: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Per-step ``(terminated, truncated)`` flags; an open last episode has neither flag."""
    n = int(sum(lengths))
    term = np.zeros(n, bool)
    trunc = np.zeros(n, bool)
    ends = np.cumsum(lengths) - 1
    for e, (end, t) in enumerate(zip(ends, terminated)):
        if open_last and e == len(lengths) - 1:
            continue
        (term if t else trunc)[end] = True
    return term, trunc


def step_tree(
    lengths: Sequence[int],
    terminated: Sequence[bool] | None = None,
    open_last: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """A step store whose ``step`` leaf is the step id (so reads are easy to check)."""
    terminated = [True] * len(lengths) if terminated is None else list(terminated)
    n = int(sum(lengths))
    rng = np.random.default_rng(seed)
    term, trunc = episode_flags(lengths, terminated, open_last)
    return {
        "obs": {
            "vec": (np.arange(n, dtype=np.float32)[:, None] + np.arange(3, dtype=np.float32)),
            "pixels": rng.integers(0, 255, (n, 2, 2), dtype=np.uint8),
        },
        "action": rng.integers(0, 4, n).astype(np.int64),
        "reward": rng.standard_normal(n).astype(np.float32),
        "step": np.arange(n, dtype=np.int64),
        "terminated": term,
        "truncated": trunc,
    }


class ArraySource:
    """An in-memory source (spec, len, read_batch) that is not a grain_replay ReplaySource."""

    def __init__(self, tree: Any):
        self._leaves, self.treedef = tree_lib.flatten(tree)
        self._leaves = {k: np.asarray(v) for k, v in self._leaves.items()}
        self._n = len(next(iter(self._leaves.values())))

    @property
    def spec(self) -> dict[str, LeafSpec]:
        return {k: LeafSpec(v.dtype, v.shape[1:]) for k, v in self._leaves.items()}

    def __len__(self) -> int:
        return self._n

    def read_batch(self, indices: Any) -> Any:
        idx = np.asarray(indices, dtype=np.int64)
        return tree_lib.unflatten(self.treedef, {k: v[idx] for k, v in self._leaves.items()})

    def __repr__(self) -> str:
        return f"ArraySource(n={self._n})"


# -- reference implementations (plain loops) ---------------------------------------------


def ref_windows(
    lengths: Sequence[int], length: int, stride: int = 1, pad: bool = False
) -> list[tuple[list[int], list[bool]]]:
    """Every window as (steps, mask), by episode then start."""
    out = []
    start = 0
    for n in lengths:
        for s in range(0, n, stride):
            if not pad and s + length > n:
                break
            steps = [start + min(s + i, n - 1) for i in range(length)]
            out.append((steps, [s + i < n for i in range(length)]))
        start += n
    return out


def ref_nstep(
    lengths: Sequence[int],
    terminated: Sequence[bool],
    rewards: np.ndarray,
    n: int,
    gamma: float,
    stored: bool,
) -> list[dict[str, Any]]:
    """Per record: step t, bootstrap row, return, discount, k."""
    out = []
    start = 0
    for length, term in zip(lengths, terminated):
        end = start + length
        last = end if (stored or term) else end - 1  # steps that are records: [start, last)
        for t in range(start, last):
            k = 0
            ret = 0.0
            while k < n and t + k < end and (stored or term or t + k + 1 < end):
                ret += gamma**k * float(rewards[t + k])
                k += 1
            terminal = term and t + k == end
            boot = t + k - 1 if stored else min(t + k, end - 1)
            out.append(
                {"t": t, "boot": boot, "ret": ret, "disc": 0.0 if terminal else gamma**k, "k": k}
            )
        start = end
    return out


# -- D4RL and Minari files -----------------------------------------------------------------


def write_d4rl(
    path: str,
    lengths: Sequence[int],
    terminated: Sequence[bool],
    *,
    next_obs: bool = True,
    open_last: bool = False,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A D4RL-layout file (with metadata of other lengths); returns its per-step arrays."""
    import h5py

    n = int(sum(lengths))
    rng = np.random.default_rng(seed)
    term, trunc = episode_flags(lengths, terminated, open_last)
    obs = np.arange(n, dtype=np.float32)[:, None] * np.ones(4, np.float32)
    data = {
        "observations": obs,
        "actions": rng.standard_normal((n, 2)).astype(np.float32),
        "rewards": rng.standard_normal(n).astype(np.float32),
        "terminals": term,
        "timeouts": trunc,
        "infos/qpos": rng.standard_normal((n, 3)).astype(np.float64),
    }
    if next_obs:
        data["next_observations"] = obs + 0.5
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
        f["metadata/algorithm"] = np.bytes_("SAC")
        f["metadata/policy/fc0/weight"] = rng.standard_normal((8, 4)).astype(np.float32)
    return data


def write_minari_file(path: str, lengths: Sequence[int]) -> str:
    """A Minari-layout ``main_data.hdf5`` written with h5py (no collector): fast, any size."""
    import h5py

    with h5py.File(path, "w") as f:
        for e, n in enumerate(lengths):
            g = f.create_group(f"episode_{e}")
            g.attrs["total_steps"] = n
            g.create_dataset("observations", data=np.arange(n + 1, dtype=np.float32), chunks=True)
            g["actions"] = np.full(n, e, np.int64)
            g["rewards"] = np.ones(n)
            g["terminations"] = np.arange(n) == n - 1
            g["truncations"] = np.zeros(n, bool)
    return path


_DICT_ENV_ID = "GrainReplayDictTest-v0"


def make_dict_env(**kwargs: Any) -> Any:
    """A tiny env with a Dict(Box, Discrete, Tuple(Box, Discrete)) observation space."""
    import gymnasium as gym
    from gymnasium import spaces

    class DictEnv(gym.Env):
        observation_space = spaces.Dict(
            {
                "pos": spaces.Box(-10, 10, (2,), np.float32),
                "mode": spaces.Discrete(3),
                "pair": spaces.Tuple((spaces.Box(0, 100, (3,), np.float32), spaces.Discrete(5))),
            }
        )
        action_space = spaces.Discrete(2)

        def _obs(self) -> dict[str, Any]:
            t = np.float32(self._t)
            return {
                "pos": np.array([t, -t], np.float32),
                "mode": np.int64(self._t % 3),
                "pair": (np.full(3, t, np.float32), np.int64(self._t % 5)),
            }

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            self._t = 0
            self._limit = int(self.np_random.integers(1, 7))
            return self._obs(), {"t": 0}

        def step(self, action: Any) -> Any:
            self._t += 1
            terminated = self._t >= self._limit and self._limit % 2 == 0
            truncated = self._t >= self._limit and not terminated
            return self._obs(), float(self._t), terminated, truncated, {"t": self._t}

    return DictEnv()


def register_dict_env() -> str:
    """Registers (once) :func:`make_dict_env` with gymnasium; returns its id."""
    import gymnasium as gym

    if _DICT_ENV_ID not in gym.registry:
        gym.register(_DICT_ENV_ID, entry_point="rl_fixtures:make_dict_env")
    return _DICT_ENV_ID


_IMAGE_ENV_ID = "GrainReplayImageTest-v0"


def make_image_env(**kwargs: Any) -> Any:
    """A tiny env whose observations are a Dict of a 40x48 RGB frame (an image space, which
    Minari JPEG-encodes), a 36x36 grey frame and a vector; actions are Box(2)."""
    import gymnasium as gym
    from gymnasium import spaces

    class ImageEnv(gym.Env):
        observation_space = spaces.Dict(
            {
                "rgb": spaces.Box(0, 255, (40, 48, 3), np.uint8),
                "grey": spaces.Box(0, 255, (36, 36), np.uint8),
                "vec": spaces.Box(-1, 1, (4,), np.float32),
            }
        )
        action_space = spaces.Box(-1, 1, (2,), np.float32)

        def _obs(self) -> dict[str, Any]:
            t = self._t
            yy, xx = np.mgrid[0:40, 0:48]
            rgb = np.stack([(xx * 5 + t * 7) % 256, (yy * 6 + t * 3) % 256, (xx + yy) * 2], -1)
            return {
                "rgb": rgb.astype(np.uint8),
                "grey": np.full((36, 36), (t * 17) % 256, np.uint8),
                "vec": np.full(4, t / 10, np.float32),
            }

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            self._t = 0
            self._limit = int(self.np_random.integers(2, 7))
            return self._obs(), {}

        def step(self, action: Any) -> Any:
            self._t += 1
            terminated = self._t >= self._limit
            return self._obs(), float(self._t), terminated, False, {}

    return ImageEnv()


def register_image_env() -> str:
    """Registers (once) :func:`make_image_env` with gymnasium; returns its id."""
    import gymnasium as gym

    if _IMAGE_ENV_ID not in gym.registry:
        gym.register(_IMAGE_ENV_ID, entry_point="rl_fixtures:make_image_env")
    return _IMAGE_ENV_ID


def collect_minari(
    env_id: str,
    dataset_id: str,
    episodes: int,
    seed: int = 0,
    max_steps: int = 500,
    record_infos: bool = False,
    **collector_kwargs: Any,
) -> Any:
    """A Minari dataset recorded by minari's own DataCollector (MINARI_DATASETS_PATH set).

    ``collector_kwargs`` go to the collector (``data_format="arrow"``, ``jpeg_encoding=``).
    """
    import gymnasium as gym
    import minari

    env = minari.DataCollector(
        gym.make(env_id, max_episode_steps=max_steps), record_infos=record_infos,
        **collector_kwargs,
    )  # fmt: skip
    env.action_space.seed(seed)
    for ep in range(episodes):
        env.reset(seed=seed + ep)
        while True:
            _, _, term, trunc, _ = env.step(env.action_space.sample())
            if term or trunc:
                break
    return env.create_dataset(
        dataset_id=dataset_id, algorithm_name="random", author="test",
        author_email="test@example.com", code_permalink="https://example.com",
        description="test data",
    )  # fmt: skip
