"""Each capability Protocol recognizes the sources, iterators and streams that have it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources import capabilities as cap

ALL = [getattr(cap, name) for name in cap.__all__]
READERS = {cap.Closeable, cap.HasSpec, cap.HasTreedef, cap.ReadsInto}
STORE = READERS | {cap.Refreshable, cap.HasStoreId}
MANY = STORE | {cap.ReadsIds, cap.HasWriters, cap.ManyWriterStore}


def _rows(n: int) -> dict[str, np.ndarray]:
    done = np.zeros(n, bool)
    done[4::5] = True
    return {"obs": np.arange(n * 3, dtype=np.float32).reshape(n, 3), "done": done}


def _open(tmp_path: Path, kind: str) -> Any:
    path = str(tmp_path / kind)
    if kind == "parts":
        writer = gr.ReplayWriter(path, "npy", capacity=100, writer_id="a")
    else:
        writer = gr.ReplayWriter(path, kind)
    writer.append(_rows(20))
    writer.close()
    return gr.open_source(path)


def _has(x: Any) -> set[Any]:
    return {p for p in ALL if isinstance(x, p)}


@pytest.mark.parametrize(
    ("kind", "want"), [("npy", STORE), ("hdf5", STORE), ("zarr", STORE), ("parts", MANY)]
)
def test_stores_have_their_capabilities_and_no_others(
    tmp_path: Path, kind: str, want: set[Any]
) -> None:
    src = _open(tmp_path, kind)
    assert _has(src) == want


def test_npz_store_reads_but_does_not_grow(tmp_path: Path) -> None:
    path = str(tmp_path / "a.npz")
    np.savez(path, **_rows(10))
    src = gr.NpzDataSource(path)
    assert _has(src) >= {cap.HasSpec, cap.HasTreedef, cap.Closeable}
    assert not isinstance(src, cap.ReadsIds) and not isinstance(src, cap.ManyWriterStore)


def test_views_read_but_neither_grow_by_themselves_nor_read_ids(tmp_path: Path) -> None:
    src = _open(tmp_path, "parts")
    window = gr.WindowDataSource(src, 4, done_key="done")
    assert _has(window) == READERS
    sequence = gr.SequenceDataSource(src, {"obs": [-1, 0]}, done_key="done")
    assert cap.Refreshable in _has(sequence)  # it refreshes its steps and its episodes
    assert cap.ReadsIds not in _has(sequence)


def test_a_method_set_to_none_is_no_capability() -> None:
    class Blocked:
        refresh = None

        def close(self) -> None:
            pass

    assert _has(Blocked()) == {cap.Closeable}
    assert _has(object()) == set()


def test_iterators_and_streams(tmp_path: Path) -> None:
    src = _open(tmp_path, "parts")
    epochs = iter(gr.make_data_loader(_open(tmp_path, "npy"), batch_size=4))
    assert cap.Checkpointable in _has(epochs)
    assert cap.PriorityUpdates not in _has(epochs)
    uniform = iter(gr.make_data_loader(src, batch_size=4, sampling=gr.UniformReplay()))
    assert {cap.Checkpointable, cap.StateAt, cap.Prefetches} <= _has(uniform)
    next(uniform)
    assert isinstance(uniform._stream.sampler, cap.HasWatermark)
    assert not isinstance(uniform._stream, cap.BindsMaps)
    prioritized = iter(gr.make_data_loader(src, batch_size=4, sampling=gr.PrioritizedReplay()))
    assert {cap.Checkpointable, cap.StateAt, cap.PriorityUpdates} <= _has(prioritized)
    assert isinstance(prioritized._stream, cap.BindsMaps)  # rows travel as ids
    put = gr.sharded_device_put(prioritized)
    assert {cap.Checkpointable, cap.PriorityUpdates, cap.Prefetches} <= _has(put)
