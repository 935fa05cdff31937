"""LeRobotDataSource against LeRobot itself: datasets written by ``LeRobotDataset.create`` +
``add_frame`` + ``save_episode``, compared frame by frame with ``LeRobotDataset.__getitem__``.

LeRobot pulls torch, so it lives in its own venv: ``make test-lerobot`` creates it and sets
``LEROBOT_PYTHON``; without it these tests skip. The peer side (tests/helpers/lerobot_peer.py)
runs in that venv and hands its items over as .npz; this side streams the dataset through
``make_data_loader(worker_count=2)`` and ``sharded_device_put``.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("av")

import grain_replay as gr

PEER = os.environ.get("LEROBOT_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not (PEER and os.access(PEER, os.X_OK)),
    reason="needs LeRobot: run `make test-lerobot` (sets LEROBOT_PYTHON to its venv's python)",
)
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "helpers", "lerobot_peer.py")
DELTA = {
    "observation.images.cam0": [-0.2, -0.1, 0.0],
    "action": [0.0, 0.1, 0.2, 0.3, 0.4],
    "observation.state": [-0.1, 0.0],
}


def _peer(*args: str) -> None:
    out = subprocess.run(
        [PEER, SCRIPT, *args], capture_output=True, text=True, timeout=600, cwd=os.getcwd()
    )
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.fixture(scope="module", params=["libsvtav1", "h264", "png-images"])
def written(request: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """Two 64x64 cameras: AV1 or H.264 videos (LeRobot's encoder), or PNG images in parquet."""
    tmp = tmp_path_factory.mktemp(f"lerobot_{request.param}")
    root = str(tmp / "toy")
    camera = ["--images"] if request.param == "png-images" else ["--vcodec", request.param]
    _peer("write", root, "--cameras", "2", "--size", "64", *camera)
    _peer("dump", root, str(tmp / "frames.npz"))
    _peer("dump", root, str(tmp / "delta.npz"), "--delta", json.dumps(DELTA))
    return {
        "root": root,
        "frames": dict(np.load(tmp / "frames.npz")),
        "delta": dict(np.load(tmp / "delta.npz")),
    }


def _as_lerobot(key: str, value: np.ndarray) -> np.ndarray:
    """This source's value in LeRobot's convention (cameras float32 (..., C, H, W) in [0, 1])."""
    value = np.asarray(value)
    if value.dtype == np.uint8:
        return np.moveaxis(value, -1, -3).astype(np.float32) / 255
    return value


def _compare_streamed(src: gr.LeRobotDataSource, ref: dict[str, np.ndarray]) -> None:
    loader = gr.make_data_loader(src, batch_size=8, shuffle=True, seed=0, worker_count=2)
    seen: list[int] = []
    for batch in gr.sharded_device_put(iter(loader)):
        idx = np.asarray(batch["index"])
        for key in ref:
            if key == "task":
                got = np.array(src.tasks)[np.asarray(batch["task_index"])]
                np.testing.assert_array_equal(got, ref["task"][idx])
                continue
            got = _as_lerobot(key, np.asarray(batch[key]))
            want = ref[key][idx]
            # jax without x64 narrows int64 on the devices; the source's own dtype is LeRobot's.
            assert got.shape == want.shape, key
            if src.spec[key].dtype != np.uint8:
                assert src.spec[key].dtype == want.dtype, key
            np.testing.assert_array_equal(got, want, err_msg=key)
        seen += idx.tolist()
    assert sorted(seen) == sorted(set(seen)) and len(seen) == len(src) // 8 * 8


def test_frames_equal_lerobot_getitem(written: dict[str, Any]) -> None:
    src = gr.LeRobotDataSource(written["root"])
    assert set(written["frames"]) - {"task"} == set(src.keys)
    _compare_streamed(src, written["frames"])


def test_delta_timestamps_equal_lerobot_getitem(written: dict[str, Any]) -> None:
    src = gr.LeRobotDataSource(written["root"], delta_timestamps=DELTA)
    assert set(written["delta"]) - {"task"} == set(src.keys)
    _compare_streamed(src, written["delta"])


def test_stats_equal_lerobot_stats(written: dict[str, Any]) -> None:
    with open(os.path.join(written["root"], "meta", "stats.json")) as f:
        raw = json.load(f)
    stats = gr.LeRobotDataSource(written["root"]).stats
    assert set(stats) == set(raw)
    for key, entry in raw.items():
        for name, value in entry.items():
            np.testing.assert_array_equal(stats[key][name], np.asarray(value))
