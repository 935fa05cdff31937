"""Stores with episodes, reference implementations and the contract suite of the rl sources."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import grain
import numpy as np
import pytest

import grain_replay as gr
from grain_replay import tree as tree_lib
from grain_replay.layout import LeafSpec

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


def flat(tree: Any) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree_lib.flatten(tree)[0].items()}


def assert_flat_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want), (list(got), list(want))
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=k) if g.dtype.kind == "f" else (
            np.testing.assert_array_equal(g, w, err_msg=k)
        )


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


# -- the contract --------------------------------------------------------------------------


def grain_loader(src: Any, batch: int = 8, workers: int = 2) -> grain.DataLoader:
    return grain.DataLoader(
        data_source=src,
        sampler=grain.samplers.IndexSampler(
            len(src), shuffle=False, seed=0, num_epochs=1,
            shard_options=grain.sharding.NoSharding(),
        ),
        operations=[grain.transforms.Batch(batch, drop_remainder=False)],
        worker_count=workers,
        shard_options=grain.sharding.NoSharding(),
    )  # fmt: skip


class SourceContract:
    """The source contract for the rl sources.

    Subclasses provide fixtures ``src`` (a source) and ``expect`` (record ids ->
    the expected ``{key: array}``), and ``make(tmp_path, scale)`` building a
    source whose store grows with ``scale``.
    """

    def make(self, tmp_path: Any, scale: int) -> Any:
        raise NotImplementedError

    def test_read_batch_matches_reference_with_duplicates_and_negatives(
        self, src: Any, expect: Callable[[np.ndarray], dict[str, Any]]
    ) -> None:
        n = len(src)
        rng = np.random.default_rng(1)
        idx = np.concatenate([[0, n - 1, -1, -n, 1, 1], rng.integers(-n, n, 50)])
        want = expect(np.where(idx < 0, idx + n, idx))
        assert_flat_equal(flat(src.read_batch(idx)), want)
        assert_flat_equal(src.read_flat(list(idx)), want)

    def test_getitem_and_getitems_match_read_batch(self, src: Any, expect: Any) -> None:
        n = len(src)
        for i in [0, n - 1, -1, -n]:
            want = {k: v[0] for k, v in expect(np.array([i % n])).items()}
            assert_flat_equal(flat(src[i]), want)
        records = src._getitems([2, 0, 2])
        want = expect(np.array([2, 0, 2]))
        for j, r in enumerate(records):
            assert_flat_equal(flat(r), {k: v[j] for k, v in want.items()})

    def test_spec_matches_records(self, src: Any) -> None:
        got = flat(src.read_batch([0, 1]))
        assert list(got) == list(src.spec)
        for k, s in src.spec.items():
            assert got[k].dtype == s.dtype and got[k].shape[1:] == s.shape, k
            assert type(got[k]) is np.ndarray

    def test_empty_batch_has_spec_shapes(self, src: Any) -> None:
        got = flat(src.read_batch([]))
        for k, s in src.spec.items():
            assert got[k].shape == (0, *s.shape), k

    def test_out_of_range_raises_index_error_naming_index_and_length(self, src: Any) -> None:
        n = len(src)
        for bad in (n, n + 3, -n - 1):
            with pytest.raises(IndexError, match=rf"{bad}.*{n}"):
                src[bad]
            with pytest.raises(gr.RecordIndexError, match=rf"{bad}.*{n}"):
                src.read_batch([0, bad])

    def test_non_integer_index_raises_type_error(self, src: Any) -> None:
        with pytest.raises(TypeError):
            src[1.5]
        with pytest.raises(TypeError):
            src.read_batch([0.5])

    def test_is_a_grain_random_access_source(self, src: Any) -> None:
        assert isinstance(src, grain.sources.RandomAccessDataSource)

    def test_repr_is_deterministic_after_reads(self, src: Any) -> None:
        before = repr(src)
        src[0]
        assert repr(src) == before == repr(pickle.loads(pickle.dumps(src)))
        assert str(len(src)) in before

    def test_pickle_round_trip_has_no_handle(self, src: Any, expect: Any) -> None:
        src.read_batch([0, 1])
        assert src._handle is not None
        for dumps in (pickle.dumps, cloudpickle.dumps):
            clone = pickle.loads(dumps(src))
            assert clone._handle is None
            assert getattr(clone, "_state", None) is None  # no episode index travels
            assert_flat_equal(flat(clone.read_batch([3, 1])), flat(src.read_batch([3, 1])))

    def test_pickle_size_independent_of_records(self, tmp_path: Any) -> None:
        small, big = self.make(tmp_path / "small", 1), self.make(tmp_path / "big", 50)
        assert len(big) > 20 * len(small)
        small[0], big[0]
        size_small, size_big = len(pickle.dumps(small)), len(pickle.dumps(big))
        assert abs(size_big - size_small) < 64, (size_small, size_big)

    def test_close_and_context_manager_release_and_reopen(self, src: Any, expect: Any) -> None:
        with src as s:
            s[0]
            assert s._handle is not None
        assert src._handle is None
        assert_flat_equal(flat(src[1]), {k: v[0] for k, v in expect(np.array([1])).items()})
        src.close()
        src.close()

    def test_sixteen_threads_read_correct_data(self, src: Any, expect: Any) -> None:
        errors: list[BaseException] = []
        barrier = threading.Barrier(16)
        n = len(src)

        def work(seed: int) -> None:
            try:
                rng = np.random.default_rng(seed)
                barrier.wait()
                for _ in range(10):
                    idx = rng.integers(0, n, 9)
                    assert_flat_equal(flat(src.read_batch(idx)), expect(idx))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert src._opens <= 1

    def test_spawned_workers_open_one_handle_each(self, src: Any, expect: Any) -> None:
        import worker_fns

        src[0]
        idx = [4, 0, len(src) - 1, 4]
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            results = pool.starmap(worker_fns.read_in_worker, [(src, idx)] * 2)
        for res in results:
            assert res["pid"] != os.getpid() and res["opens"] == 1
            assert_flat_equal(flat(res["batch"]), expect(np.array(idx)))
            assert_flat_equal(flat(res["again"]), expect(np.array(idx[::-1])))


def check_grain_loader(src: Any, expect: Callable[[np.ndarray], dict[str, Any]]) -> None:
    """A grain.DataLoader with 2 spawned workers reads every record of ``src`` once."""
    # Workers batch interleaved records: compare the records as a multiset.
    batches = list(grain_loader(src, batch=8, workers=2))
    got = {k: np.concatenate([flat(b)[k] for b in batches]) for k in src.spec}
    want = expect(np.arange(len(src)))
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {
        k: (v.dtype, v.shape) for k, v in want.items()
    }
    assert _record_bytes(got) == _record_bytes(want)


def _record_bytes(leaves: dict[str, np.ndarray]) -> list[bytes]:
    n = len(next(iter(leaves.values())))
    return sorted(
        b"".join(np.ascontiguousarray(v[j]).tobytes() for v in leaves.values()) for j in range(n)
    )
