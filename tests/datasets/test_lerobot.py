"""LeRobotDataSource on small datasets written to LeRobot's published layout (pyarrow + PyAV)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("av")

import grain

import grain_replay as gr
from grain_replay.errors import (
    ArgumentTypeError,
    FrameTimestampError,
    InvalidArgumentError,
    InvalidStoreError,
    StoreNotFoundError,
    UnknownLeafError,
)
from tests.helpers.lerobot_fixture import (
    TASKS,
    VIDEO_PATH,
    decode_all,
    frame_image,
    rewrite_as_v21,
    write_dataset,
)

CAM = "observation.images.top"
CAM2 = "observation.images.wrist"
LENGTHS = (5, 7, 4, 6)
NUMERIC = [
    "observation.state", "action", "next.reward", "timestamp", "frame_index", "episode_index",
    "index", "task_index",
]  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: Any) -> tuple[str, dict[str, Any]]:
    """Two data files and two video files per camera (episodes 0-1 and 2-3)."""
    root = str(tmp_path_factory.mktemp("lerobot") / "toy")
    expected = write_dataset(
        root, LENGTHS, cameras={CAM: (32, 48), CAM2: (16, 16)}, episodes_per_file=2
    )
    return root, expected


def _copy(dataset: tuple[str, dict[str, Any]], tmp_path: Any) -> str:
    root = str(tmp_path / "copy")
    shutil.copytree(dataset[0], root)
    return root


def _reference_frames(root: str, cam: str) -> np.ndarray:
    """Every frame of the camera by a plain sequential decode of each file, in frame order."""
    out = []
    for f in range(2):
        out += [img for _, img in decode_all(os.path.join(root, VIDEO_PATH.format(
            video_key=cam, chunk_index=0, file_index=f)))]  # fmt: skip
    return np.stack(out)


def _info(root: str) -> dict[str, Any]:
    with open(os.path.join(root, "meta", "info.json")) as f:
        return dict(json.load(f))


def _write_info(root: str, info: dict[str, Any]) -> None:
    with open(os.path.join(root, "meta", "info.json"), "w") as f:
        json.dump(info, f)


# -- values -------------------------------------------------------------------------


def test_spec_is_lerobot_features_with_cameras_as_uint8_hwc(dataset: Any) -> None:
    src = gr.LeRobotDataSource(dataset[0])
    assert src.keys == [CAM, CAM2, *NUMERIC]
    assert src.spec[CAM] == gr.LeafSpec(np.dtype(np.uint8), (32, 48, 3))
    assert src.spec["observation.state"] == gr.LeafSpec(np.dtype(np.float32), (3,))
    assert src.spec["next.reward"] == gr.LeafSpec(np.dtype(np.float32), ())
    assert src.spec["task_index"] == gr.LeafSpec(np.dtype(np.int64), ())
    assert len(src) == sum(LENGTHS)
    assert src.fps == 10 and src.version == "v3.0"
    assert isinstance(src, grain.sources.RandomAccessDataSource)


def test_numeric_columns_match_written_values_with_duplicates_and_negatives(dataset: Any) -> None:
    root, expected = dataset
    src = gr.LeRobotDataSource(root, keys=NUMERIC)
    n = len(src)
    idx = np.array([3, 0, n - 1, 7, 7, -2, 12, 5])
    batch = src.read_batch(idx)
    for key in NUMERIC:
        want = expected["columns"][key][idx]
        assert batch[key].dtype == want.dtype, key
        np.testing.assert_array_equal(batch[key], want, err_msg=key)
    for i in (0, 6, n - 1, -1):
        rec = src[i]
        for key in NUMERIC:
            np.testing.assert_array_equal(rec[key], expected["columns"][key][i])


def test_row_group_blocks_give_the_same_values(dataset: Any) -> None:
    root, expected = dataset
    # A tiny cache cuts every data file into its row groups (one per episode).
    src = gr.LeRobotDataSource(root, keys=NUMERIC, cache_bytes=64)
    idx = np.arange(len(src))[::-1]
    batch = src.read_batch(idx)
    for key in NUMERIC:
        np.testing.assert_array_equal(batch[key], expected["columns"][key][idx])
    assert len(src._get_handle().readers["action"]._segments.parts) == len(LENGTHS)


def test_camera_frames_are_the_decoded_video_frames_at_each_timestamp(dataset: Any) -> None:
    root, expected = dataset
    src = gr.LeRobotDataSource(root)
    idx = np.array([9, 0, 21, 4, 5, 12, 12, 16, 11])
    batch = src.read_batch(idx)
    for cam in (CAM, CAM2):
        ref = _reference_frames(root, cam)
        np.testing.assert_array_equal(batch[cam], ref[idx])
        # ... and they are the frames written there (lossy codec: near, not equal).
        drift = np.abs(batch[cam].astype(int) - expected["images"][cam][idx].astype(int))
        assert drift.max() <= 8, drift.max()
        # Neighbouring frames differ by far more than the codec's error.
        assert abs(int(frame_image(1, 1, 1)[0, 0, 0]) - int(frame_image(2, 1, 1)[0, 0, 0])) > 40


def test_random_batches_equal_one_by_one_reads(dataset: Any) -> None:
    root, _ = dataset
    src = gr.LeRobotDataSource(root)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(src), 40)
    batch = src.read_batch(idx)
    one = gr.LeRobotDataSource(root)
    for j, i in enumerate(idx):
        rec = one[int(i)]
        for k in src.keys:
            np.testing.assert_array_equal(batch[k][j], rec[k])


def test_threads_reading_at_once_get_the_right_frames(dataset: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    root, expected = dataset
    src = gr.LeRobotDataSource(root, frame_cache_bytes=0)
    refs = {cam: _reference_frames(root, cam) for cam in (CAM, CAM2)}
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, len(src), 9) for _ in range(24)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(src.read_batch, batches))
    for idx, got in zip(batches, results):
        for cam, ref in refs.items():
            np.testing.assert_array_equal(got[cam], ref[idx])
        np.testing.assert_array_equal(got["action"], expected["columns"]["action"][idx])


def test_frame_cache_serves_repeated_frames_without_decoding(dataset: Any) -> None:
    src = gr.LeRobotDataSource(dataset[0], keys=[CAM])
    first = src.read_batch([1, 2, 3])
    cache = src._get_handle().frame_cache
    misses = cache.misses
    again = src.read_batch([3, 2, 1])
    assert cache.misses == misses
    np.testing.assert_array_equal(again[CAM], first[CAM][::-1])


class _CountingContainer:
    """Wraps a PyAV container and counts its seeks."""

    def __init__(self, container: Any):
        self.container = container
        self.seeks = 0

    def seek(self, *args: Any, **kw: Any) -> None:
        self.seeks += 1
        self.container.seek(*args, **kw)

    def decode(self, *args: Any) -> Any:
        return self.container.decode(*args)

    def close(self) -> None:
        self.container.close()


def test_frames_of_a_file_decode_in_one_forward_pass(dataset: Any) -> None:
    root, _ = dataset
    src = gr.LeRobotDataSource(root, keys=[CAM], frame_cache_bytes=0)
    videos = src._get_handle().videos
    rel = VIDEO_PATH.format(video_key=CAM, chunk_index=0, file_index=0)
    video = videos.get(rel, CAM, 0)
    counter = _CountingContainer(video.container)
    video.container = counter
    ref = _reference_frames(root, CAM)
    # Episodes 0-1 (frames 0-11) share file 0: consecutive frames, shuffled, one seek.
    idx = np.array([7, 2, 11, 0, 5, 3, 9, 1, 10, 4, 8, 6])
    np.testing.assert_array_equal(src.read_batch(idx)[CAM], ref[idx])
    assert counter.seeks == 1
    # Frames a keyframe interval apart or more are reached by seeking, not by decoding on.
    counter.seeks = 0
    np.testing.assert_array_equal(src.read_batch([0, 11])[CAM], ref[[0, 11]])
    assert counter.seeks == 2


def test_tasks_stats_and_episodes(dataset: Any) -> None:
    root, expected = dataset
    src = gr.LeRobotDataSource(root)
    assert src.tasks == TASKS
    task_index = src.read_batch([0, 5])["task_index"]
    assert [src.tasks[t] for t in task_index] == [TASKS[0], TASKS[1]]
    stats = src.stats
    np.testing.assert_allclose(
        stats["action"]["mean"], expected["columns"]["action"].mean(0), rtol=1e-6
    )
    assert isinstance(stats["observation.state"]["std"], np.ndarray)
    np.testing.assert_array_equal(src.episodes.lengths, LENGTHS)
    assert not src.episodes.terminated.any()


def test_keys_leave_cameras_undecoded(dataset: Any, tmp_path: Any) -> None:
    root = _copy(dataset, tmp_path)
    shutil.rmtree(os.path.join(root, "videos"))
    src = gr.LeRobotDataSource(root, keys=["action", "timestamp"])
    assert src.keys == ["action", "timestamp"]
    assert src.read_batch([0, 1])["action"].shape == (2, 2)


def test_v21_layout_reads_the_same(dataset: Any, tmp_path: Any) -> None:
    root = str(tmp_path / "v21")
    expected = write_dataset(root, (4, 3), cameras={CAM: (16, 16)})
    rewrite_as_v21(root)
    src = gr.LeRobotDataSource(root)
    assert src.version == "v2.1"
    batch = src.read_batch(np.arange(len(src)))
    for key in NUMERIC:
        np.testing.assert_array_equal(batch[key], expected["columns"][key], err_msg=key)
    ref = [img for e in range(2) for _, img in decode_all(os.path.join(
        root, f"videos/chunk-000/{CAM}/episode_{e:06d}.mp4"))]  # fmt: skip
    np.testing.assert_array_equal(batch[CAM], np.stack(ref))
    assert src.tasks == TASKS


# -- delta_timestamps ----------------------------------------------------------------

DELTA = {"action": [-0.2, -0.1, 0.0, 0.1], CAM: [-0.1, 0.0, 0.3], "observation.state": [0.0, 0.5]}


def _lerobot_rows(i: int, steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """LeRobot's _get_query_indices: rows clamped to the episode, and the padding mask."""
    starts = np.r_[0, np.cumsum(LENGTHS)[:-1]]
    e = int(np.searchsorted(np.cumsum(LENGTHS), i, side="right"))
    lo, hi = starts[e], starts[e] + LENGTHS[e]
    pos = np.array([i + k for k in steps])
    return np.clip(pos, lo, hi - 1), (pos < lo) | (pos >= hi)


def test_delta_timestamps_match_lerobot_getitem_semantics(dataset: Any) -> None:
    root, expected = dataset
    src = gr.LeRobotDataSource(root, delta_timestamps=DELTA)
    assert src.spec["action"] == gr.LeafSpec(np.dtype(np.float32), (4, 2))
    assert src.spec["action_is_pad"] == gr.LeafSpec(np.dtype(bool), (4,))
    assert src.spec[CAM] == gr.LeafSpec(np.dtype(np.uint8), (3, 32, 48, 3))
    assert src.spec[CAM2] == gr.LeafSpec(np.dtype(np.uint8), (16, 16, 3))  # not listed: a frame
    assert len(src) == sum(LENGTHS)
    frames = _reference_frames(root, CAM)
    idx = np.array([0, 4, 5, 11, 12, 21, 3])
    batch = src.read_batch(idx)
    for j, i in enumerate(idx):
        for key, seconds in DELTA.items():
            rows, pad = _lerobot_rows(int(i), [round(d * 10) for d in seconds])
            want = frames[rows] if key == CAM else expected["columns"][key][rows]
            np.testing.assert_array_equal(batch[key][j], want, err_msg=f"{key} @ {i}")
            np.testing.assert_array_equal(batch[key + "_is_pad"][j], pad)
        np.testing.assert_array_equal(
            batch["next.reward"][j], expected["columns"]["next.reward"][i]
        )
    rec = src[5]
    for key in src.keys:
        np.testing.assert_array_equal(rec[key], batch[key][2], err_msg=key)
    assert src.frames.keys == [CAM, CAM2, *NUMERIC]


def test_delta_timestamps_read_windows_are_the_records_of_each_window(dataset: Any) -> None:
    src = gr.LeRobotDataSource(dataset[0], delta_timestamps=DELTA)
    starts = [0, 4, 11]
    got = src.read_windows("action", starts, 3)
    assert got.shape == (3, 3, *src.spec["action"].shape)
    for j, s in enumerate(starts):
        np.testing.assert_array_equal(got[j], src.read_leaf("action", [s, s + 1, s + 2]))


def test_frame_source_is_a_step_source_for_the_sequence_view(dataset: Any) -> None:
    root, expected = dataset
    frames = gr.LeRobotDataSource(root)
    # fps and the episodes come from the frame source; pad="drop" keeps full windows only.
    seq = gr.SequenceDataSource(frames, delta_timestamps={"action": [-0.1, 0.0]}, pad="drop")
    assert len(seq) == sum(n - 1 for n in LENGTHS)
    b = seq.read_batch([0, 4])  # episode 0 anchors 1, then episode 1 anchor 1 (frame 6)
    np.testing.assert_array_equal(b["action"][0], expected["columns"]["action"][[0, 1]])
    np.testing.assert_array_equal(b["action"][1], expected["columns"]["action"][[5, 6]])


def test_delta_timestamps_stream_through_workers(dataset: Any) -> None:
    src = gr.LeRobotDataSource(dataset[0], delta_timestamps=DELTA)
    blob = pickle.dumps(src)
    assert len(blob) < 40_000 and repr(pickle.loads(blob)) == repr(src)
    loader = gr.make_data_loader(src, batch_size=4, shuffle=True, seed=1, worker_count=2)
    direct = gr.LeRobotDataSource(dataset[0], delta_timestamps=DELTA)
    count = 0
    for batch in loader:
        want = direct.read_batch(batch["index"])
        for k in src.keys:
            np.testing.assert_array_equal(batch[k], want[k], err_msg=k)
        count += len(batch["index"])
    assert count == (len(src) // 4) * 4


def test_delta_timestamps_off_the_frame_grid_or_unknown_are_refused(dataset: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=r"multiples of 1/10"):
        gr.LeRobotDataSource(dataset[0], delta_timestamps={"action": [0.0, 0.05]})
    with pytest.raises(InvalidArgumentError, match=r"observation\.nope"):
        gr.LeRobotDataSource(dataset[0], delta_timestamps={"observation.nope": [0.0]})
    for bad in ([0.0], {"action": "0.1"}, {"action": [None]}):
        with pytest.raises(ArgumentTypeError, match="lists of seconds"):
            gr.LeRobotDataSource(dataset[0], delta_timestamps=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="not features read"):
        gr.LeRobotDataSource(dataset[0], delta_timestamps={CAM: [0.0]}, keys=["action"])


def test_delta_timestamps_become_whole_frames_within_tolerance_s(dataset: Any) -> None:
    """Seconds become frames once, by this source's tolerance_s (not the view's 1e-4 s)."""
    root, expected = dataset
    near = {"action": [-0.1 + 3e-3, 0.0, 0.2 - 4e-3]}
    src = gr.LeRobotDataSource(root, delta_timestamps=near, tolerance_s=5e-3)
    assert src.delta_timestamps == near  # as given
    idx = np.array([0, 5, 13])
    got = src.read_batch(idx)["action"]
    for j, i in enumerate(idx):
        rows, _ = _lerobot_rows(int(i), [-1, 0, 2])
        np.testing.assert_array_equal(got[j], expected["columns"]["action"][rows])
    with pytest.raises(InvalidArgumentError, match=r"tolerance_s=0\.001.*multiples of 1/fps"):
        gr.LeRobotDataSource(root, delta_timestamps=near, tolerance_s=1e-3)


# -- the source contract ----------------------------------------------------------


def test_pickle_is_small_and_carries_no_handle(dataset: Any) -> None:
    src = gr.LeRobotDataSource(dataset[0])
    src.read_batch([0, 9])
    blob = pickle.dumps(src)
    assert len(blob) < 20_000
    clone = pickle.loads(blob)
    assert clone._handle is None and repr(clone) == repr(src)
    np.testing.assert_array_equal(clone.read_batch([9])[CAM], src.read_batch([9])[CAM])


def test_close_and_reopen(dataset: Any) -> None:
    with gr.LeRobotDataSource(dataset[0]) as src:
        a = src.read_batch([3])
    assert src._handle is None
    np.testing.assert_array_equal(src.read_batch([3])[CAM], a[CAM])


def test_loader_with_two_workers_and_device_put_equals_direct_reads(dataset: Any) -> None:
    src = gr.LeRobotDataSource(dataset[0])
    loader = gr.make_data_loader(src, batch_size=8, shuffle=True, seed=3, worker_count=2)
    direct = gr.LeRobotDataSource(dataset[0])
    seen = []
    for batch in gr.sharded_device_put(iter(loader)):
        idx = np.asarray(batch["index"])
        want = direct.read_batch(idx)
        for k in src.keys:
            np.testing.assert_array_equal(np.asarray(batch[k]), want[k], err_msg=k)
        seen.extend(idx.tolist())
    assert len(seen) == (len(src) // 8) * 8 and len(set(seen)) == len(seen)


# -- bad input ---------------------------------------------------------------------


def test_missing_dataset_names_the_fix(tmp_path: Any) -> None:
    with pytest.raises(StoreNotFoundError, match=r"meta/info\.json"):
        gr.LeRobotDataSource(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        gr.LeRobotDataSource(tmp_path / "nope")


def test_unsupported_version_names_the_conversion_script(dataset: Any, tmp_path: Any) -> None:
    root = _copy(dataset, tmp_path)
    info = _info(root)
    info["codebase_version"] = "v1.6"
    _write_info(root, info)
    with pytest.raises(InvalidStoreError, match=r"v1\.6.*convert_dataset_v21_to_v30"):
        gr.LeRobotDataSource(root)


def test_missing_video_names_file_camera_and_episode(dataset: Any, tmp_path: Any) -> None:
    root = _copy(dataset, tmp_path)
    gone = os.path.join(root, VIDEO_PATH.format(video_key=CAM2, chunk_index=0, file_index=1))
    os.remove(gone)
    src = gr.LeRobotDataSource(root)
    src.read_batch([0, 1])  # file 0 is there
    with pytest.raises(StoreNotFoundError) as e:
        src.read_batch([0, 14])
    assert gone in str(e.value) and CAM2 in str(e.value) and "episode 2" in str(e.value)


def test_timestamp_without_frame_names_file_camera_and_episode(dataset: Any, tmp_path: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = _copy(dataset, tmp_path)
    path = os.path.join(root, "meta/episodes/chunk-000/file-000.parquet")
    table = pq.read_table(path)
    col = f"videos/{CAM}/from_timestamp"
    shifted = [t + (0.05 if e == 1 else 0.0) for e, t in enumerate(table[col].to_pylist())]
    table = table.set_column(table.schema.get_field_index(col), col, pa.array(shifted))
    pq.write_table(table, path)
    src = gr.LeRobotDataSource(root)
    src.read_batch([0, 4])  # episode 0 is fine
    with pytest.raises(FrameTimestampError) as e:
        src.read_batch([6])
    msg = str(e.value)
    assert CAM in msg and "episode 1" in msg and "file-000.mp4" in msg and "tolerance_s" in msg
    assert isinstance(e.value, ValueError)
    # A tolerance wider than the shift takes the nearest frame instead.
    assert gr.LeRobotDataSource(root, tolerance_s=0.06).read_batch([6])[CAM].shape[0] == 1


def test_codec_ffmpeg_lacks_is_named(dataset: Any, tmp_path: Any) -> None:
    root = _copy(dataset, tmp_path)
    path = os.path.join(root, VIDEO_PATH.format(video_key=CAM2, chunk_index=0, file_index=0))
    with open(path, "rb") as f:
        data = f.read()
    assert data.count(b"avc1") >= 1
    with open(path, "wb") as f:
        f.write(data.replace(b"avc1", b"zq9x"))  # a sample entry no FFmpeg decoder knows
    src = gr.LeRobotDataSource(root, keys=[CAM2])
    with pytest.raises(InvalidStoreError) as e:
        src.read_batch([0])
    msg = str(e.value)
    assert path in msg and CAM2 in msg and "episode 0" in msg and "no decoder" in msg


IMG = "observation.images.png"


@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory: Any) -> tuple[str, dict[str, Any]]:
    """Image features (PNG bytes embedded in parquet, use_videos=False) in two data files."""
    root = str(tmp_path_factory.mktemp("lerobot_img") / "toy")
    return root, write_dataset(root, (4, 5, 3), image_cameras={IMG: (12, 20)}, episodes_per_file=2)


def test_image_features_decode_to_the_written_pixels(image_dataset: Any) -> None:
    root, expected = image_dataset
    for kw in ({}, {"cache_bytes": 64}):  # whole files, then row groups
        src = gr.LeRobotDataSource(root, **kw)
        assert src.spec[IMG] == gr.LeafSpec(np.dtype(np.uint8), (12, 20, 3))
        assert src.camera_keys == [IMG]
        idx = np.array([11, 0, 4, 4, 8, 3])
        batch = src.read_batch(idx)
        np.testing.assert_array_equal(batch[IMG], expected["images"][IMG][idx])  # PNG: lossless
        np.testing.assert_array_equal(batch["action"], expected["columns"]["action"][idx])


def test_image_features_with_delta_timestamps(image_dataset: Any) -> None:
    root, expected = image_dataset
    src = gr.LeRobotDataSource(root, delta_timestamps={IMG: [-0.1, 0.0, 0.1]})
    batch = src.read_batch([0, 4, 8])
    imgs = expected["images"][IMG]
    np.testing.assert_array_equal(batch[IMG][0], imgs[[0, 0, 1]])
    np.testing.assert_array_equal(batch[IMG][1], imgs[[4, 4, 5]])
    np.testing.assert_array_equal(batch[IMG][2], imgs[[7, 8, 8]])
    np.testing.assert_array_equal(
        batch[IMG + "_is_pad"], [[True, False, False], [True, False, False], [False, False, True]]
    )


def test_image_without_embedded_bytes_names_file_feature_and_frame(
    image_dataset: Any, tmp_path: Any
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = str(tmp_path / "copy")
    shutil.copytree(image_dataset[0], root)
    path = os.path.join(root, "data/chunk-000/file-001.parquet")
    table = pq.read_table(path)
    n = table.num_rows
    paths_only = pa.StructArray.from_arrays(
        [pa.array([None] * n, pa.binary()), pa.array(["frame.png"] * n)], names=["bytes", "path"]
    )
    table = table.set_column(table.schema.get_field_index(IMG), IMG, paths_only)
    pq.write_table(table, path)
    src = gr.LeRobotDataSource(root)
    src.read_batch([0, 8])  # file 0 is fine
    with pytest.raises(InvalidStoreError) as e:
        src.read_batch([10])
    msg = str(e.value)
    assert path in msg and IMG in msg and "frame 10" in msg and "embed" in msg


def test_episode_ranges_that_do_not_tile_the_frames_are_refused(
    dataset: Any, tmp_path: Any
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = _copy(dataset, tmp_path)
    path = os.path.join(root, "meta/episodes/chunk-000/file-000.parquet")
    table = pq.read_table(path)
    col = "dataset_to_index"
    bad = [v - (1 if e == 3 else 0) for e, v in enumerate(table[col].to_pylist())]
    pq.write_table(table.set_column(table.schema.get_field_index(col), col, pa.array(bad)), path)
    with pytest.raises(InvalidStoreError, match=r"do not\s+tile"):
        gr.LeRobotDataSource(root)


def test_bad_arguments(dataset: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="tolerance_s"):
        gr.LeRobotDataSource(dataset[0], tolerance_s=0)
    with pytest.raises(InvalidArgumentError, match="cache_bytes"):
        gr.LeRobotDataSource(dataset[0], cache_bytes=-1)
    with pytest.raises(UnknownLeafError, match="Leaves"):
        gr.LeRobotDataSource(dataset[0], keys=["observation.nope"])


# -- the user guide (docs/datasets.md) -------------------------------------------------


def test_guide_example_runs_on_a_toy_dataset(dataset: Any) -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "datasets.md").read_text()
    heading = r"## LeRobot datasets\n\n(?:<!-- [^>]* -->\n)?"  # a "not run" note may follow
    code = re.search(heading + r"```python\n(.*?)```", readme, re.S)
    assert code is not None
    snippet = code.group(1)
    for old, new in [
        ('"~/.cache/huggingface/lerobot/lerobot/pusht"', repr(dataset[0])),
        ('"observation.image"', repr(CAM)),
        ("batch_size=256", "batch_size=8"),
    ]:
        assert old in snippet, old
        snippet = snippet.replace(old, new)
    ns: dict[str, Any] = {"gr": gr}
    exec(snippet, ns)
    assert ns["frames"].shape == (8, 2, 32, 48, 3) and ns["frames"].dtype == np.uint8
    assert ns["actions"].shape == (8, 16, 2) and ns["pad"].shape == (8, 16)
    assert set(ns["task"]) <= set(TASKS)


# -- conversion ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["toy.h5", "toy_npy", "toy.zarr"])
def test_cli_convert_writes_decoded_frames(dataset: Any, tmp_path: Any, name: str) -> None:
    root, _ = dataset
    dst = str(tmp_path / name)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-m", "grain_replay.cli", "convert", root, dst, "--quiet",
         "--block-bytes", "20000"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    src = gr.LeRobotDataSource(root)
    got = gr.open_source(dst)
    assert len(got) == len(src) and set(got.keys) == set(src.keys)
    want = src.read_batch(np.arange(len(src)))
    have = got.read_batch(np.arange(len(src)))
    for k in src.keys:
        np.testing.assert_array_equal(have[k], want[k], err_msg=k)


# -- the benchmark ---------------------------------------------------------------------


def test_benchmark_runs_at_toy_size_without_lerobot(tmp_path: Any) -> None:
    """bench_lerobot.py --quick on fixture datasets (no peer): it runs and reports every case.

    No rate is asserted: timings on shared machines are noise.
    """
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_lerobot.py")
    env = {k: v for k, v in os.environ.items() if k != "LEROBOT_PYTHON"}
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run(
        [sys.executable, script, "--quick", "--repeats", "1", "--workers", "0",
         "--keep", str(tmp_path / "data")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and " / " in line]
    assert len(rows) == 5, out.stdout
    assert all(float(r.split("|")[2].replace(",", "")) > 0 for r in rows), rows
