"""gr.DeviceReplay's ring layout: each leaf's 32-bit words in 128-lane lines, bit-exact."""

from __future__ import annotations

import os

# Must precede the first jax import: 8 fake CPU devices, as `make test` runs.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.device.lines import words

CAP = 300  # not a multiple of 128


def _leaves(start: int, n: int) -> dict[str, np.ndarray]:
    """Leaves of 1, 3 (-> 4), 16, 64, 128 and 200 words a row, of every width of dtype."""
    rng = np.random.default_rng(start)
    seq = np.arange(start, start + n)
    return {
        "seq": seq.astype(np.int32),  # 1 word
        "done": seq % 3 == 0,  # bool: 1 word
        "small": rng.integers(-128, 127, (n, 3), dtype=np.int8),  # 3 bytes: 1 word
        "f64": seq * 0.25,  # float64: float32 on the device, 1 word
        "neg": rng.integers(-128, 127, n, dtype=np.int8),  # scalar bytes: zero-extended
        "h1": rng.standard_normal(n).astype(np.float16),
        "bytes12": rng.integers(0, 255, (n, 12), dtype=np.uint8),  # 3 words -> 4 lanes
        "half": rng.standard_normal((n, 5)).astype(np.float16),  # 10 bytes: 3 words
        "patch": rng.integers(0, 255, (n, 7, 9), dtype=np.uint8),  # 63 bytes: 16 words
        "obs": rng.standard_normal((n, 64), dtype=np.float32),  # 64: two rows a line
        "wide": rng.integers(-(2**31), 2**31 - 1, (n, 128), dtype=np.int32),  # 128: one line
        "big": rng.standard_normal((n, 8, 25), dtype=np.float32),  # 200 words: wide rows
        "tile": rng.standard_normal((n, 2, 512), dtype=np.float32),  # 1,024 words: 8 lines
    }


def test_word_counts() -> None:
    assert words((), np.bool_) == 1
    assert words((3,), np.int8) == 1
    assert words((12,), np.uint8) == 3
    assert words((5,), np.float16) == 3
    assert words((84, 84, 4), np.uint8) == 7056
    assert words((2,), np.float64) == 4
    assert words((2,), np.complex64) is None


def _check_every_slot(replay: gr.DeviceReplay, state: Any) -> None:
    layout = replay._setup()
    live = np.flatnonzero(np.asarray(replay.view(state).live))
    leaves = jax.jit(layout.gather)(state.rows, jnp.asarray(live, jnp.int32))
    got = jax.tree_util.tree_unflatten(layout.probe.treedef, leaves)
    want = replay.source.read_batch(replay.row_ids(state, live))
    for key, w in want.items():
        w = np.asarray(w, dtype=jax.dtypes.canonicalize_dtype(w.dtype))
        g = np.asarray(got[key])
        assert g.dtype == w.dtype, key
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=key)


def test_leaves_of_every_width_round_trip_bit_exact(tmp_path: Path) -> None:
    path = str(tmp_path / "widths")
    with gr.ReplayWriter(path, "npy") as w:
        w.append(_leaves(0, 200))
        w.flush()
        replay = gr.DeviceReplay(path, sampling=gr.PrioritizedReplay(), capacity=CAP)
        state = replay.init()
        layout = replay._setup()
        groups = {(kind, lanes): len(m) for kind, lanes, m in layout.groups}
        assert groups == {
            ("lines", 1): 6,  # seq, done, small, f64, neg, h1
            ("lines", 4): 2,  # bytes12, half
            ("lines", 16): 1,
            ("lines", 64): 1,
            ("lines", 128): 1,
            ("wide", 200): 1,  # 2 lines: as tiles (8 lines) 4 times their size
            ("tiles", 1024): 1,  # 8 lines: whole tiles
        }
        shapes = sorted(layout.shapes)
        assert (6, 3, 128) in shapes and (2, 10, 128) in shapes  # ceil(300 / 128), / 32
        assert (1, 150, 128) in shapes and (1, CAP, 200) in shapes
        assert (1, CAP, 8, 128) in shapes
        _check_every_slot(replay, state)
        # 250 more: several new rows land in each line, beside rows kept from before.
        w.append(_leaves(200, 250))
        w.flush()
        state = replay.refresh(state)
        assert int(replay.view(state).n_live) == CAP
        _check_every_slot(replay, state)
        batch = jax.jit(lambda s, k: replay.sample(s, k, 128))(state, jax.random.key(0))
        ids = replay.row_ids(state, np.asarray(batch.index))
        np.testing.assert_array_equal(np.asarray(batch.data["seq"]), ids)


def _tiled(x: jax.Array) -> int:
    """Bytes ``x`` takes when its minor dimension is padded to 128 lanes (a TPU's tiling;
    the frames' 7,056 words a row take 7,168)."""
    shape = list(x.shape)
    if len(shape) >= 2:
        shape[-1] = -(-shape[-1] // 128) * 128
    return int(np.prod(shape)) * x.dtype.itemsize


def test_frames_and_transitions_hold_at_most_a_tenth_more_than_the_store(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 256
    stores = {
        "mlp": {
            "obs": rng.standard_normal((n, 64), dtype=np.float32),
            "next_obs": rng.standard_normal((n, 64), dtype=np.float32),
            "action": rng.integers(0, 8, n).astype(np.int32),
            "reward": rng.standard_normal(n, dtype=np.float32),
            "discount": np.full(n, 0.99, np.float32),
            "done": rng.random(n) < 0.01,
        },
        "conv": {
            "obs": rng.integers(0, 255, (n, 84, 84, 4), dtype=np.uint8),
            "action": rng.integers(0, 8, n).astype(np.int32),
            "reward": rng.standard_normal(n, dtype=np.float32),
            "done": rng.random(n) < 0.01,
        },
    }
    for name, tree in stores.items():
        path = str(tmp_path / name)
        gr.write(path, tree)
        replay = gr.DeviceReplay(path, sampling=gr.PrioritizedReplay())
        store = sum(a.nbytes for a in tree.values())
        ring = sum(_tiled(x) for x in jax.tree.leaves(replay.init()))
        assert ring <= 1.1 * store, (name, ring / store)


def test_uint8_frames_keep_their_shape_and_bytes(tmp_path: Path) -> None:
    path = str(tmp_path / "frames")
    rng = np.random.default_rng(1)
    gr.write(path, {"obs": rng.integers(0, 255, (20, 84, 84, 4), dtype=np.uint8)})
    replay = gr.DeviceReplay(path)
    state = replay.init()
    assert [kind for kind, _, _ in replay._setup().groups] == ["tiles"]
    _check_every_slot(replay, state)


@pytest.mark.parametrize("capacity", [1, 127, 129])
def test_small_and_odd_capacities(tmp_path: Path, capacity: int) -> None:
    path = str(tmp_path / "odd")
    gr.write(path, _leaves(0, 140))
    replay = gr.DeviceReplay(path, sampling=gr.PrioritizedReplay(), capacity=capacity)
    state = replay.init()
    assert int(replay.view(state).n_live) == capacity
    _check_every_slot(replay, state)
    batch = replay.sample(state, jax.random.key(0), 64)
    assert set(np.asarray(batch.index).tolist()) <= set(range(capacity))
