"""ReplaySource.read_windows: consecutive rows per start, one read per leaf, on every reader."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.reading.readers import ArrayReader, LeafReader, window_rows

N = 40


def tree() -> dict[str, np.ndarray]:
    return {
        "obs": np.arange(N * 6, dtype=np.float32).reshape(N, 2, 3),
        "step": np.arange(N, dtype=np.int64),
    }


@pytest.fixture(params=["npy", "hdf5", "zarr"])
def source(request: Any, tmp_path: Any) -> Any:
    suffix = {"npy": "", "hdf5": ".h5", "zarr": ".zarr"}[request.param]
    path = str(tmp_path / f"s{suffix}")
    gr.write(path, tree(), format=request.param)
    return gr.open_source(path)


@pytest.mark.parametrize("length", [1, 3, N])
def test_windows_equal_the_rows_they_span(source: Any, length: int) -> None:
    starts = np.array([0, N - length, (N - length) // 2, 0], dtype=np.int64)
    for _ in range(3):  # cold (read ahead, rows taken), then warm (windows copied whole)
        for key, leaf in tree().items():
            got = source.read_windows(key, starts, length)
            want = leaf[window_rows(starts, length)].reshape(len(starts), length, *leaf.shape[1:])
            assert got.dtype == leaf.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
            got[...] = 0  # a new, writeable array: the store is unchanged
    np.testing.assert_array_equal(source.read_leaf("step", np.arange(N)), np.arange(N))


def test_windows_out_of_the_store_or_of_no_leaf_are_refused(source: Any) -> None:
    with pytest.raises(gr.RecordIndexError, match="valid: length >= 1"):
        source.read_windows("step", [N - 2], 3)
    with pytest.raises(gr.RecordIndexError, match="clip the starts"):
        source.read_windows("step", [-1], 2)
    with pytest.raises(gr.RecordIndexError):
        source.read_windows("step", [0], 0)
    with pytest.raises(gr.UnknownLeafError, match="no leaf 'nope'"):
        source.read_windows("nope", [0], 1)
    with pytest.raises(gr.ArgumentTypeError):
        source.read_windows("step", [0.5], 1)
    assert source.read_windows("step", np.zeros(0, np.int64), 4).shape == (0, 4)


def test_windows_of_several_leaves_in_one_call_equal_each_leafs(source: Any) -> None:
    starts = {"obs": np.array([3, 0, N - 2], np.int64), "step": np.array([N - 5, 1], np.int64)}
    lengths = {"obs": 2, "step": 5}
    for check in (True, False):
        got = source.read_windows_flat({k: (starts[k], lengths[k]) for k in starts}, check=check)
        assert list(got) == ["obs", "step"]  # in the order asked
        for key in starts:
            want = source.read_windows(key, starts[key], lengths[key])
            np.testing.assert_array_equal(got[key], want)
    with pytest.raises(gr.RecordIndexError, match="clip the starts"):
        source.read_windows_flat({"obs": ([0], 2), "step": ([N - 1], 2)})
    with pytest.raises(gr.UnknownLeafError, match="no leaf 'nope'"):
        source.read_windows_flat({"step": ([0], 1), "nope": ([0], 1)})
    assert source.read_windows_flat({}) == {}


def test_windows_of_several_leaves_go_through_a_subclass_read_windows(tmp_path: Any) -> None:
    # A source whose records are not consecutive rows reads windows its own way: the
    # multi-leaf call must not go around it.
    class Reversed(gr.NpyDataSource):
        def read_windows(self, key: str, starts: Any, length: int, *, check: bool = True) -> Any:
            return super().read_windows(key, starts, length, check=check)[:, ::-1]

    path = gr.write_npy(str(tmp_path / "s"), tree())
    src = Reversed(path)
    got = src.read_windows_flat({"step": (np.array([4]), 3)}, check=False)
    assert got["step"].tolist() == [[6, 5, 4]]


def test_array_reader_copies_windows_of_a_contiguous_array_only() -> None:
    array = np.arange(50, dtype=np.int16).reshape(10, 5)
    starts = np.array([7, 0, 3], dtype=np.int64)
    want = array[window_rows(starts, 3)].reshape(3, 3, 5)
    for a in (array, array[:, ::2], array.T.copy().T):  # contiguous, strided, Fortran order
        got = ArrayReader(a).take_windows(starts, 3)
        np.testing.assert_array_equal(got, a[window_rows(starts, 3)].reshape(3, 3, -1))
    np.testing.assert_array_equal(ArrayReader(array).take_windows(starts, 3), want)
    # Longer windows than rows: never a view past the array (the default takes rows).
    assert ArrayReader(array).take_windows(np.zeros(0, np.int64), 11).shape == (0, 11, 5)

    class Rows(LeafReader):
        def take(self, indices: np.ndarray) -> np.ndarray:
            return array[indices]

    np.testing.assert_array_equal(Rows().take_windows(starts, 3), want)
