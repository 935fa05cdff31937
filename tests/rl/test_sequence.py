"""SequenceDataSource: per-key offsets, padding masks, the source contract, a per-step reference."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from conformance import SourceTests, assert_flat_equal, flat, slow_in_this_class
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rl_fixtures import ArraySource, step_tree, write_d4rl, write_minari_file

import grain_replay as gr
from grain_replay.rl import EpisodeIndex, SequenceDataSource

LENGTHS = [5, 1, 3, 9, 2, 7, 4]
TERMINATED = [True, False, True, True, False, True, False]
OFFSETS = {"obs/pixels": [-3, -2, -1, 0], "action": [0, 1, 2], "step": [-1, 2, 0]}

# -- the reference: every record built with per-step loops ----------------------------------


def ref_records(
    lengths: Sequence[int],
    offsets: dict[str, Sequence[int]],
    pad: str,
    open_last: bool = False,
) -> list[tuple[int, dict[str, tuple[list[int], list[bool]]]]]:
    """``(anchor, {key: (steps, is_pad)})`` of every record, by episode then anchor."""
    out = []
    start = 0
    for e, n in enumerate(lengths):
        end = start + n
        unfinished = open_last and e == len(lengths) - 1
        for anchor in range(start, end):
            record = {}
            keep = True
            for key, offs in offsets.items():
                steps, pads = [], []
                for o in offs:
                    p = anchor + o
                    inside = start <= p < end
                    if not inside and pad == "drop":
                        keep = False
                    if p >= end and unfinished:  # past the committed rows: not an anchor yet
                        keep = False
                    steps.append(min(max(p, start), end - 1))
                    pads.append(not inside)
                record[key] = (steps, pads)
            if keep:
                out.append((anchor, record))
        start = end
    return out


def ref_expect(
    tree: Any, lengths: Sequence[int], offsets: dict[str, Sequence[int]], pad: str,
    open_last: bool = False,
) -> tuple[Any, int]:  # fmt: skip
    """``(ids -> expected {key: array}, number of records)`` from the reference."""
    leaves = flat(tree)
    records = ref_records(lengths, offsets, pad, open_last)
    order = [k for k in leaves if k in offsets]

    def expect(ids: np.ndarray) -> dict[str, np.ndarray]:
        out = {}
        for key in order:
            rows = []
            masks = []
            for i in np.asarray(ids).tolist():
                steps, pads = records[i][1][key]
                values = [
                    np.zeros_like(leaves[key][s]) if p and pad == "zero" else leaves[key][s]
                    for s, p in zip(steps, pads)
                ]
                rows.append(np.stack(values))
                masks.append(pads)
            k = len(offsets[key])
            shape = (len(rows), k, *leaves[key].shape[1:])
            out[key] = np.stack(rows) if rows else np.zeros(shape, leaves[key].dtype)
            out[key + "_is_pad"] = np.array(masks, dtype=bool).reshape(len(rows), k)
        return out

    return expect, len(records)


# -- the contract ----------------------------------------------------------------------------


class _SequenceContract(SourceTests):
    pad = "edge"
    fmt = "hdf5"

    def make(self, tmp_path: Any, scale: int) -> SequenceDataSource:
        tmp_path.mkdir(parents=True, exist_ok=True)
        tree = step_tree(LENGTHS * scale, TERMINATED * scale)
        name = {"hdf5": "steps.h5", "npy": "steps", "zarr": "steps.zarr"}[self.fmt]
        path = gr.write(str(tmp_path / name), tree, format=self.fmt)
        return SequenceDataSource(gr.open_source(path), OFFSETS, pad=self.pad)

    # Three times the episodes: pad="drop" keeps few anchors, and the shared suite reads
    # records up to 12 and batches of 4 with a checkpoint after 3.
    @pytest.fixture
    def src(self, tmp_path: Any) -> SequenceDataSource:
        return self.make(tmp_path, 3)

    @pytest.fixture
    def expect(self) -> Any:
        lengths, terminated = LENGTHS * 3, TERMINATED * 3
        return ref_expect(step_tree(lengths, terminated), lengths, OFFSETS, self.pad)[0]

    def test_len_counts_reference_records(self, src: SequenceDataSource) -> None:
        assert len(src) == len(ref_records(LENGTHS * 3, OFFSETS, self.pad))


class TestSequenceEdgeHDF5(_SequenceContract):
    # Grain's worker loader (seconds of spawns): make test runs it on TestSequenceZeroNpy.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )


class TestSequenceZeroNpy(_SequenceContract):
    pad, fmt = "zero", "npy"


class TestSequenceDropZarr(_SequenceContract):
    # Grain's worker loader (seconds of spawns): make test runs it on TestSequenceZeroNpy.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    pad, fmt = "drop", "zarr"


# -- behaviour -------------------------------------------------------------------------------


def test_output_tree_has_time_axis_and_mask_beside_each_leaf() -> None:
    src = SequenceDataSource(ArraySource(step_tree(LENGTHS, TERMINATED)), OFFSETS)
    assert list(src.spec) == [
        "obs/pixels", "obs/pixels_is_pad", "action", "action_is_pad", "step", "step_is_pad",
    ]  # fmt: skip
    assert src.spec["obs/pixels"].shape == (4, 2, 2)
    assert src.spec["action_is_pad"].shape == (3,) and src.spec["action_is_pad"].dtype == bool
    batch = src.read_batch([0, 4, 4])
    assert set(batch) == {"obs", "action", "action_is_pad", "step", "step_is_pad"}
    assert set(batch["obs"]) == {"pixels", "pixels_is_pad"}
    assert batch["obs"]["pixels"].shape == (3, 4, 2, 2)
    assert batch["action"].shape == (3, 3) and batch["step_is_pad"].shape == (3, 3)


def test_edge_pads_both_ends_and_masks_them() -> None:
    src = SequenceDataSource(ArraySource(step_tree([4, 3])), {"step": [-2, 0, 2]})
    b = src.read_batch(np.arange(len(src)))
    assert b["step"].tolist() == [
        [0, 0, 2], [0, 1, 3], [0, 2, 3], [1, 3, 3], [4, 4, 6], [4, 5, 6], [4, 6, 6],
    ]  # fmt: skip
    assert b["step_is_pad"].tolist()[0] == [True, False, False]
    assert b["step_is_pad"].tolist()[3] == [False, False, True]
    assert b["step_is_pad"].tolist()[4] == [True, False, False]


def test_zero_pads_with_zeros_and_drop_keeps_inside_anchors_only() -> None:
    tree = step_tree([4, 3])
    zero = SequenceDataSource(ArraySource(tree), {"step": [-2, 0, 2], "obs/vec": [1]}, pad="zero")
    b = zero.read_batch([0, 3])
    assert b["step"].tolist() == [[0, 0, 2], [1, 3, 0]]
    assert b["obs"]["vec"][1].tolist() == [[0.0, 0.0, 0.0]] and b["obs"]["vec_is_pad"][1, 0]
    drop = SequenceDataSource(ArraySource(tree), {"step": [-2, 0, 2]}, pad="drop")
    assert len(drop) == 0  # no episode is 5 steps long
    drop = SequenceDataSource(ArraySource(step_tree([6, 2, 5])), {"step": [-2, 2]}, pad="drop")
    b = drop.read_batch(np.arange(len(drop)))
    assert b["step"].tolist() == [[0, 4], [1, 5], [8, 12]]
    assert not b["step_is_pad"].any()
    assert drop.anchor_steps([0, -1]).tolist() == [2, 10]


def test_positive_offsets_only_with_drop_start_at_the_first_step() -> None:
    src = SequenceDataSource(ArraySource(step_tree([5])), {"step": [1, 2]}, pad="drop")
    assert src.read_batch(np.arange(len(src)))["step"].tolist() == [[1, 2], [2, 3], [3, 4]]


def test_single_step_episodes_pad_every_other_offset() -> None:
    src = SequenceDataSource(ArraySource(step_tree([1, 1, 1])), {"step": [-1, 0, 1]})
    b = src.read_batch([0, 1, 2])
    assert b["step"].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert b["step_is_pad"].tolist() == [[True, False, True]] * 3


@pytest.mark.parametrize(
    ("offsets", "windows"),
    [
        ({"obs/pixels": [-1, 0], "action": range(4)}, {"obs/pixels", "action"}),
        ({"obs/pixels": [-2, 0], "action": [3, 1, 2]}, set()),  # not runs: read as rows
        ({"obs/pixels": [-1, 0], "action": [0, 2]}, {"obs/pixels"}),
    ],
)
def test_keys_not_named_are_not_read(
    tmp_path: Any, offsets: dict[str, Any], windows: set[str]
) -> None:
    path = gr.write_npy(str(tmp_path / "s"), step_tree(LENGTHS, TERMINATED))
    steps = gr.NpyDataSource(path)
    src = SequenceDataSource(steps, offsets)
    expect = flat(src.read_batch(np.arange(len(src))))  # also builds the episode index
    reads: list[tuple[str, str, int]] = []
    read_leaf, read_windows = steps.read_leaf, steps.read_windows

    def counting(key: str, rows: Any, **kw: Any) -> np.ndarray:
        reads.append(("rows", key, len(rows)))
        return read_leaf(key, rows, **kw)

    def counting_windows(key: str, starts: Any, length: int, **kw: Any) -> np.ndarray:
        reads.append(("windows", key, len(starts) * length))
        return read_windows(key, starts, length, **kw)

    steps.read_leaf = counting  # type: ignore[method-assign]
    steps.read_windows = counting_windows  # type: ignore[method-assign]
    assert_flat_equal(flat(src.read_batch(np.arange(len(src)))), expect)
    assert sorted(k for _, k, _ in reads) == ["action", "obs/pixels"]  # one read per named leaf
    # Each read asks for the B x K positions at once: runs of offsets as B windows of K rows.
    assert {k: n for _, k, n in reads} == {k: len(list(v)) * len(src) for k, v in offsets.items()}
    assert {k for how, k, _ in reads if how == "windows"} == windows


def test_compressed_store_decodes_each_chunk_once_per_batch(tmp_path: Any) -> None:
    path = gr.write_hdf5(
        str(tmp_path / "c.h5"), step_tree([40, 40]), compression="lzf", chunk_rows=4
    )
    view = SequenceDataSource(gr.HDF5DataSource(path), {"obs/pixels": [-3, -2, -1, 0]})
    view.read_batch([0])  # builds the episode index
    cache = view.source._handle.cache
    misses, hits = cache.misses, cache.hits
    # Rows 7..11, 8..11, 27..30, 47..50: chunks 1, 2, 6, 7, 11, 12 of the one leaf read.
    view.read_batch([10, 11, 30, 50])
    assert (cache.misses - misses, cache.hits - hits) == (6, 0)


def test_fallback_source_reads_one_batch_for_all_leaves() -> None:
    calls: list[int] = []

    class Counting(ArraySource):
        def read_batch(self, indices: Any) -> Any:
            calls.append(len(indices))
            return super().read_batch(indices)

    src = SequenceDataSource(Counting(step_tree([5, 5])), {"step": [-1, 0], "action": [-1, 0]})
    calls.clear()
    src.read_batch(np.arange(10))
    # The union of the rows (each step once, not 10 x 2 positions), read once for both
    # leaves, whose equal offsets share it.
    assert calls == [10]


def test_delta_timestamps_use_fps_and_lerobot_rounding() -> None:
    tree = step_tree([10])
    src = SequenceDataSource(
        ArraySource(tree), delta_timestamps={"step": [-0.1, 0.0, 1 / 30 * 4]}, fps=30
    )
    # -0.1 s at 30 fps is 3 frames; 4/30 s is 4 frames.
    assert src.offsets == {"step": (-3, 0, 4)}
    assert src.read_batch([5])["step"].tolist() == [[2, 5, 9]]
    assert src.delta_timestamps == {"step": (-0.1, 0.0, 4 / 30)} and src.fps == 30.0

    class WithFps(ArraySource):
        fps = 10

    src = SequenceDataSource(WithFps(tree), delta_timestamps={"step": [0.0, 0.2]})
    assert src.offsets == {"step": (0, 2)} and src.fps == 10.0
    assert "delta_timestamps" in repr(src) and "fps=10.0" in repr(src)
    # fps= wins over the source's.
    src = SequenceDataSource(WithFps(tree), delta_timestamps={"step": [0.2]}, fps=20)
    assert src.offsets == {"step": (4,)}


def test_delta_timestamp_within_tolerance_rounds_to_the_frame() -> None:
    src = SequenceDataSource(
        ArraySource(step_tree([10])), delta_timestamps={"step": [0.10004]}, fps=10
    )
    assert src.offsets == {"step": (1,)}


def test_explicit_episodes_override_flags_and_survive_pickling() -> None:
    episodes = EpisodeIndex.from_lengths([2, 4], [True, True])
    src = SequenceDataSource(ArraySource({"x": np.arange(6)}), {"x": [-1, 0]}, episodes=episodes)
    assert src.read_batch([2, 3])["x"].tolist() == [[2, 2], [2, 3]]
    clone = pickle.loads(pickle.dumps(src))
    assert clone.read_batch([2, 3])["x"].tolist() == [[2, 2], [2, 3]]


def test_sequence_steps_report_rows_and_pads() -> None:
    src = SequenceDataSource(ArraySource(step_tree([3])), {"step": [-1, 1]})
    steps, is_pad = src.sequence_steps([0, -1])["step"]
    assert steps.tolist() == [[0, 1], [1, 2]]
    assert is_pad.tolist() == [[True, False], [False, True]]


def test_nested_tuple_leaves_get_masks_beside_them() -> None:
    tree = {"obs": (np.arange(4.0), np.arange(4) * 10), "done": np.array([0, 0, 0, 1], bool)}
    src = SequenceDataSource(ArraySource(tree), {"obs/1": [-1, 0]}, done_key="done")
    b = src.read_batch([0, 3])
    assert b["obs"]["1"].tolist() == [[0, 0], [20, 30]]
    assert b["obs"]["1_is_pad"].tolist() == [[True, False], [False, False]]


def test_minari_steps_use_the_files_episodes(tmp_path: Any) -> None:
    steps = gr.MinariDataSource(write_minari_file(str(tmp_path / "m.hdf5"), [3, 2]))
    src = SequenceDataSource(steps, {"actions": [-1, 0, 1], "observations": [0]})
    assert len(src) == 5
    b = src.read_batch([0, 2, 3])
    assert b["actions"].tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]]  # actions hold the episode
    assert b["actions_is_pad"].tolist() == [
        [True, False, False], [False, False, True], [True, False, False],
    ]  # fmt: skip
    assert b["observations"][:, 0].tolist() == [0.0, 2.0, 0.0]


def test_d4rl_transitions_as_steps_read_the_union_once(tmp_path: Any) -> None:
    data = write_d4rl(str(tmp_path / "d.hdf5"), [4, 3], [True, False])
    steps = gr.D4RLDataSource(str(tmp_path / "d.hdf5"), keys=["observations", "actions"])
    src = SequenceDataSource(steps, {"observations": [-2, 0]}, pad="zero")
    assert len(src) == len(steps) == 7
    b = src.read_batch([0, 3, 5])
    obs = data["observations"]
    want = np.stack([[np.zeros(4), obs[0]], [obs[1], obs[3]], [np.zeros(4), obs[5]]])
    np.testing.assert_array_equal(b["observations"], want.astype(np.float32))
    assert "actions" not in b


# -- growing stores --------------------------------------------------------------------------


def _steps_block(lo: int, hi: int, ends: set[int]) -> dict[str, np.ndarray]:
    i = np.arange(lo, hi)
    return {
        "frame": (i[:, None, None] + np.zeros((1, 2, 2))).astype(np.uint8),
        "step": i.astype(np.int64),
        "terminated": np.isin(i, sorted(ends)),
    }


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_growing_store_refresh_adds_records_and_never_straddles_uncommitted(
    tmp_path: Any, fmt: str
) -> None:
    path = str(tmp_path / {"npy": "r", "hdf5": "r.h5", "zarr": "r.zarr"}[fmt])
    ends = {3, 9}  # episodes [0, 4), [4, 10), then an unfinished one
    offsets = {"step": [-1, 0, 1, 2]}
    with gr.ReplayWriter(path, format=fmt) as w:
        w.append(_steps_block(0, 7, ends))
        w.flush()
        view = SequenceDataSource(gr.open_source(path), offsets)
        # Episode 1 is open at step 6: anchors 4 (reads 4..6) only; 5 and 6 would read 7, 8.
        assert view.anchor_steps(np.arange(len(view))).tolist() == [0, 1, 2, 3, 4]
        first = flat(view.read_batch(np.arange(len(view))))
        w.append(_steps_block(7, 12, ends))
        assert view.refresh() == 5  # appended but not committed: nothing new
        w.flush()
        assert view.refresh() == 10 + 0  # episode 1 ended at 9; episode 2 ([10, 12)) is open
        assert view.anchor_steps(np.arange(len(view))).tolist() == list(range(10))
        again = flat(view.read_batch(np.arange(5)))
        assert_flat_equal(again, first)  # records seen before do not change
        w.append(_steps_block(12, 14, ends))
        w.flush()
        assert view.refresh() == 12  # anchors 10, 11 of the open episode now have their rows
        b = view.read_batch(np.arange(len(view)))
        assert b["step"][-1].tolist() == [10, 11, 12, 13]
        clone = pickle.loads(pickle.dumps(view))
        assert len(clone) == 12 and clone.read_batch([11])["step"].tolist() == [[10, 11, 12, 13]]


def test_refresh_with_explicit_episodes_needs_a_new_index(tmp_path: Any) -> None:
    path = str(tmp_path / "r")
    with gr.ReplayWriter(path, format="npy") as w:
        w.append({"x": np.arange(4)})
        w.flush()
        episodes = EpisodeIndex.from_lengths([4], [True])
        view = SequenceDataSource(gr.open_source(path), {"x": [0, 1]}, episodes=episodes)
        assert len(view) == 4
        w.append({"x": np.arange(4, 6)})
        w.flush()
        with pytest.raises(gr.InvalidStoreError, match=r"refresh\(episodes=\.\.\.\)"):
            view.refresh()
        assert view.refresh(EpisodeIndex.from_lengths([4, 2], [True, True])) == 6
        assert view.read_batch([5])["x"].tolist() == [[5, 5]]


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"offsets": {"obs": [0]}}, gr.InvalidArgumentError, r"'obs' is a group.*obs/vec"),
        ({"offsets": {"nope": [0]}}, gr.InvalidArgumentError, r"'nope' names no leaf.*'step'"),
        ({"offsets": {"step": []}}, gr.InvalidArgumentError, r"offsets\['step'\] is empty"),
        ({"offsets": {}}, gr.InvalidArgumentError, "offsets= is empty"),
        ({"offsets": {"step": [0, 1.5]}}, gr.ArgumentTypeError, r"1\.5.*not a whole number"),
        ({"offsets": {"step": [1.0]}}, gr.ArgumentTypeError, "delta_timestamps="),
        ({"offsets": {"step": 3}}, gr.ArgumentTypeError, r"not a list.*\[0\]"),
        ({"offsets": [0, 1]}, gr.ArgumentTypeError, "must be a mapping"),
        ({"delta_timestamps": {"step": [0.1]}}, gr.InvalidArgumentError, "no frame rate.*fps="),
        (
            {"delta_timestamps": {"step": [0.05]}, "fps": 10},
            gr.InvalidArgumentError,
            r"0\.05 s.*not a frame at fps=10\.0.*1/fps = 0\.1",
        ),
        ({"delta_timestamps": {"step": ["a"]}, "fps": 10}, gr.ArgumentTypeError, "seconds"),
        ({"delta_timestamps": {"step": [0.0]}, "fps": 0}, gr.InvalidArgumentError, "positive"),
        ({}, gr.InvalidArgumentError, "exactly one.*neither"),
        (
            {"offsets": {"step": [0]}, "delta_timestamps": {"step": [0.0]}},
            gr.InvalidArgumentError,
            "exactly one.*both",
        ),
        ({"offsets": {"step": [0]}, "pad": "wrap"}, gr.InvalidArgumentError, "'edge', 'zero'"),
    ],
)
def test_bad_arguments_raise_with_the_fix(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        SequenceDataSource(ArraySource(step_tree([3, 2])), **kwargs)


def test_errors_subclass_builtins() -> None:
    assert issubclass(gr.InvalidArgumentError, ValueError)
    assert issubclass(gr.ArgumentTypeError, TypeError)
    assert issubclass(gr.ArgumentTypeError, gr.GrainReplayError)


def test_mask_name_clash_raises() -> None:
    tree = {**step_tree([3]), "step_is_pad": np.zeros(3, bool)}
    with pytest.raises(gr.InvalidArgumentError, match="'step_is_pad' twice"):
        SequenceDataSource(ArraySource(tree), {"step": [0], "step_is_pad": [0]})
    # Not named, the leaf is not read and does not clash.
    assert "step_is_pad" in SequenceDataSource(ArraySource(tree), {"step": [0]}).spec


def test_single_unnamed_array_store_raises_with_fix() -> None:
    episodes = EpisodeIndex.from_lengths([3], [True])
    with pytest.raises(gr.InvalidStoreError, match=r"single unnamed array.*dict"):
        SequenceDataSource(ArraySource(np.arange(3)), {"": [0]}, episodes=episodes)


def test_missing_flags_raise_naming_done_key() -> None:
    with pytest.raises(gr.InvalidStoreError, match="done_key="):
        SequenceDataSource(ArraySource({"x": np.arange(6)}), {"x": [0]})


# -- pipeline ------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_make_data_loader_and_sharded_device_put_carry_sequences_and_masks(
    tmp_path: Any, workers: int
) -> None:
    import jax

    path = gr.write_npy(str(tmp_path / "s"), step_tree(LENGTHS * 4, TERMINATED * 4))
    src = SequenceDataSource(gr.NpyDataSource(path), {"step": [-1, 0, 1], "obs/pixels": [-1, 0]})
    expect, n = ref_expect(step_tree(LENGTHS * 4, TERMINATED * 4), LENGTHS * 4, src.offsets, "edge")
    batch_size = 8
    loader = gr.make_data_loader(src, batch_size=batch_size, seed=3, worker_count=workers)
    seen = []
    for batch in gr.sharded_device_put(loader):
        assert isinstance(batch["step"], jax.Array)
        assert batch["step"].shape == (batch_size, 3)
        assert batch["obs"]["pixels_is_pad"].shape == (batch_size, 2)
        got = flat(jax.tree.map(np.asarray, batch))
        anchors = got["step"][:, 1]
        want = expect(np.searchsorted(src.anchor_steps(np.arange(n)), anchors))
        # Without jax_enable_x64, int64 leaves arrive as int32.
        assert_flat_equal({k: v.astype(want[k].dtype) for k, v in got.items()}, want)
        seen.extend(anchors.tolist())
    assert len(seen) == (n // batch_size) * batch_size and len(set(seen)) == len(seen)


# -- properties against the reference ------------------------------------------------------

offset_lists = st.lists(st.integers(-6, 6), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=10),
    terminated=st.lists(st.booleans(), min_size=10, max_size=10),
    open_last=st.booleans(),
    pad=st.sampled_from(["edge", "zero", "drop"]),
    offsets=st.dictionaries(
        st.sampled_from(["step", "obs/vec", "obs/pixels", "reward"]), offset_lists, min_size=1
    ),
    data=st.data(),
)
def test_records_match_the_per_step_reference(
    lengths: list[int],
    terminated: list[bool],
    open_last: bool,
    pad: str,
    offsets: dict[str, list[int]],
    data: st.DataObject,
) -> None:
    tree = step_tree(lengths, terminated[: len(lengths)], open_last=open_last)
    src = SequenceDataSource(ArraySource(tree), offsets, pad=pad)
    expect, n = ref_expect(tree, lengths, offsets, pad, open_last)
    assert len(src) == n
    refs = ref_records(lengths, offsets, pad, open_last)
    assert src.anchor_steps(np.arange(n)).tolist() == [a for a, _ in refs]
    ids = np.arange(n)
    if n:
        more = data.draw(st.lists(st.integers(-n, n - 1), max_size=20))
        ids = np.concatenate([ids, np.array(more, dtype=np.int64)])
    want = expect(np.where(ids < 0, ids + n, ids))
    assert_flat_equal(flat(src.read_batch(ids)), want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    open_last=st.booleans(),
    pad=st.sampled_from(["edge", "zero", "drop"]),
    offsets=st.dictionaries(
        st.sampled_from(["step", "obs/vec", "obs/pixels", "reward"]), offset_lists, min_size=1
    ),
)
def test_store_records_match_the_per_step_reference(
    tmp_path_factory: Any,
    lengths: list[int],
    open_last: bool,
    pad: str,
    offsets: dict[str, list[int]],
) -> None:
    # Through a grain_replay source: one read_leaf of the B x K rows per leaf.
    tree = step_tree(lengths, [i % 3 == 0 for i in range(len(lengths))], open_last=open_last)
    path = gr.write_npy(str(tmp_path_factory.mktemp("seq") / "s"), tree)
    src = SequenceDataSource(gr.NpyDataSource(path), offsets, pad=pad, cache=False)
    expect, n = ref_expect(tree, lengths, offsets, pad, open_last)
    assert len(src) == n
    ids = np.concatenate([np.arange(n), np.arange(n)[::-2]]).astype(np.int64)
    assert_flat_equal(flat(src.read_batch(ids)), expect(ids))


run_lists = st.builds(lambda lo, k: list(range(lo, lo + k)), st.integers(-8, 3), st.integers(1, 10))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    open_last=st.booleans(),
    pad=st.sampled_from(["edge", "zero", "drop"]),
    offsets=st.dictionaries(
        st.sampled_from(["step", "obs/vec", "obs/pixels", "reward"]),
        st.one_of(run_lists, offset_lists),
        min_size=1,
    ),
)
def test_windowed_reads_match_the_per_step_reference(
    tmp_path_factory: Any,
    lengths: list[int],
    open_last: bool,
    pad: str,
    offsets: dict[str, list[int]],
) -> None:
    # Runs of offsets are read as one window per anchor, fixed up at episode and store ends.
    tree = step_tree(lengths, [i % 2 == 0 for i in range(len(lengths))], open_last=open_last)
    path = gr.write_npy(str(tmp_path_factory.mktemp("win") / "s"), tree)
    src = SequenceDataSource(gr.NpyDataSource(path), offsets, pad=pad, cache=False)
    expect, n = ref_expect(tree, lengths, offsets, pad, open_last)
    assert len(src) == n
    ids = np.concatenate([np.arange(n), np.arange(n)[::-3]]).astype(np.int64)
    got = flat(src.read_batch(ids))
    assert_flat_equal(got, expect(ids))
    arrays = [got[k] for k in offsets] + [got[k + "_is_pad"] for k in offsets]
    for i, a in enumerate(arrays):  # each leaf owns its values and its mask
        assert a.flags.writeable and a.flags.c_contiguous
        assert not any(np.shares_memory(a, b) for b in arrays[i + 1 :])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    cuts=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    pad=st.sampled_from(["edge", "zero", "drop"]),
    offsets=st.lists(st.integers(-3, 3), min_size=1, max_size=4),
)
def test_growing_store_matches_the_reference_at_every_commit(
    tmp_path_factory: Any, lengths: list[int], cuts: list[int], pad: str, offsets: list[int]
) -> None:
    total = sum(lengths)
    full = {
        "step": np.arange(total, dtype=np.int64),
        "terminated": np.isin(np.arange(total), np.cumsum(lengths) - 1),
    }
    path = str(tmp_path_factory.mktemp("grow") / "r")
    commits = sorted({min(c, total) for c in cuts} | {total})
    done = 0
    previous: dict[str, np.ndarray] | None = None
    view = None
    with gr.ReplayWriter(path, format="npy") as w:
        for n in commits:
            w.append({k: v[done:n] for k, v in full.items()})
            w.flush()
            done = n
            if view is None:
                view = SequenceDataSource(gr.open_source(path), {"step": offsets}, pad=pad)
            else:
                view.refresh()
            # The committed prefix: whole episodes, then the open one.
            ends = [e for e in np.cumsum(lengths).tolist() if e <= n]
            prefix = np.diff([0, *ends]).tolist()
            open_last = n > (ends[-1] if ends else 0)
            if open_last:
                prefix.append(n - (ends[-1] if ends else 0))
            tree = {k: v[:n] for k, v in full.items()}
            expect, count = ref_expect(tree, prefix, {"step": offsets}, pad, open_last)
            assert len(view) == count
            got = flat(view.read_batch(np.arange(count)))
            assert_flat_equal(got, expect(np.arange(count)))
            assert (got["step"] < n).all()
            if previous is not None:  # records already seen never change
                m = len(previous["step"])
                assert_flat_equal({k: v[:m] for k, v in got.items()}, previous)
            previous = got


def test_anchor_codes_by_table_and_by_search_agree_and_mark_the_near_anchors(
    monkeypatch: Any,
) -> None:
    # The fix-up of a windowed batch touches only anchors of a nonzero code: every other one
    # must read only steps of its own episode and of the store. The per-step table and the
    # binary search must give the same codes (which fix the fix-up).
    from grain_replay.rl import _sequence_plan

    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 12, rng.integers(1, 8))
        index = EpisodeIndex(np.cumsum(lengths), np.ones(len(lengths), bool), False)
        lo, hi = -int(rng.integers(0, 6)), int(rng.integers(0, 6))
        group = _sequence_plan.OffsetGroup(np.arange(lo, hi + 1, dtype=np.int64), ("x",))
        group.windowed = True
        t = rng.permutation(index.num_steps)
        by_table = _sequence_plan.FixTables([group], index)
        assert by_table.step_codes is not None
        with monkeypatch.context() as m:
            m.setattr(_sequence_plan, "NEAR_TABLE_STEPS", 0)
            by_search = _sequence_plan.FixTables([group], index)
        assert by_search.step_codes is None
        (codes, near), (codes2, near2) = by_table.codes(t), by_search.codes(t)
        np.testing.assert_array_equal(codes, codes2)
        np.testing.assert_array_equal(near, near2)
        e = np.searchsorted(index.ends, t, side="right")
        n = index.num_steps
        leaves = ((t + lo) < index.starts[e]) | ((t + hi) >= index.ends[e])
        np.testing.assert_array_equal(near, np.flatnonzero(leaves))
        # The tables read each near anchor's clipped steps from inside its window.
        k = len(group.offsets)
        if n < k:  # no window fits: the group reads rows
            assert by_table.tables == [None]
            continue
        at, pad, _, _ = by_table.tables[0]
        start = np.clip(t + lo, 0, n - k)
        want = np.clip(
            t[:, None] + group.offsets, index.starts[e][:, None], index.ends[e][:, None] - 1
        )
        assert ((at[codes] >= 0) & (at[codes] < k)).all()
        np.testing.assert_array_equal(start[:, None] + at[codes], want)
        np.testing.assert_array_equal(pad[codes], want != t[:, None] + group.offsets)


@pytest.mark.parametrize("pad", ["edge", "zero"])
def test_windowed_batch_fixes_up_anchors_at_both_ends_of_the_store(
    tmp_path: Any, pad: str, monkeypatch: Any
) -> None:
    # Windows that would start before row 0 or end past the last row start inside the store;
    # the anchors' steps are then moved inside the window read. Both ways to find the anchors.
    from grain_replay.rl import _sequence_plan

    lengths, terminated = [3, 20, 2], [True, True, True]
    tree = step_tree(lengths, terminated)
    path = gr.write_npy(str(tmp_path / "s"), tree)
    offsets = {"obs/vec": [-4, -3, -2, -1, 0, 1], "action": list(range(8)), "step": [0]}
    expect, n = ref_expect(tree, lengths, offsets, pad)
    ids = np.array([0, n - 1, 1, n - 2, 5, 2, 3, n - 3, 0], np.int64)
    for table in (True, False):
        if not table:
            monkeypatch.setattr(_sequence_plan, "NEAR_TABLE_STEPS", 0)
        src = SequenceDataSource(gr.NpyDataSource(path), offsets, pad=pad, cache=False)
        assert src._windowed
        assert_flat_equal(flat(src.read_batch(ids)), expect(ids))
        assert_flat_equal(flat(src.read_batch(ids[4:5])), expect(ids[4:5]))  # none near


def test_int64_array_indices_are_checked_as_strictly_as_lists(tmp_path: Any) -> None:
    # An int64 array in range skips most of the check (samplers draw such arrays); negatives
    # and out-of-range indices in such an array still get the full check.
    lengths, terminated = [4, 6, 3], [True, False, True]
    tree = step_tree(lengths, terminated)
    src = SequenceDataSource(
        gr.NpyDataSource(gr.write_npy(str(tmp_path / "s"), tree)), {"step": [-1, 0, 1]}
    )
    n = len(src)
    fast = flat(src.read_batch(np.array([n - 1, 0, 2], np.int64)))
    assert_flat_equal(fast, flat(src.read_batch([n - 1, 0, 2])))
    assert_flat_equal(
        flat(src.read_batch(np.array([-1, 0, -n], np.int64))), flat(src.read_batch([n - 1, 0, 0]))
    )
    for bad in (n, n + 3, -n - 1):
        with pytest.raises(gr.RecordIndexError, match=rf"{bad}.*{n}"):
            src.read_batch(np.array([0, bad], np.int64))
    assert flat(src.read_batch(np.zeros(0, np.int64)))["step"].shape == (0, 3)


@pytest.mark.parametrize("pad", ["edge", "zero"])
def test_windows_whose_fix_up_tables_would_be_large_are_read_as_rows(
    tmp_path: Any, pad: str, monkeypatch: Any
) -> None:
    from grain_replay.rl import _sequence_plan

    lengths, terminated = [3, 20, 2, 7], [True, True, False, True]
    tree = step_tree(lengths, terminated)
    path = gr.write_npy(str(tmp_path / "s"), tree)
    offsets = {"obs/vec": [-4, -3, -2, -1, 0], "action": list(range(6))}
    expect, n = ref_expect(tree, lengths, offsets, pad)
    ids = np.concatenate([np.arange(n), np.arange(n)[::-2]]).astype(np.int64)
    windowed = SequenceDataSource(gr.NpyDataSource(path), offsets, pad=pad, cache=False)
    assert windowed._windowed
    # (4 + 1) * (5 + 1) codes of the episodes' ends, 4 + 5 of the store's; 5 + 6 offsets.
    assert _sequence_plan.fix_entries(windowed._groups) == (30 + 9) * 11
    monkeypatch.setattr(_sequence_plan, "FIX_TABLE_ENTRIES", (30 + 9) * 11 - 1)
    rows = SequenceDataSource(gr.NpyDataSource(path), offsets, pad=pad, cache=False)
    assert not rows._windowed
    for src in (windowed, rows):
        assert_flat_equal(flat(src.read_batch(ids)), expect(ids))
