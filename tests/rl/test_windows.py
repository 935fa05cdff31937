"""WindowDataSource: windows inside episodes, padding, the source contract, properties."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
from conformance import SourceTests, flat, slow_in_this_class
from hypothesis import given, settings
from hypothesis import strategies as st
from rl_fixtures import ArraySource, ref_windows, step_tree

import grain_replay as gr
from grain_replay.rl import EpisodeIndex, WindowDataSource

LENGTHS = [5, 1, 3, 9, 2, 7, 4]
TERMINATED = [True, False, True, True, False, True, False]


def _expect_windows(tree: dict[str, Any], lengths: list[int], t: int, stride: int, pad: bool):
    leaves = flat(tree)
    ref = ref_windows(lengths, t, stride, pad)
    steps = np.array([s for s, _ in ref], dtype=np.int64).reshape(-1, t)
    masks = np.array([m for _, m in ref], dtype=bool).reshape(-1, t)

    def expect(ids: np.ndarray) -> dict[str, Any]:
        out = {k: v[steps[ids]] for k, v in leaves.items()}
        if pad:
            out["mask"] = masks[ids]
        return out

    return expect, len(ref)


class _WindowContract(SourceTests):
    t, stride, pad = 3, 1, False

    def make(self, tmp_path: Any, scale: int) -> WindowDataSource:
        tmp_path.mkdir(parents=True, exist_ok=True)
        tree = step_tree(LENGTHS * scale, TERMINATED * scale)
        path = gr.write_hdf5(str(tmp_path / "steps.h5"), tree)
        return WindowDataSource(gr.HDF5DataSource(path), self.t, self.stride, self.pad)

    @pytest.fixture
    def src(self, tmp_path: Any) -> WindowDataSource:
        return self.make(tmp_path, 1)

    @pytest.fixture
    def expect(self) -> Any:
        return _expect_windows(
            step_tree(LENGTHS, TERMINATED), LENGTHS, self.t, self.stride, self.pad
        )[0]

    def test_len_counts_windows_inside_episodes(self, src: WindowDataSource) -> None:
        assert len(src) == len(ref_windows(LENGTHS, self.t, self.stride, self.pad))


class TestWindowsHDF5(_WindowContract):
    # Grain's worker loader (seconds of spawns): make test runs it on TestWindowsNpyPaddedStrided.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )


class TestWindowsNpyPaddedStrided(_WindowContract):
    t, stride, pad = 4, 2, True

    def make(self, tmp_path: Any, scale: int) -> WindowDataSource:
        tmp_path.mkdir(parents=True, exist_ok=True)
        tree = step_tree(LENGTHS * scale, TERMINATED * scale)
        path = gr.write_npy(str(tmp_path / "steps"), tree)
        return WindowDataSource(gr.NpyDataSource(path), self.t, self.stride, self.pad)


def test_windows_have_time_axis_and_mask_spec_when_padded(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "s.h5"), step_tree(LENGTHS, TERMINATED))
    src = WindowDataSource(gr.HDF5DataSource(path), length=4, pad=True)
    assert src.spec["obs/pixels"].shape == (4, 2, 2)
    assert src.spec["mask"].shape == (4,) and src.spec["mask"].dtype == bool
    batch = src.read_batch(np.arange(len(src)))
    assert batch["obs"]["vec"].shape == (len(src), 4, 3) and batch["mask"].shape == (len(src), 4)


def test_short_episodes_give_no_window_unless_padded() -> None:
    tree = step_tree([1, 2, 6], [True, True, True])
    assert len(WindowDataSource(ArraySource(tree), length=3)) == 4
    padded = WindowDataSource(ArraySource(tree), length=3, pad=True)
    steps, mask = padded.window_steps(np.arange(len(padded)))
    assert steps[0].tolist() == [0, 0, 0] and mask[0].tolist() == [True, False, False]
    assert steps[1].tolist() == [1, 2, 2] and mask[1].tolist() == [True, True, False]


def test_unterminated_last_episode_is_an_episode() -> None:
    tree = step_tree([4, 5], [True, True], open_last=True)
    src = WindowDataSource(ArraySource(tree), length=5)
    assert len(src) == 1
    assert src.read_batch([0])["step"].tolist() == [[4, 5, 6, 7, 8]]
    assert src.step_episodes.open_last


def test_keys_select_leaves_without_flags() -> None:
    src = WindowDataSource(ArraySource(step_tree(LENGTHS)), length=2, keys=["obs/vec", "step"])
    assert list(src.spec) == ["obs/vec", "step"]
    assert set(src[0]) == {"obs", "step"}


def test_done_key_defines_episodes() -> None:
    tree = {"x": np.arange(6), "done": np.array([0, 1, 0, 0, 1, 0], bool)}
    src = WindowDataSource(ArraySource(tree), length=2, done_key="done")
    assert src.read_batch(np.arange(len(src)))["x"].tolist() == [[0, 1], [2, 3], [3, 4]]


def test_explicit_episodes_are_used_and_pickled() -> None:
    tree = {"x": np.arange(6)}
    episodes = EpisodeIndex.from_lengths([2, 4], [True, False])
    src = WindowDataSource(ArraySource(tree), length=3, episodes=episodes)
    assert src.read_batch([0, 1])["x"].tolist() == [[2, 3, 4], [3, 4, 5]]
    clone = pickle.loads(pickle.dumps(src))
    assert clone.read_batch([1])["x"].tolist() == [[3, 4, 5]]


def test_episodes_of_wrong_length_raise_value_error() -> None:
    with pytest.raises(gr.InvalidStoreError, match="covers 3 steps but the source has 6"):
        WindowDataSource(ArraySource({"x": np.arange(6)}), 2, episodes=EpisodeIndex([3], [True]))


def test_missing_flags_raise_naming_leaves_and_done_key() -> None:
    with pytest.raises(gr.InvalidStoreError, match=r"\['x'\].*done_key="):
        WindowDataSource(ArraySource({"x": np.arange(6)}), length=2)
    with pytest.raises(gr.UnknownLeafError, match=r"done_key='nope'.*leaves"):
        WindowDataSource(ArraySource(step_tree([3])), length=2, done_key="nope")


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"length": 0}, ValueError), ({"length": 2, "stride": -1}, ValueError),
     ({"length": 2.0}, TypeError), ({"length": 2, "mask_key": "a/b"}, ValueError)],
)  # fmt: skip
def test_bad_options_raise(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        WindowDataSource(ArraySource(step_tree([3])), **kwargs)


def test_mask_key_clash_raises_with_fix() -> None:
    tree = {**step_tree([3]), "mask": np.zeros(3, bool)}
    with pytest.raises(gr.InvalidStoreError, match=r"already has.*mask.*keys="):
        WindowDataSource(ArraySource(tree), length=2, pad=True)
    src = WindowDataSource(ArraySource(tree), length=2, pad=True, mask_key="valid")
    assert "valid" in src.spec


def test_padding_a_single_array_store_raises_with_fix(tmp_path: Any) -> None:
    steps = np.arange(6, dtype=np.int64)
    episodes = EpisodeIndex.from_lengths([3, 3], [True, True])
    with pytest.raises(gr.InvalidStoreError, match="dict at the root"):
        WindowDataSource(ArraySource(steps), length=2, pad=True, episodes=episodes)
    src = WindowDataSource(ArraySource(steps), length=2, episodes=episodes)
    assert src.read_batch([0, 3]).tolist() == [[0, 1], [4, 5]]


def test_store_rewritten_under_a_pickled_source_raises(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "s.h5"), step_tree([4, 4]))
    blob = pickle.dumps(WindowDataSource(gr.HDF5DataSource(path), length=2))
    gr.write_hdf5(path, step_tree([1, 1, 6]), overwrite=True)
    with pytest.raises(gr.InvalidStoreError, match="changed"):
        pickle.loads(blob)[0]


def test_make_data_loader_reads_window_batches(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "s.h5"), step_tree(LENGTHS, TERMINATED))
    src = WindowDataSource(gr.HDF5DataSource(path), length=2)
    batches = list(gr.make_data_loader(src, batch_size=4, shuffle=True, seed=1))
    assert len(batches) == len(src) // 4
    steps = np.concatenate([b["step"] for b in batches])
    assert steps.shape == (len(batches) * 4, 2)
    assert np.all(steps[:, 1] == steps[:, 0] + 1)


# -- properties ------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    length=st.integers(1, 6),
    stride=st.integers(1, 4),
    pad=st.booleans(),
    open_last=st.booleans(),
)
def test_windows_cover_each_valid_window_once_and_never_cross_episodes(
    lengths: list[int], length: int, stride: int, pad: bool, open_last: bool
) -> None:
    terminated = [i % 2 == 0 for i in range(len(lengths))]
    tree = step_tree(lengths, terminated, open_last=open_last)
    src = WindowDataSource(ArraySource(tree), length, stride, pad, keys=["step"])
    episode_id = np.repeat(np.arange(len(lengths)), lengths)
    ends = np.cumsum(lengths)
    n = len(src)
    batch = src.read_batch(np.arange(n))
    steps = batch["step"]
    mask = batch["mask"] if pad else np.ones((n, length), bool)
    assert steps.shape == (n, length)
    # Every window stays inside one episode.
    ep = episode_id[steps]
    assert np.all(ep == ep[:, :1])
    # Real steps are consecutive; padding repeats the episode's last step.
    first = steps[:, :1]
    expect = first + np.arange(length)
    last = ends[ep[:, 0]][:, None] - 1
    assert np.array_equal(mask, expect <= last)
    assert np.array_equal(steps, np.minimum(expect, last))
    # Every valid start appears exactly once, in order.
    want = [s[0] for s, _ in ref_windows(lengths, length, stride, pad)]
    assert first[:, 0].tolist() == want
    if not pad:
        assert mask.all()
