"""Episode index (flags, lookups, cache) and the transition / n-step sources built on it."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from conformance import SourceTests, flat, slow_in_this_class
from rl_fixtures import ArraySource, ref_nstep, step_tree

import grain_replay as gr
from grain_replay.rl import (
    EpisodeIndex,
    NStepDataSource,
    TransitionDataSource,
    WindowDataSource,
    build_episode_index,
    episode_cache_path,
)
from grain_replay.rl import episodes as episodes_lib

LENGTHS = [4, 1, 6, 2, 5]
TERMINATED = [True, False, True, False, True]

# -- EpisodeIndex ----------------------------------------------------------------------


def test_from_flags_gives_starts_ends_and_termination() -> None:
    done = np.array([0, 0, 1, 1, 0, 1, 0, 0], bool)
    term = np.array([0, 0, 1, 0, 0, 1, 0, 0], bool)
    idx = EpisodeIndex.from_flags(done, term)
    assert idx.starts.tolist() == [0, 3, 4, 6] and idx.ends.tolist() == [3, 4, 6, 8]
    assert idx.terminated.tolist() == [True, False, True, False]
    assert idx.open_last and idx.num_steps == 8 and len(idx) == 4
    assert idx.lengths.tolist() == [3, 1, 2, 2]


def test_episode_of_is_vectorized_and_checks_range() -> None:
    idx = EpisodeIndex.from_lengths([3, 1, 2], [True, True, False])
    assert idx.episode_of(np.array([[0, 2], [3, 5]])).tolist() == [[0, 0], [1, 2]]
    with pytest.raises(IndexError, match=r"step 6 .* 6 steps"):
        idx.episode_of([1, 6])


def test_empty_store_has_no_episode() -> None:
    idx = EpisodeIndex.from_flags(np.zeros(0, bool))
    assert idx.num_episodes == 0 and idx.num_steps == 0 and not idx.open_last


@pytest.mark.parametrize("ends", [[0, 2], [3, 3], [4, 2]])
def test_bad_ends_raise_value_error(ends: list[int]) -> None:
    with pytest.raises(ValueError, match="increasing"):
        EpisodeIndex(np.array(ends), np.ones(2, bool))


@pytest.mark.parametrize(
    ("names", "flags"),
    [(("terminated", "truncated"), {}), (("terminations", "truncations"), {}),
     (("terminals", "timeouts"), {}), (("t", "x"), {"terminated_key": "t", "truncated_key": "x"})],
)  # fmt: skip
def test_flag_names_are_found_or_given(names: tuple[str, str], flags: dict[str, str]) -> None:
    tree = step_tree(LENGTHS, TERMINATED)
    tree[names[0]], tree[names[1]] = tree.pop("terminated"), tree.pop("truncated")
    idx = build_episode_index(ArraySource(tree), **flags)
    assert idx == EpisodeIndex.from_lengths(LENGTHS, TERMINATED)


def test_done_key_with_truncated_key_separates_time_limits() -> None:
    tree = step_tree(LENGTHS, TERMINATED)
    tree["done"] = tree["terminated"] | tree["truncated"]
    alone = build_episode_index(ArraySource(tree), done_key="done")
    assert alone.terminated.all()
    both = build_episode_index(ArraySource(tree), done_key="done", truncated_key="truncated")
    assert both == EpisodeIndex.from_lengths(LENGTHS, TERMINATED)


def test_missing_flag_leaf_lists_leaves_and_the_key_to_pass() -> None:
    with pytest.raises(gr.InvalidStoreError, match=r"leaves are \['a'\].*done_key="):
        build_episode_index(ArraySource({"a": np.zeros(3)}))
    with pytest.raises(
        gr.UnknownLeafError, match=r"terminated_key='term'.*Fix: pass terminated_key"
    ):
        build_episode_index(ArraySource(step_tree([3])), terminated_key="term")


def test_flag_leaf_with_several_values_per_step_raises() -> None:
    with pytest.raises(gr.InvalidStoreError, match="'done' holds \\(2,\\) values per step"):
        build_episode_index(ArraySource({"done": np.zeros((4, 2), bool)}))


def test_flag_key_of_wrong_type_raises_type_error() -> None:
    with pytest.raises(TypeError, match="done_key"):
        build_episode_index(ArraySource(step_tree([3])), done_key=3)  # type: ignore[arg-type]


def test_blocks_give_the_same_index_as_one_read() -> None:
    src = ArraySource(step_tree(LENGTHS * 5, TERMINATED * 5, open_last=True))
    assert build_episode_index(src, block_rows=3) == build_episode_index(src)


# -- the cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["hdf5", "npy", "zarr"])
def test_index_is_cached_beside_or_inside_the_store_and_reused(
    tmp_path: Any, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    suffix = {"hdf5": ".h5", "npy": "", "zarr": ".zarr"}[fmt]
    path = gr.write(str(tmp_path / f"s{suffix}"), step_tree(LENGTHS, TERMINATED), format=fmt)
    src = gr.open_source(path)
    built = build_episode_index(src)
    cache = episode_cache_path(path)
    assert os.path.exists(cache)
    assert (os.path.dirname(cache) == path) == os.path.isdir(path)

    def fail(*args: Any) -> None:
        raise AssertionError("rebuilt although the cache is fresh")

    monkeypatch.setattr(episodes_lib, "_read_flags", fail)
    again = gr.open_source(path)
    assert build_episode_index(again) == built
    assert len(gr.open_source(path)) == sum(LENGTHS)  # the store still opens


def test_stale_cache_is_rebuilt_after_the_store_is_rewritten(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "s.h5"), step_tree(LENGTHS, TERMINATED))
    build_episode_index(gr.HDF5DataSource(path))
    other = [2, 2, 7, 3, 4]
    gr.write_hdf5(path, step_tree(other, TERMINATED), overwrite=True)
    assert build_episode_index(gr.HDF5DataSource(path)) == EpisodeIndex.from_lengths(
        other, TERMINATED
    )


def test_cache_of_other_flag_keys_is_not_used(tmp_path: Any) -> None:
    tree = step_tree(LENGTHS, TERMINATED)
    path = gr.write_hdf5(str(tmp_path / "s.h5"), tree)
    src = gr.HDF5DataSource(path)
    build_episode_index(src)
    only_term = build_episode_index(src, terminated_key="terminated")
    assert only_term == EpisodeIndex.from_flags(tree["terminated"])


def test_corrupt_cache_is_rebuilt(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "s.h5"), step_tree(LENGTHS, TERMINATED))
    with open(episode_cache_path(path), "wb") as f:
        f.write(b"not an npz")
    idx = build_episode_index(gr.HDF5DataSource(path))
    assert idx == EpisodeIndex.from_lengths(LENGTHS, TERMINATED)
    assert build_episode_index(gr.HDF5DataSource(path)) == idx


def test_cache_false_writes_nothing(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "s.h5"), step_tree(LENGTHS, TERMINATED))
    build_episode_index(gr.HDF5DataSource(path), cache=False)
    assert not os.path.exists(episode_cache_path(path))


def test_read_only_directory_still_builds(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = gr.write_hdf5(str(tmp_path / "s.h5"), step_tree(LENGTHS, TERMINATED))

    def deny(*args: Any, **kwargs: Any) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr(episodes_lib.os, "replace", deny)
    assert build_episode_index(gr.HDF5DataSource(path)).num_episodes == len(LENGTHS)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]


# -- transitions and n-step returns ----------------------------------------------------


def _expect_nstep(
    tree: dict[str, Any], n: int, gamma: float, stored: bool, returns: bool = True
) -> Any:
    leaves = flat(tree)
    ref = ref_nstep(LENGTHS, TERMINATED, tree["reward"], n, gamma, stored)
    t = np.array([r["t"] for r in ref])
    boot = np.array([r["boot"] for r in ref])

    def expect(ids: np.ndarray) -> dict[str, Any]:
        out = {k: v[t[ids]] for k, v in leaves.items() if not k.startswith("next_obs")}
        src = "next_obs" if stored else "obs"
        out["next_obs/vec"] = leaves[f"{src}/vec"][boot[ids]]
        out["next_obs/pixels"] = leaves[f"{src}/pixels"][boot[ids]]
        if returns:
            out["n_step_return"] = np.array([ref[i]["ret"] for i in ids], np.float32)
            out["discount"] = np.array([ref[i]["disc"] for i in ids], np.float32)
            out["n_steps"] = np.array([ref[i]["k"] for i in ids], np.int32)
        return out

    return expect, len(ref)


class _NStepContract(SourceTests):
    n, gamma, stored = 3, 0.9, False
    rtol = 1e-6  # n-step returns are sums of floats

    def tree(self, scale: int = 1) -> dict[str, Any]:
        tree = step_tree(LENGTHS * scale, TERMINATED * scale)
        if self.stored:
            tree["next_obs"] = {k: v + 1 for k, v in tree["obs"].items()}
        return tree

    def make(self, tmp_path: Any, scale: int) -> NStepDataSource:
        tmp_path.mkdir(parents=True, exist_ok=True)
        path = gr.write_hdf5(str(tmp_path / "s.h5"), self.tree(scale))
        return NStepDataSource(gr.HDF5DataSource(path), n=self.n, gamma=self.gamma)

    @pytest.fixture
    def src(self, tmp_path: Any) -> NStepDataSource:
        return self.make(tmp_path, 1)

    @pytest.fixture
    def expect(self) -> Any:
        return _expect_nstep(self.tree(), self.n, self.gamma, self.stored)[0]

    def test_len_counts_steps_with_a_successor(self, src: NStepDataSource) -> None:
        assert len(src) == _expect_nstep(self.tree(), self.n, self.gamma, self.stored)[1]


class TestNStepDerivedNextObs(_NStepContract):
    # Grain's worker loader (seconds of spawns): make test runs it on TestNStepStoredNextObs.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )


class TestNStepStoredNextObs(_NStepContract):
    n, gamma, stored = 2, 0.5, True


def test_derived_transitions_drop_last_step_of_truncated_episodes() -> None:
    tree = step_tree(LENGTHS, TERMINATED)
    src = TransitionDataSource(ArraySource(tree), keys=["step", "obs/vec"])
    expect, n = _expect_nstep(tree, 1, 1.0, stored=False, returns=False)
    assert len(src) == n == sum(LENGTHS) - TERMINATED.count(False)
    got = flat(src.read_batch(np.arange(n)))
    assert list(got) == ["obs/vec", "step", "next_obs/vec"]
    want = expect(np.arange(n))
    np.testing.assert_array_equal(got["next_obs/vec"], want["next_obs/vec"])
    # A terminal step's next_obs repeats its own observation.
    terminal = np.flatnonzero(tree["terminated"][got["step"]])
    np.testing.assert_array_equal(got["next_obs/vec"][terminal], got["obs/vec"][terminal])
    assert src.episodes.lengths.tolist() == [4, 6, 1, 5]
    assert src.step_episodes.lengths.tolist() == LENGTHS


def test_windows_over_transitions_follow_their_episodes() -> None:
    src = TransitionDataSource(ArraySource(step_tree(LENGTHS, TERMINATED)))
    windows = WindowDataSource(src, length=2, keys=["step"])
    steps = windows.read_batch(np.arange(len(windows)))["step"]
    assert np.all(steps[:, 1] == steps[:, 0] + 1)
    assert len(windows) == sum(max(0, n - 1) for n in [4, 6, 1, 5])


def test_nstep_with_gamma_zero_and_one() -> None:
    tree = step_tree([3], [True])
    tree["reward"] = np.array([1, 2, 4], np.float32)
    one = NStepDataSource(ArraySource(tree), n=5, gamma=1.0).read_batch([0, 1, 2])
    assert one["n_step_return"].tolist() == [7, 6, 4] and one["discount"].tolist() == [0, 0, 0]
    zero = NStepDataSource(ArraySource(tree), n=2, gamma=0.0).read_batch([0])
    assert zero["n_step_return"].tolist() == [1] and zero["discount"].tolist() == [0]


@pytest.mark.parametrize(
    ("kwargs", "cls", "match"),
    [({"obs_key": "o"}, gr.UnknownLeafError, "obs_key='o'.*leaves are"),
     ({"reward_key": "r"}, gr.UnknownLeafError, "reward_key='r'"),
     ({"next_obs_key": "action"}, gr.InvalidStoreError, "does not mirror")],
)  # fmt: skip
def test_missing_or_mismatched_leaves_raise_with_fix(
    kwargs: dict[str, str], cls: type[Exception], match: str
) -> None:
    with pytest.raises(cls, match=match):
        NStepDataSource(ArraySource(step_tree(LENGTHS, TERMINATED)), **kwargs)


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"gamma": 1.5}, {"next_obs_key": "a/b"}])
def test_bad_nstep_options_raise_value_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be .*got"):
        NStepDataSource(ArraySource(step_tree(LENGTHS, TERMINATED)), **kwargs)
