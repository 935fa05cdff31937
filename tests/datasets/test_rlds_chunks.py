"""Action chunks and frame stacks of an RLDS dataset: float rows read in runs, and
``SequenceDataSource.read_into`` gathering image leaves straight into the batch's arrays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("PIL")

from rlds_fixture import expected_windows, flat_batch, write_rlds

import grain_replay as gr
from grain_replay.datasets.rlds import readers as readers_lib

LENGTHS = (5, 3, 7, 1, 4, 6)


@pytest.fixture
def ds(tmp_path: Any) -> tuple[str, dict[str, np.ndarray]]:
    root = str(tmp_path / "toy_rlds" / "1.0.0")
    return root, write_rlds(root, lengths=LENGTHS)


@pytest.fixture(params=[8, 32])
def sized(tmp_path: Any, request: Any) -> tuple[str, dict[str, np.ndarray]]:
    """8x8 frames (192 bytes: frame stacks read as windows) and 32x32 (3 KiB: as rows)."""
    root = str(tmp_path / "toy_rlds" / "1.0.0")
    return root, write_rlds(root, lengths=LENGTHS, size=request.param)


@pytest.fixture
def big(tmp_path: Any) -> tuple[str, dict[str, np.ndarray]]:
    """32x32 frames: image leaves are read at rows, not as windows."""
    root = str(tmp_path / "toy_rlds" / "1.0.0")
    return root, write_rlds(root, lengths=LENGTHS, size=32)


def _count_reads(monkeypatch: Any) -> list[int]:
    """Patches the shards' ``read``; returns the list of byte counts it is called with."""
    calls: list[int] = []
    real = readers_lib.Shards.read

    def read(self: Any, shard: int, offset: int, n: int) -> bytes:
        calls.append(n)
        return real(self, shard, offset, n)

    monkeypatch.setattr(readers_lib.Shards, "read", read)
    return calls


# -- float rows in runs -----------------------------------------------------------------


@pytest.mark.parametrize("packed", [True, False])
def test_float_rows_in_any_order_equal_the_steps(tmp_path: Any, packed: bool) -> None:
    data = write_rlds(tmp_path, lengths=LENGTHS, shards=2, packed=packed)
    src = gr.RLDSDataSource(tmp_path, keys=["action", "observation/state"], progress=False)
    n = len(src)
    rng = np.random.default_rng(0)
    cases = [
        np.arange(n),  # runs across every episode boundary
        np.arange(n)[::-1],  # descending: one row a run
        np.repeat(np.arange(n), 3),  # repeats (edge clipping) inside runs
        np.array([4, 4, 4, 5, 6, 6, 0, 1, 1, 2]),  # clipped windows, then back
        rng.integers(0, n, 64),
        np.array([7]),
    ]
    for rows in cases:
        for key in ("action", "observation/state"):
            got = src.read_leaf(key, rows)
            np.testing.assert_array_equal(got, data[key][rows], err_msg=f"{key} {rows}")
            assert got.flags.writeable and got.flags.c_contiguous
    assert src.read_leaf("action", np.zeros(0, np.int64)).shape == (0, 7)


def test_a_window_inside_an_episode_is_one_read(ds: Any, monkeypatch: Any) -> None:
    root, data = ds
    src = gr.RLDSDataSource(root, keys=["action"], progress=False)
    src.read_leaf("action", [0])  # the handle opened
    calls = _count_reads(monkeypatch)
    # Episode 2 is steps 8..14; episode 3 is step 15, episode 4 steps 16..19.
    got = src.read_windows("action", [8, 9, 16], 4)
    rows = [[8, 9, 10, 11], [9, 10, 11, 12], [16, 17, 18, 19]]
    np.testing.assert_array_equal(got, data["action"][rows])
    assert calls == [4 * 7 * 4] * 3  # one pread of 4 steps of 7 floats per window
    calls.clear()
    got = src.read_windows("action", [13], 4)  # 13, 14 | 15 | 16: three episodes
    np.testing.assert_array_equal(got[0], data["action"][13:17])
    assert len(calls) == 3


def test_edge_clipped_chunks_read_each_window_once(ds: Any, monkeypatch: Any) -> None:
    root, data = ds
    src = gr.RLDSDataSource(root, keys=["action"], progress=False)
    seq = gr.SequenceDataSource(src, {"action": list(range(4))}, pad="edge")
    seq.read_batch([0])
    calls = _count_reads(monkeypatch)
    b = seq.read_batch([13, 14, 15, 8])  # near the end of episodes 2 and 3, inside 2
    np.testing.assert_array_equal(b["action"][0], data["action"][[13, 14, 14, 14]])
    np.testing.assert_array_equal(b["action"][2], data["action"][[15, 15, 15, 15]])
    np.testing.assert_array_equal(b["action_is_pad"][1], [False, True, True, True])
    # A read per window at most, of its clipped rows only; windows 13 and 14 are the steps
    # 13-14 (both clipped to 14), so they are one run: [13, 14], [15], [8, 11].
    assert calls == [2 * 28, 28, 4 * 28]


# -- windows equal the steps, every pad mode, read_batch and read_into ---------------------

OFFSETS = {
    "action": list(range(4)),
    "observation/image": [-1, 0],
    "observation/image_1": [0],
    "observation/state": [0],
}


@pytest.mark.parametrize("pad", ["edge", "zero", "drop"])
def test_chunks_and_frame_stacks_equal_the_steps(sized: Any, pad: str) -> None:
    root, data = sized
    src = gr.RLDSDataSource(root, keys=list(OFFSETS), progress=False)
    seq = gr.SequenceDataSource(src, OFFSETS, pad=pad)
    anchors, want = expected_windows(data, LENGTHS, OFFSETS, pad)
    assert len(seq) == len(anchors)
    np.testing.assert_array_equal(seq.anchor_steps(np.arange(len(seq))), anchors)
    order = np.random.default_rng(0).permutation(len(seq))  # first reads miss the frame cache
    ids = np.concatenate([order, order[::-1]]).astype(np.int64)
    got = flat_batch(seq.read_batch(ids))
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        np.testing.assert_array_equal(got[key], w[ids], err_msg=key)
    out = {k: np.full((len(ids), *v.shape), 7, v.dtype) for k, v in seq.spec.items()}
    seq.read_into(ids, out)
    for key, w in want.items():
        np.testing.assert_array_equal(out[key], w[ids], err_msg=key)


def test_read_into_gathers_images_straight_into_the_arrays(big: Any, monkeypatch: Any) -> None:
    root, data = big
    src = gr.RLDSDataSource(root, keys=list(OFFSETS), progress=False, frame_cache_bytes=0)
    seq = gr.SequenceDataSource(src, OFFSETS, pad="edge")
    ids = np.array([0, 5, 15, 24], np.int64)
    out = {k: np.zeros((len(ids), *v.shape), v.dtype) for k, v in seq.spec.items()}
    filled: list[str] = []
    real = readers_lib._BytesReader.take_into

    def take_into(self: Any, indices: np.ndarray, dst: np.ndarray) -> None:
        for key, arr in out.items():
            if np.shares_memory(dst, arr):
                filled.append(key)
        real(self, indices, dst)

    monkeypatch.setattr(readers_lib._BytesReader, "take_into", take_into)
    seq.read_into(ids, out)
    assert sorted(filled) == ["observation/image", "observation/image_1"]
    want = data["observation/image"]
    np.testing.assert_array_equal(out["observation/image"][:, 1], want[ids])
    np.testing.assert_array_equal(out["observation/image"][0, 0], want[0])  # edge: step 0
    np.testing.assert_array_equal(out["observation/image_is_pad"][:2, 0], [True, True])


def test_read_into_reads_only_the_named_leaves(sized: Any, monkeypatch: Any) -> None:
    root, _ = sized
    src = gr.RLDSDataSource(root, keys=list(OFFSETS), progress=False, frame_cache_bytes=0)
    decoded: list[int] = []
    real = readers_lib._BytesReader._images

    def images(self: Any, blobs: list[bytes], *args: Any) -> np.ndarray:
        decoded.append(len(blobs))
        return real(self, blobs, *args)

    for pad in ("edge", "zero"):
        seq = gr.SequenceDataSource(src, OFFSETS, pad=pad)
        ids = np.array([4, 2, 15], np.int64)
        want = flat_batch(seq.read_batch(ids))
        decoded.clear()
        part = {
            "action": np.zeros((3, 4, 7), np.float32),
            "observation/image_1": np.zeros((3, *seq.spec["observation/image_1"].shape), np.uint8),
            "observation/image_is_pad": np.ones((3, 2), bool),
        }
        with monkeypatch.context() as m:
            m.setattr(readers_lib._BytesReader, "_images", images)
            seq.read_into(ids, part)
        assert decoded == [3]  # image_1 only, one frame per anchor
        for key, arr in part.items():
            np.testing.assert_array_equal(arr, want[key], err_msg=key)


def test_read_into_arrays_not_contiguous_and_of_a_wrong_shape(big: Any) -> None:
    root, _ = big
    src = gr.RLDSDataSource(root, keys=list(OFFSETS), progress=False)
    seq = gr.SequenceDataSource(src, OFFSETS, pad="zero")
    ids = np.array([0, 9, 15], np.int64)
    want = flat_batch(seq.read_batch(ids))
    wide = np.zeros((3, 2, 32, 64, 3), np.uint8)
    out = {"observation/image": wide[:, :, :, ::2], "action": np.zeros((3, 4, 7), np.float32)}
    assert not out["observation/image"].flags.c_contiguous
    seq.read_into(ids, out)
    for key, arr in out.items():
        np.testing.assert_array_equal(arr, want[key], err_msg=key)
    with pytest.raises(gr.errors.InvalidArgumentError, match="read_into"):
        seq.read_into(ids, {"action": np.zeros((3, 7), np.float32)})


def test_loader_workers_read_chunks_into_their_slots(ds: Any) -> None:
    root, data = ds
    src = gr.RLDSDataSource(root, keys=list(OFFSETS), progress=False)
    seq = gr.SequenceDataSource(src, OFFSETS, pad="edge")
    _, want = expected_windows(data, LENGTHS, OFFSETS, "edge")
    # Anchors are told apart by their first action row and their state.
    key_of = {want["observation/state"][i, 0].tobytes(): i for i in range(len(seq))}
    for workers in (0, 2):
        loader = gr.make_data_loader(seq, batch_size=4, shuffle=True, seed=1, worker_count=workers)
        seen = []
        for batch in loader:
            flat = flat_batch(batch)
            rows = [key_of[s.tobytes()] for s in np.asarray(flat["observation/state"])[:, 0]]
            for key, w in want.items():
                np.testing.assert_array_equal(np.asarray(flat[key]), w[rows], err_msg=key)
            seen += rows
        assert len(set(seen)) == len(seen) >= len(seq) // 4 * 4, workers


@pytest.mark.parametrize("cache", [0, 1 << 30])
def test_frame_stacks_decode_each_distinct_step_once(
    big: Any, monkeypatch: Any, cache: int
) -> None:
    root, data = big
    src = gr.RLDSDataSource(
        root, keys=["observation/image"], progress=False, frame_cache_bytes=cache
    )
    seq = gr.SequenceDataSource(src, {"observation/image": [-2, -1, 0]}, pad="edge")
    decoded: list[int] = []
    real = readers_lib._BytesReader._images

    def images(self: Any, blobs: list[bytes], *args: Any) -> np.ndarray:
        decoded.append(len(blobs))
        return real(self, blobs, *args)

    monkeypatch.setattr(readers_lib._BytesReader, "_images", images)
    # Starts of episodes 0, 1 and 3 (1 step), not in step order.
    ids = np.array([15, 1, 0, 5, 2], np.int64)
    want = data["observation/image"]
    got = seq.read_batch(ids)["observation"]["image"]
    # Steps 15 15 15 | 0 0 1 | 0 0 0 | 5 5 5 | 0 1 2: 5 distinct of 15.
    assert decoded == [5]
    np.testing.assert_array_equal(got[0], want[[15, 15, 15]])
    np.testing.assert_array_equal(got[1], want[[0, 0, 1]])
    np.testing.assert_array_equal(got[3], want[[5, 5, 5]])
    np.testing.assert_array_equal(got[4], want[[0, 1, 2]])
    out = np.zeros_like(got)
    seq.read_into(ids, {"observation/image": out})
    assert decoded == [5] if cache else decoded == [5, 5]  # the cache holds them now
    np.testing.assert_array_equal(out, got)
