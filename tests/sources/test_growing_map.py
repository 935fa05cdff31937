"""A growing .npy store's reader extends its maps in place on refresh() instead of reopening."""

from __future__ import annotations

import gc
import os
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.reading import growing, readahead, stitch

pytestmark = pytest.mark.skipif(not readahead.available(), reason="Linux mmap only")


def _rows(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.int64)
    return {"id": ids, "obs": (ids[:, None] * np.ones(3)).astype(np.float32)}


def _check(src: gr.NpyDataSource, idx: np.ndarray) -> None:
    got = src.read_batch(idx)
    np.testing.assert_array_equal(got["id"], idx)
    np.testing.assert_array_equal(got["obs"], (idx[:, None] * np.ones(3)).astype(np.float32))


def test_refresh_maps_new_rows_behind_the_old_ones_without_reopening(tmp_path: Any) -> None:
    path = tmp_path / "store"
    with gr.ReplayWriter(path, format="npy") as writer:
        writer.append(_rows(0, 100))
        writer.flush()
        src = gr.NpyDataSource(path)
        _check(src, np.arange(100))
        old = src._get_handle().readers["obs"]._array  # an array handed out before growing
        for start in range(100, 2_000, 300):
            writer.append(_rows(start, 300))
            writer.flush()
            assert src.refresh() == start + 300
            _check(src, np.arange(start + 300)[::-7])
        assert src._opens == 1  # every refresh grew the open handle
        np.testing.assert_array_equal(old[:, 0], np.arange(100))  # still valid, same memory
        assert src._get_handle().readers["obs"]._array.ctypes.data == old.ctypes.data


def test_a_replaced_file_is_reopened_not_grown(tmp_path: Any) -> None:
    path = tmp_path / "store"
    with gr.ReplayWriter(path, format="npy") as writer:
        writer.append(_rows(0, 50))
        writer.flush()
    src = gr.NpyDataSource(path)
    _check(src, np.arange(50))
    # Another program rewrites the store: new files (new inodes) under the same names.
    gr.write_npy(path, {k: v[::-1].copy() for k, v in _rows(0, 80).items()}, overwrite=True)
    assert src.refresh() == 80
    got = src.read_batch(np.arange(80))
    np.testing.assert_array_equal(got["id"], np.arange(80)[::-1])
    assert src._opens == 2


def test_growth_past_the_reserved_range_reopens(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(stitch, "_GROW_MIN", 0)  # reserve no address space ahead
    monkeypatch.setattr(stitch, "_GROW_MAX", 0)
    path = tmp_path / "store"
    with gr.ReplayWriter(path, format="npy") as writer:
        writer.append(_rows(0, 2_000))
        writer.flush()
        src = gr.NpyDataSource(path)
        _check(src, np.arange(2_000))
        writer.append(_rows(2_000, 10_000))
        writer.flush()
        src.refresh()
        _check(src, np.arange(0, 12_000, 11))
    assert src._opens == 2


def test_grow_refuses_a_file_that_shrank(tmp_path: Any) -> None:
    file = str(tmp_path / "f.bin")
    with open(file, "wb") as f:
        f.write(bytes(range(256)) * 64)
    m = growing.map_file(file, 4096)
    assert m is not None
    np.testing.assert_array_equal(m.array(0, (4096,), np.dtype(np.uint8))[:256], np.arange(256))
    os.truncate(file, 8000)
    assert not m.grow(10_000)  # past the file's end: the caller reopens
    assert m.grow(8000)
    with pytest.raises(ValueError, match="mapped"):
        m.array(0, (9000,), np.dtype(np.uint8))
    del m
    gc.collect()


def test_fortran_order_files_are_mapped_whole_and_still_refresh(tmp_path: Any) -> None:
    path = tmp_path / "store"
    path.mkdir()
    np.save(path / "x.npy", np.asfortranarray(np.arange(40, dtype=np.float64).reshape(20, 2)))
    src = gr.NpyDataSource(path)
    np.testing.assert_array_equal(src.read_batch([3])["x"], [[6, 7]])
    assert src.refresh() == 20
    np.testing.assert_array_equal(src.read_batch([19])["x"], [[38, 39]])


def test_only_files_a_replay_writer_grows_get_address_space_reserved(tmp_path: Any) -> None:
    gr.write_npy(tmp_path / "static", _rows(0, 64))  # np.save headers: replaced, never grown
    with gr.ReplayWriter(tmp_path / "growing", format="npy") as writer:
        writer.append(_rows(0, 64))
    static, grown = gr.NpyDataSource(tmp_path / "static"), gr.NpyDataSource(tmp_path / "growing")
    _check(static, np.arange(64))
    _check(grown, np.arange(64))
    assert not static._get_handle()._growing
    assert set(grown._get_handle()._growing) == {"id", "obs"}


def test_refresh_of_a_single_file_and_of_a_foreign_directory(tmp_path: Any) -> None:
    np.save(tmp_path / "x.npy", np.arange(10))
    one = gr.NpyDataSource(tmp_path / "x.npy")
    assert one.read_batch([1, 2]).tolist() == [1, 2]
    assert one.refresh() == 10
    assert one.read_batch([9]).tolist() == [9]
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "a.npy", np.arange(5))
    foreign = gr.NpyDataSource(tmp_path / "dir")
    assert foreign.read_batch([4])["a"].tolist() == [4]
    np.save(tmp_path / "dir" / "a.npy", np.arange(7))  # replaced by a longer file
    assert foreign.refresh() == 7
    assert foreign.read_batch([6])["a"].tolist() == [6]


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_a_growing_chunked_store_maps_new_and_rewritten_chunks_in_place(
    tmp_path: Any, suffix: str
) -> None:
    """Zarr rewrites the chunk holding the old end as a new file: it is mapped again.

    HDF5 allocates chunks as its capacity doubles: the new ones are mapped behind.
    """
    path = tmp_path / f"store{suffix}"
    with gr.ReplayWriter(path) as writer:
        writer.append(_rows(0, 100))
        writer.flush()
        src = gr.open_source(path)
        _check(src, np.arange(100))
        assert src._get_handle().readers["obs"].mapping is not None  # stitched chunks
        old = src._get_handle().readers["obs"]._array
        for start in range(100, 60_000, 3_333):  # chunks of ~1 MiB: some fill, some start
            writer.append(_rows(start, 3_333))
            writer.flush()
            n = src.refresh()
            _check(src, np.arange(n)[::7])
            _check(src, np.arange(n - 40, n))  # the rows of the rewritten chunk
        assert src._opens == 1
        np.testing.assert_array_equal(old[:, 0], np.arange(100))


@pytest.mark.parametrize("suffix", [".zarr", ".h5"])
def test_a_chunked_store_written_anew_is_reopened_not_grown(tmp_path: Any, suffix: str) -> None:
    path = tmp_path / f"store{suffix}"
    with gr.ReplayWriter(path) as writer:
        writer.append(_rows(0, 50))
    src = gr.open_source(path)
    _check(src, np.arange(50))
    gr.write(path, {k: v[::-1].copy() for k, v in _rows(0, 80).items()}, overwrite=True)
    assert src.refresh() == 80
    np.testing.assert_array_equal(src.read_batch(np.arange(80))["id"], np.arange(80)[::-1])
    assert src._opens == 2
