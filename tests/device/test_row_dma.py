"""Rows held as whole tiles, gathered by DMA (``device/row_dma.py``): the Pallas kernel run in
Pallas's TPU interpreter on CPU (values, order, clipping), and the measured choice between
it and XLA's gather (never off a TPU; never when it fails; the faster of the two)."""

from __future__ import annotations

import functools
import logging
import os

# Must precede the first jax import: 8 fake CPU devices, as `make test` runs.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import grain_replay as gr
from grain_replay.device import lines as device_lines
from grain_replay.device import resident, resident_programs, row_dma
from grain_replay.device.lines import Probe, RowLayout, tile_lines

interpreted = functools.partial(row_dma.gather_rows, interpret=pltpu.InterpretParams())


@pytest.mark.parametrize(
    ("leaves", "slots"),
    [
        (1, [3, 7, 3, 39, 0]),  # fewer copies than IN_FLIGHT, a row twice
        (2, list(range(39, -1, -2)) + [5] * 7),  # more copies than IN_FLIGHT, reversed order
        (3, [-1, 40, 1000, 2**31 - 1, 17]),  # out of range: clipped, as jnp.take's "clip"
    ],
)
def test_kernel_copies_each_drawn_row_of_each_leaf_in_order(leaves: int, slots: list[int]) -> None:
    rng = np.random.default_rng(leaves)
    host = rng.integers(0, 2**32, (leaves, 40, 8, 128), dtype=np.uint32)
    idx = np.asarray(slots, np.int32)
    got = jax.jit(interpreted)(jnp.asarray(host), jnp.asarray(idx))
    want = host[:, np.clip(idx, 0, 39)]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), want)


def test_rows_become_whole_tiles_only_where_that_adds_little() -> None:
    assert tile_lines(7056) == 56  # an 84x84x4 uint8 frame: 55.1 lines -> 56, 7 tiles
    assert tile_lines(1024) == 8
    assert tile_lines(129) is None and tile_lines(200) is None  # 2 lines -> 8: 4x
    assert tile_lines(128) is None  # one line or less: lines
    assert tile_lines(128 * 55) == 56  # +1 line of 55: within 2%
    assert tile_lines(128 * 57) is None  # +7 of 57
    assert tile_lines(128 * 337) is None and tile_lines(128 * 343) == 344  # +7 of 337; +1


def _frames(tmp_path: Path, n: int, *, frames: bool = True) -> str:
    """Rows with leaves held as tiles (84x84x4 uint8 frames, 1,024 floats) and a scalar."""
    path = str(tmp_path / "frames")
    rng = np.random.default_rng(2)
    tree = {
        "action": np.arange(n, dtype=np.int32),
        "big": rng.standard_normal((n, 2, 512), dtype=np.float32),
    }
    if frames:
        tree["obs"] = rng.integers(0, 256, (n, 84, 84, 4), dtype=np.uint8)
    gr.write(path, tree)
    return path


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The kernel (interpreted) in place of the TPU's; the shapes it gathered, traced."""
    calls: list[tuple[int, ...]] = []

    def gather_rows(buf: Any, slots: Any) -> Any:
        calls.append((*buf.shape[:1], *slots.shape))
        return interpreted(buf, slots)

    monkeypatch.setattr(row_dma, "gather_rows", gather_rows)
    return calls


def test_layout_gathers_the_same_rows_by_dma_and_by_xla(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(row_dma, "gather_rows", interpreted)
    n = 24
    src = gr.open_source(_frames(tmp_path, n))
    layout = RowLayout(Probe(src), n)
    assert layout.has_tiles
    leaves = jax.tree.leaves(src.read_batch(np.arange(n)))
    bufs = jax.jit(lambda: layout.write_rows(layout.allocate(), leaves, 0))()
    slots = jnp.asarray([5, 0, 23, 5, 11, 2, 17], jnp.int32)
    by_xla = jax.jit(lambda b, s: layout.gather(b, s))(bufs, slots)
    by_dma = jax.jit(lambda b, s: layout.gather(b, s, dma=True))(bufs, slots)
    for x, d, want in zip(by_xla, by_dma, leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(d), np.asarray(want)[np.asarray(slots)])
        np.testing.assert_array_equal(np.asarray(x), np.asarray(d))


def test_choice_is_never_tried_off_a_tpu() -> None:
    calls: list[str] = []

    def gather(x: Any) -> Any:
        calls.append("called")
        return x

    assert not row_dma.faster(gather, gather, (jnp.zeros(4),), "ring")
    assert calls == []


def _on_tpu(monkeypatch: pytest.MonkeyPatch, xla_s: float = 0.0, dma_s: float = 0.0) -> None:
    """A TPU, say: the XLA gather timed first, then the DMA one, at these medians."""
    monkeypatch.setattr(row_dma, "on_tpu", lambda devices: True)
    times = iter([xla_s, dma_s])
    monkeypatch.setattr(row_dma, "_median_s", lambda fn, args: fn(*args) is None or next(times))


def test_the_faster_gather_is_kept(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    def by_xla(x: Any) -> Any:
        return x

    def by_dma(x: Any) -> Any:
        return x

    args = (jnp.zeros(4),)
    _on_tpu(monkeypatch, xla_s=4.6e-3, dma_s=0.1e-3)
    with caplog.at_level(logging.INFO, logger=row_dma.__name__):
        assert row_dma.faster(by_xla, by_dma, args, "ring of frames")
    said = "ring of frames: rows gathered by DMA (DMA 0.100 ms, XLA's gather 4.600 ms"
    assert said in caplog.text
    _on_tpu(monkeypatch, xla_s=0.1e-3, dma_s=0.2e-3)
    assert not row_dma.faster(by_xla, by_dma, args, "ring")


def test_a_dma_gather_that_does_not_run_leaves_xla_s(
    monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    _on_tpu(monkeypatch)

    def refused(x: Any) -> Any:
        raise NotImplementedError("Mosaic: no such DMA on this chip")

    with caplog.at_level(logging.INFO, logger=row_dma.__name__):
        assert not row_dma.faster(lambda x: x + 1, refused, (jnp.zeros(4),), "ring")
    assert "the DMA row gather did not run here" in caplog.text
    assert "Mosaic: no such DMA on this chip" in caplog.text


def test_device_replay_samples_by_dma_inside_jit_when_it_is_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path on CPU: a replay that finds the DMA faster (timings given) samples
    through the kernel (interpreted) inside the user's jit, the host's values."""
    monkeypatch.setattr(row_dma, "gather_rows", interpreted)
    used: list[bool] = []
    real_gather = device_lines.RowLayout.gather

    def gather(self: RowLayout, bufs: Any, slots: Any, *, dma: bool = False) -> Any:
        used.append(dma)
        return real_gather(self, bufs, slots, dma=dma)

    monkeypatch.setattr(device_lines.RowLayout, "gather", gather)
    _on_tpu(monkeypatch, xla_s=1e-3, dma_s=0.5e-3)
    replay = gr.DeviceReplay(_frames(tmp_path, 32, frames=False), capacity=32)
    state = replay.init()
    used.clear()
    batch = jax.jit(lambda s, k: replay.sample(s, k, 16))(state, jax.random.key(3))
    assert used == [True]
    ids = replay.row_ids(state, np.asarray(batch.index))
    want = replay.source.read_batch(ids)
    for key in want:
        np.testing.assert_array_equal(np.asarray(batch.data[key]), np.asarray(want[key]))


@pytest.fixture
def _no_kept_programs() -> Any:
    """Resident replay's programs traced here, not kept from (nor for) another test: the
    kernel swapped in at trace time (``_spy``) is this test's own."""
    resident_programs.clear()
    yield
    resident_programs.clear()


@pytest.mark.usefixtures("_no_kept_programs")
def test_resident_replay_gathers_by_dma_on_every_device_when_it_is_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resident replay (its gather one program over the 8 devices, shard_map): the DMA
    gather (interpreted) kept, batches the host pipeline's, in order."""
    calls = _spy(monkeypatch)
    _on_tpu(monkeypatch, xla_s=1e-3, dma_s=0.5e-3)
    # Windows of 2 batches (64 by default): fewer kernels for the interpreter to run.
    monkeypatch.setattr(resident, "_MAX_WINDOW", 2)
    src = gr.open_source(_frames(tmp_path, 48, frames=False))
    loader = gr.make_data_loader(src, batch_size=16, shuffle=True, seed=4)
    want = list(gr.sharded_device_put(loader))
    res = gr.sharded_device_put(loader, resident=True)
    try:
        got = list(res)
    finally:
        res.close()
    assert calls and set(calls) == {(1, 2)}, calls  # a device's 2 rows of a batch, traced
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        for key in w:
            assert g[key].sharding == w[key].sharding, key
            np.testing.assert_array_equal(np.asarray(g[key]), np.asarray(w[key]), err_msg=key)
