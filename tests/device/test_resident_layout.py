"""Device-resident replay's store in the line layout (``device/lines.py``): bit-exact batches,
chunked loads that start lines, and a budget of the layout's real device bytes."""

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
from jax.sharding import Mesh

import grain_replay as gr
from grain_replay.device import resident as resident_module
from grain_replay.device.lines import LANES, Probe, RowLayout, tiled_bytes
from tests.helpers.counting_source import CountingSource

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 JAX devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
    "before JAX is first imported",
)


@pytest.fixture(autouse=True)
def _small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 batches a dispatch, not 64: the gather program of 13 leaves compiles in a fraction
    of the time (windows themselves: tests/device/test_resident.py)."""
    monkeypatch.setattr(resident_module, "_MAX_WINDOW", 4)


def _leaves(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Narrow and wide leaves; bool, uint8 and float64 (float32 on the device) ones; widths
    that are not powers of two; last axes of one word (a frame's channels)."""
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal((n, 3)).astype(np.float32)
    f32[0, 0] = -0.0
    f32[-1, 1] = np.frombuffer(np.uint32(0x7FC00123).tobytes(), np.float32)[0]  # NaN payload
    return {
        "id": np.arange(n, dtype=np.int32),  # 1 word: 128 rows a line
        "done": rng.random(n) < 0.3,  # bool scalar: 1 word
        "u8": rng.integers(0, 256, n, dtype=np.uint8),  # uint8 scalar: 1 word
        "f64": rng.standard_normal(n),  # float64 -> float32: 1 word
        "vec64": rng.standard_normal((n, 3)),  # float64 -> float32: 3 words -> 4 lanes
        "f32": f32,  # 3 words, beside vec64
        "flags": rng.random((n, 3, 4)) < 0.5,  # bool, 4 a word: 3 words
        "half": rng.standard_normal((n, 3, 2)).astype(np.float16),  # 2 a word: 3 words
        "bytes": rng.integers(0, 256, (n, 5, 7), dtype=np.uint8),  # 35 B: 9 words -> 16
        "tiny": rng.integers(0, 256, (n, 6, 5, 4), dtype=np.uint8),  # 30 words -> 32
        "obs": rng.standard_normal((n, 64)).astype(np.float32),  # 64 words: 2 rows a line
        "big": rng.standard_normal((n, 8, 25)).astype(np.float32),  # 200 words: wide
        "frame": rng.integers(0, 256, (n, 12, 11, 4), dtype=np.uint8),  # 132 words: wide
    }


def _store(tmp_path: Path, n: int, name: str = "s") -> str:
    path = str(tmp_path / name)
    gr.write(path, _leaves(n), format="npy")
    return path


def _assert_same_batches(host: list[Any], resident: list[Any]) -> None:
    assert len(resident) == len(host)
    for step, (h, r) in enumerate(zip(host, resident, strict=True)):
        assert jax.tree.structure(h) == jax.tree.structure(r), step
        for a, b in zip(jax.tree.leaves(h), jax.tree.leaves(r), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, step
            assert a.sharding == b.sharding, step
            x, y = np.asarray(a), np.asarray(b)
            np.testing.assert_array_equal(  # bit patterns: -0.0 and NaN payloads too
                x.view(np.uint8), y.view(np.uint8), err_msg=f"step {step}"
            )


def test_layout_groups_leaves_by_width_into_lines_and_wide_rows(tmp_path: Path) -> None:
    layout = RowLayout(Probe(gr.open_source(_store(tmp_path, 200))), 200)
    groups = {(kind, lanes): len(m) for kind, lanes, m in layout.groups}
    assert groups == {
        ("lines", 1): 4,  # id, done, u8, f64
        ("lines", 4): 4,  # vec64, f32, flags, half
        ("lines", 16): 1,
        ("lines", 32): 1,
        ("lines", 64): 1,
        ("wide", 200): 1,
        ("wide", 132): 1,
    }
    assert (4, 2, LANES) in layout.shapes  # ceil(200 / 128) lines of 128 scalars
    assert (1, 100, LANES) in layout.shapes  # two 64-word rows a line
    assert (1, 200, 132) in layout.shapes


def test_batches_of_every_leaf_kind_equal_the_host_pipeline_bit_exact(tmp_path: Path) -> None:
    n = 200  # batch 48: 4 full batches and a short one of 8 (which splits over 8 devices)
    loader = gr.make_data_loader(
        gr.open_source(_store(tmp_path, n)),
        batch_size=48,
        num_epochs=2,
        drop_remainder=False,
        seed=3,
    )
    host = list(gr.sharded_device_put(loader))
    resident = list(gr.sharded_device_put(loader, resident=True))
    assert [b["id"].shape[0] for b in resident] == [48, 48, 48, 48, 8] * 2
    _assert_same_batches(host, resident)
    assert resident[0]["f64"].dtype == np.float32 and resident[0]["done"].dtype == np.bool_


@pytest.mark.parametrize("n", [1, 131, 257])
def test_odd_row_counts_and_the_short_last_batch_on_one_device(tmp_path: Path, n: int) -> None:
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    loader = gr.make_data_loader(
        gr.open_source(_store(tmp_path, n)), batch_size=16, num_epochs=2, drop_remainder=False
    )
    host = list(gr.sharded_device_put(loader, mesh))
    resident = list(gr.sharded_device_put(loader, mesh, resident=True))
    assert resident[-1]["id"].shape[0] == n % 16 or n % 16 == 0
    _assert_same_batches(host, resident)
    # every record once an epoch, from every line of every buffer
    ids = np.concatenate([np.asarray(b["id"]) for b in resident[: len(resident) // 2]])
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))


def test_loads_in_chunks_that_start_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = CountingSource(gr.open_source(_store(tmp_path, 700)))
    record_bytes = Probe(src).record_bytes
    src.reads.clear()
    # 300 records' bytes: 256 rows a chunk (a multiple of 128, so each starts a line).
    monkeypatch.setattr(resident_module, "_CHUNK_BYTES", 300 * record_bytes)
    loader = gr.make_data_loader(src, batch_size=64, num_epochs=1, seed=2)
    res = gr.sharded_device_put(loader, resident=True)
    assert src.reads == [1, 256, 256, 188]  # the probe, then the chunks
    batches = list(res)
    assert len(src.reads) == 4
    _assert_same_batches(list(gr.sharded_device_put(loader)), batches)


def test_budget_counts_the_layouts_device_bytes(tmp_path: Path) -> None:
    n = 131
    path = _store(tmp_path, n)
    src = gr.open_source(path)
    probe = Probe(src)
    layout = RowLayout(probe, n)
    loader = gr.make_data_loader(src, batch_size=16)
    res = gr.sharded_device_put(loader, resident=True)
    assert res.store_bytes == layout.device_bytes()
    assert res.store_bytes == sum(
        tiled_bytes(a.shape, a.dtype) for a in res._store
    )  # the buffers as allocated, tiles included
    records = n * probe.record_bytes
    assert res.store_bytes > records  # 131 rows: lines and tiles padded
    window = res.device_bytes - res.store_bytes
    res.close()
    # A budget the records' bytes fit in, but not their layout on the device: refused.
    budget = records + window
    with pytest.raises(gr.ResidentBudgetError) as info:
        gr.sharded_device_put(loader, resident=True, budget_bytes=budget)
    message = str(info.value)
    assert "128-lane lines" in message and f"{n:,} records" in message
    assert f"{probe.record_bytes:,} B" in message and "Fix:" in message
    ok = gr.sharded_device_put(loader, resident=True, budget_bytes=res.device_bytes)
    ok.close()


def test_transitions_and_frames_take_at_most_a_tenth_more_than_their_records(
    tmp_path: Path,
) -> None:
    """The benchmark's stores (the TPU's HBM target): layout with tiles <= 1.1x records."""
    rng = np.random.default_rng(0)
    stores = {
        "transitions": (
            4096,
            lambda n: {
                "obs": rng.standard_normal((n, 64), dtype=np.float32),
                "next_obs": rng.standard_normal((n, 64), dtype=np.float32),
                "action": rng.integers(0, 8, n).astype(np.int32),
                "reward": rng.standard_normal(n, dtype=np.float32),
                "discount": np.full(n, 0.99, np.float32),
                "done": rng.random(n) < 0.01,
            },
        ),
        "frames": (
            64,
            lambda n: {
                "obs": rng.integers(0, 255, (n, 84, 84, 4), dtype=np.uint8),
                "action": rng.integers(0, 8, n).astype(np.int32),
                "reward": rng.standard_normal(n, dtype=np.float32),
                "done": rng.random(n) < 0.01,
            },
        ),
    }
    for name, (n, make) in stores.items():
        path = str(tmp_path / name)
        gr.write(path, make(n))
        probe = Probe(gr.open_source(path))
        layout = RowLayout(probe, n)
        ratio = layout.device_bytes() / (n * probe.record_bytes)
        assert 1.0 <= ratio <= 1.1, (name, ratio)
    frames = RowLayout(probe, 64)
    # 7,056 words a row as 56 lines of 128 (7 whole tiles, 7,168 words: what a (64, 7056)
    # buffer took, tiled to 7,168 lanes)
    assert (1, 64, 56, 128) in frames.shapes
    assert tiled_bytes((1, 64, 56, 128), np.uint32) == 64 * 7168 * 4
    assert ("tiles", 7168, [2]) in frames.groups  # obs: leaves in key order


def test_write_rows_then_gather_round_trips_from_a_line_start(tmp_path: Path) -> None:
    n = 300
    tree = _leaves(n, seed=5)
    src = gr.open_source(_store(tmp_path, n))
    layout = RowLayout(Probe(src), n)
    want = [np.asarray(a, jax.dtypes.canonicalize_dtype(a.dtype)) for a in jax.tree.leaves(tree)]
    write = jax.jit(layout.write_rows)
    bufs = layout.allocate()
    for lo, hi in ((256, 300), (0, 256)):  # the partial last line first: no row depends on order
        bufs = write(bufs, [jnp.asarray(a[lo:hi]) for a in want], np.int32(lo))
    slots = np.array([0, 1, 127, 128, 255, 256, 299, 5], np.int32)
    got = jax.jit(layout.gather)(bufs, jnp.asarray(slots))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), w[slots].view(np.uint8))
