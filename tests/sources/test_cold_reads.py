"""Read-ahead of memory-mapped rows not in the page cache (sources/reading/readahead.py)."""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.reading import readahead
from grain_replay.sources.reading.readers import ArrayReader

pytestmark = pytest.mark.skipif(not readahead.available(), reason="needs Linux madvise/mincore")

PAGE = mmap.PAGESIZE
N = 300


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "big": rng.integers(0, 255, (N, 3 * PAGE + 100), dtype=np.uint8),  # rows span pages
        "small": rng.standard_normal((N, 5)).astype(np.float32),  # many rows per page
        "flag": (np.arange(N) % 3 == 0),
    }


WRITERS = {
    "npy": (gr.write_npy, ""),
    "hdf5": (gr.write_hdf5, ".h5"),
    "zarr": (gr.write_zarr, ".zarr"),
}


@pytest.fixture(params=list(WRITERS))
def source(request: Any, tmp_path: Any) -> Any:
    write, suffix = WRITERS[request.param]
    path = write(str(tmp_path / f"s{suffix}"), data())
    with gr.open_source(path) as src:
        yield src


def readers_of(src: Any) -> dict[str, ArrayReader]:
    src[0]
    readers = src._get_handle().readers
    assert all(isinstance(r, ArrayReader) and r._ahead is not None for r in readers.values())
    return readers


def test_every_uncompressed_format_reads_ahead(source: Any) -> None:
    assert set(readers_of(source)) == {"big", "small", "flag"}


@pytest.mark.parametrize("cold", [True, False])
def test_read_batch_is_exact_in_either_state(source: Any, cold: bool, monkeypatch: Any) -> None:
    want = data()
    # A warm gather slower than WARM_SLACK_S counts as cold: on a loaded machine a thread
    # descheduled for a millisecond would flip the state this test checks (seen in CI).
    monkeypatch.setattr(readahead, "WARM_SLACK_S", 60.0)
    for reader in readers_of(source).values():
        assert reader._ahead is not None
        monkeypatch.setattr(reader._ahead, "resident", lambda idx: not cold)
        reader._ahead.cold = True
    idx = np.array([5, -1, 5, 0, N - 1, 17, 16, 18, -300, 123])
    got = source.read_batch(idx)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v[idx])
        assert source._get_handle().readers[k]._ahead.cold is cold
    np.testing.assert_array_equal(source[-2]["big"], want["big"][-2])
    assert source.read_batch([])["big"].shape == (0, 3 * PAGE + 100)


def test_rows_just_read_are_resident_and_switch_to_warm(source: Any) -> None:
    reader = readers_of(source)["big"]
    idx = np.array([3, 200, 7])
    reader.take(idx)  # the pages are now in the page cache
    ahead = reader._ahead
    assert ahead is not None
    ahead.cold = True
    assert ahead.resident(idx)
    np.testing.assert_array_equal(reader.take(idx), data()["big"][idx])
    assert not ahead.cold


def test_slow_gather_switches_to_cold(tmp_path: Any) -> None:
    path = gr.write_npy(str(tmp_path / "d"), data())
    arr = np.load(os.path.join(path, "big.npy"), mmap_mode="r")
    ahead = readahead.RowReadAhead(arr)
    ahead.cold = False
    row_s = readahead.WARM_ROW_S + arr[0].nbytes / readahead.WARM_BYTES_PER_S
    ahead.finish(256, readahead.WARM_SLACK_S + 200 * row_s)
    assert not ahead.cold
    ahead.finish(256, readahead.WARM_SLACK_S + 300 * row_s)
    assert ahead.cold


class _FakeLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def madvise(self, addr: int, length: int, advice: int) -> int:
        self.calls.append((addr, length, advice))
        return 0


def test_read_ahead_asks_page_aligned_runs_once(tmp_path: Any, monkeypatch: Any) -> None:
    path = gr.write_npy(str(tmp_path / "d"), data())
    arr = np.load(os.path.join(path, "big.npy"), mmap_mode="r")
    fake = _FakeLibc()
    monkeypatch.setattr(readahead, "_LIBC", fake)
    ahead = readahead.RowReadAhead(arr)
    ahead.read_ahead(np.array([9, 4, 5, 4, 100]))  # rows 4-5 touch adjacent pages: one run
    base, row = arr.ctypes.data, arr[0].nbytes
    assert len(fake.calls) == 3
    for addr, length, advice in fake.calls:
        assert advice == 3 and addr % PAGE == 0 and length % PAGE == 0
    first, _, _ = fake.calls[0]
    assert first <= base + 4 * row < first + PAGE
    assert fake.calls[0][0] + fake.calls[0][1] >= base + 6 * row
    assert fake.calls[2][0] <= base + 100 * row


def test_in_memory_and_non_contiguous_arrays_do_not_read_ahead(tmp_path: Any) -> None:
    assert readahead.for_array(np.zeros((4, 3))) is None
    path = str(tmp_path / "f.npy")
    np.save(path, np.asfortranarray(np.arange(12.0).reshape(4, 3)))
    assert readahead.for_array(np.load(path, mmap_mode="r")) is None
    np.save(path, np.arange(12.0).reshape(4, 3))
    assert readahead.for_array(np.load(path, mmap_mode="r")[:2]) is not None
    assert readahead.for_array(np.load(path, mmap_mode="r")[:0]) is None


@pytest.mark.parametrize("cold", [True, False])
def test_segmented_reader_reads_exactly_in_either_state(
    tmp_path: Any, cold: bool, monkeypatch: Any
) -> None:
    from grain_replay.sources.reading.chunked import SegmentedReader

    want = data()["big"]
    path = gr.write_npy(str(tmp_path / "d"), data())
    file = os.path.join(path, "big.npy")
    arr = np.load(file, mmap_mode="r")
    starts = [0, 100, 230]
    segments = [
        np.memmap(
            file, arr.dtype, "r", arr.offset + lo * want[0].nbytes, (hi - lo, *want.shape[1:])
        )
        for lo, hi in zip(starts, [*starts[1:], N])
    ]
    reader = SegmentedReader(starts, segments)
    for ahead in reader._aheads:
        assert ahead is not None
        monkeypatch.setattr(ahead, "resident", lambda idx: not cold)
        ahead.cold = True
    idx = np.array([5, 299, 5, 0, 250, 17, 100, 99, 230, 123, 229, 8])
    np.testing.assert_array_equal(reader.take(idx), want[idx])
    assert all(a.cold is cold for a in reader._aheads if a is not None)
    np.testing.assert_array_equal(reader.take(idx[:0]), want[:0])
