"""examples/frame_stack.py at toy size: in process, and as a script with grain workers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from repo_scripts import EXAMPLES, load_script

import grain_replay as gr

SCRIPT = EXAMPLES / "frame_stack.py"


@pytest.fixture(scope="module")
def frame_stack() -> ModuleType:
    return load_script(SCRIPT)


def test_frame_stack_learns_velocity_and_saves_storage(
    frame_stack: ModuleType, tmp_path: Path
) -> None:
    store = tmp_path / "frames"
    toy = "--episodes 40 --steps 120 --batch-size 64 --log-every 0"
    result = frame_stack.main([*toy.split(), "--store", str(store)])
    assert result["steps"] == 120
    assert result["final_loss"] < 0.5 * result["initial_loss"], result["losses"][::10]
    # The store keeps each frame once; the pre-stacked one keeps four.
    assert 3.5 < result["prestacked_bytes"] / result["single_bytes"] < 4.1
    with gr.open_source(str(store)) as src:
        assert src.spec["frame"].shape == (84, 84) and src.spec["frame"].dtype == np.uint8
        assert result["records"] == len(src)  # every step anchors a stack


def test_frame_stacks_are_the_last_four_frames_of_the_episode(frame_stack: ModuleType) -> None:
    rng = np.random.default_rng(0)
    ep = frame_stack.episode_frames(6, rng)
    tree = {**ep, "terminated": np.arange(6) == 5}
    view = gr.SequenceDataSource(_Memory(tree), {"frame": frame_stack.STACK})
    b = view.read_batch([0, 2, 5])
    np.testing.assert_array_equal(b["frame"][2], ep["frame"][2:6])
    np.testing.assert_array_equal(b["frame"][1], ep["frame"][[0, 0, 1, 2]])
    assert b["frame_is_pad"].tolist() == [
        [True, True, True, False], [True, False, False, False], [False] * 4,
    ]  # fmt: skip


def test_frame_stack_script_with_workers(tmp_path: Path) -> None:
    store = tmp_path / "frames.zarr"
    toy = "--format zarr --workers 1 --episodes 20 --steps 40 --batch-size 64 --no-compare"
    cmd = [sys.executable, str(SCRIPT), *toy.split(), "--store", str(store)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"initial loss ([\d.]+) -> final loss ([\d.]+)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(2)) < float(match.group(1))


class _Memory:
    """A step source held in memory (spec, len, read_batch)."""

    def __init__(self, tree: dict[str, np.ndarray]):
        self._tree = tree

    @property
    def spec(self) -> dict[str, gr.LeafSpec]:
        return {k: gr.LeafSpec(v.dtype, v.shape[1:]) for k, v in self._tree.items()}

    def __len__(self) -> int:
        return len(self._tree["terminated"])

    def read_batch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[np.asarray(indices)] for k, v in self._tree.items()}
