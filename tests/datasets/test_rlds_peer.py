"""RLDSDataSource against datasets TFDS itself wrote, read back by TFDS (make test-rlds).

TensorFlow and tensorflow-datasets live in their own venv; its python is given in
``RLDS_PYTHON``, and without it these tests skip. The peer side
(tests/helpers/rlds_peer.py) writes the dataset with a ``GeneratorBasedBuilder``
over RLDS features (images, language, nested observations, several shards,
episodes of different lengths) and dumps ``as_dataset()``'s steps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

pytest.importorskip("PIL")

from rlds_fixture import expected_windows, flat_batch

import grain_replay as gr
from grain_replay.datasets.rlds.images import jpeg_decoder

PEER = os.environ.get("RLDS_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not (PEER and os.path.exists(PEER)),
    reason="needs TensorFlow + tensorflow-datasets: run `make test-rlds` (sets RLDS_PYTHON)",
)
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "helpers", "rlds_peer.py")
# TF decodes JPEG with libjpeg's fast integer IDCT (decode_jpeg's default dct_method), as
# simplejpeg does here when installed: then every feature is bit-exact. Pillow uses the
# accurate IDCT: on these noise images its frames differ by about one level on average.
JPEG_TOLERANCE = 12


def _peer(*args: str) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    out = subprocess.run([PEER, SCRIPT, *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def tfds_dataset(tmp_path_factory: Any) -> tuple[str, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("tfds")
    path = _peer("write", str(root), "--episodes", "6", "--length", "5", "--shards", "3")
    dump = str(root / "dump.npz")
    _peer("dump", path, dump)
    with np.load(dump) as z:
        return path, {k.replace("|", "/"): z[k] for k in z.files}


def test_reads_tfds_written_dataset_equal_to_as_dataset(tfds_dataset: Any) -> None:
    path, want = tfds_dataset[0], dict(tfds_dataset[1])
    assert len([f for f in os.listdir(path) if ".tfrecord-" in f]) == 3
    steps = gr.open_source(path)
    assert isinstance(steps, gr.RLDSDataSource)
    meta = [k for k in want if k.startswith("episode_metadata/")]
    src = gr.RLDSDataSource(path, keys=[*steps.keys, *meta], progress=False)
    lengths = want.pop("__lengths__")
    assert len(src) == lengths.sum()
    np.testing.assert_array_equal(np.diff(src.episode_ends, prepend=0), lengths)
    got = src.read_flat(np.arange(len(src)))
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        if key.startswith("episode_metadata/"):
            w = np.repeat(w, lengths, axis=0)
        g = got[key]
        assert g.shape == w.shape, key
        if w.dtype.kind == "O":  # tf strings come back as bytes objects
            assert [bytes(x) for x in g] == list(w), key
        elif key == "observation/image" and jpeg_decoder() is None:  # JPEG through Pillow
            assert g.dtype == w.dtype
            diff = np.abs(g.astype(int) - w.astype(int))
            assert diff.max() <= JPEG_TOLERANCE and diff.mean() < 1.5, (diff.max(), diff.mean())
        else:
            assert g.dtype == w.dtype, (key, g.dtype, w.dtype)
            np.testing.assert_array_equal(g, w, err_msg=key)


def test_random_batches_and_episodes_match_tfds(tfds_dataset: Any) -> None:
    path, want = tfds_dataset
    lengths = want["__lengths__"]
    src = gr.RLDSDataSource(path, keys=["action", "is_terminal", "observation/wrist_image"])
    idx = np.random.default_rng(0).integers(0, len(src), 64)
    b = src.read_batch(idx)
    np.testing.assert_array_equal(b["action"], want["action"][idx])
    np.testing.assert_array_equal(
        b["observation"]["wrist_image"], want["observation/wrist_image"][idx]
    )
    ends = np.cumsum(lengths)
    terminated = want["is_terminal"][ends - 1]
    assert gr.build_episode_index(src) == gr.EpisodeIndex.from_lengths(lengths, terminated)


@pytest.mark.parametrize("pad", ["edge", "zero", "drop"])
def test_action_chunks_and_frame_stacks_match_tfds_step_by_step(
    tfds_dataset: Any, pad: str
) -> None:
    # Windows (the chunk reaching past each 5-step episode), a frame stack read at rows
    # (PNG, exact) and float64 text embeddings, against TFDS's steps picked one by one.
    path, want = tfds_dataset
    offsets = {
        "action": list(range(4)),
        "language_embedding": [0, 1],
        "observation/state": [0],
        "observation/wrist_image": [-1, 0],
    }
    src = gr.RLDSDataSource(path, keys=list(offsets), progress=False)
    seq = gr.SequenceDataSource(src, offsets, pad=pad)
    anchors, expect = expected_windows(want, want["__lengths__"], offsets, pad)
    ids = np.arange(len(seq), dtype=np.int64)[::-1].copy()
    assert len(seq) == len(anchors)
    got = flat_batch(seq.read_batch(ids))
    into = {k: np.empty((len(ids), *v.shape), v.dtype) for k, v in seq.spec.items()}
    seq.read_into(ids, into)
    for key, w in expect.items():
        assert got[key].dtype == w.dtype, key
        np.testing.assert_array_equal(got[key], w[ids], err_msg=key)
        np.testing.assert_array_equal(into[key], w[ids], err_msg=key)


def test_no_tensorflow_in_this_process() -> None:
    assert "tensorflow" not in sys.modules
