"""The compiled window copy (sources/reading/windows.py) against its numpy fallback.

Both must give the same windows and fix-ups, down to the byte: directly on
arrays of many row layouts, and through ``SequenceDataSource.read_batch`` on
npy, HDF5 and Zarr stores whose short episodes clip windows at both ends
(every padding mode, every anchor, the first and last steps of the store).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conformance import assert_flat_equal, flat
from rl_fixtures import step_tree

import grain_replay as gr
from grain_replay.rl import SequenceDataSource
from grain_replay.sources.reading import windows

needs_numba = pytest.mark.skipif(windows.compiled() is None, reason="numba is not installed")


def _reference(array: np.ndarray, starts: np.ndarray, k: int, near: Any, at: Any) -> np.ndarray:
    out = np.stack([array[s : s + k] for s in starts]) if len(starts) else None
    if out is None:
        return np.empty((0, k, *array.shape[1:]), array.dtype)
    for i, b in enumerate([] if near is None else near):
        for j in range(k):
            out[b, j] = array[starts[b] + at[i, j]]
    return out


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the compiled kernel's calls (from copiers made after this), loaded at once."""
    kernel = windows.compiled()
    assert kernel is not None
    calls: list[int] = []

    def counted(*args: Any) -> None:
        calls.append(1)
        kernel(*args)

    monkeypatch.setattr(windows, "loaded", lambda wait=False: counted)
    return calls


def _numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(windows, "loaded", lambda wait=False: None)


LAYOUTS: list[tuple[Any, tuple[int, ...]]] = [
    (np.uint8, ()),
    (np.uint8, (3,)),
    (np.bool_, (7,)),
    (np.int16, (5,)),
    (np.float32, (14,)),
    (np.float64, (2, 3)),
    (np.int64, ()),
    (np.dtype(">f4"), (2,)),
]


@needs_numba
@pytest.mark.parametrize("k", [1, 2, 16])
@pytest.mark.parametrize(("dtype", "shape"), LAYOUTS)
@pytest.mark.parametrize("offset", [0, 1])
def test_compiled_copy_equals_numpy_and_the_reference(
    monkeypatch: pytest.MonkeyPatch, k: int, dtype: Any, shape: tuple[int, ...], offset: int
) -> None:
    rng = np.random.default_rng(k)
    n = 64
    dt = np.dtype(dtype)
    # offset 1: rows that start off any word boundary (the copy falls back to narrower words).
    raw = np.frombuffer(rng.bytes(offset + n * dt.itemsize * int(np.prod(shape))), np.uint8)
    array = raw[offset:].view(dt).reshape(n, *shape)
    starts = rng.integers(0, n - k + 1, 40).astype(np.int64)
    starts[:2] = [0, n - k]
    near = np.sort(rng.choice(40, 7, replace=False)).astype(np.int64)
    at = rng.integers(0, k, (7, k)).astype(np.intp)
    calls = _counting(monkeypatch)
    for nr, a in [(near, at), (None, None), (near[:0], at[:0])]:
        want = _reference(array, starts, k, nr, a)
        fast = windows.windows_fixed(array, starts, k, nr, a)
        slow = windows.windows_fixed_numpy(array, starts, k, nr, a)
        assert fast.dtype == slow.dtype == dt and fast.shape == slow.shape == want.shape
        assert fast.tobytes() == slow.tobytes()
        np.testing.assert_array_equal(fast, want)
        assert fast.flags.writeable and fast.flags.c_contiguous
    assert len(calls) == 3  # the compiled kernel copied each time


def test_without_numba_the_numpy_route_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    _numpy_only(monkeypatch)
    array = np.arange(40, dtype=np.float32).reshape(20, 2)
    starts = np.array([0, 5, 16], np.int64)
    near, at = np.array([1], np.int64), np.array([[0, 0, 1, 2]], np.intp)
    assert windows.copier(array) is None
    got = windows.windows_fixed(array, starts, 4, near, at)
    np.testing.assert_array_equal(got, _reference(array, starts, 4, near, at))


def test_no_numba_environment_variable_turns_the_compiled_copy_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GRAIN_REPLAY_NO_NUMBA", "1")
    windows.compiled.cache_clear()
    try:
        assert windows.compiled() is None
    finally:
        monkeypatch.delenv("GRAIN_REPLAY_NO_NUMBA")
        windows.compiled.cache_clear()


@needs_numba
def test_the_copy_loads_in_the_background_and_reads_use_numpy_meanwhile(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    monkeypatch.setattr(windows, "_LOADER", windows._LOADER.fresh())
    tree = step_tree(LENGTHS)
    src = SequenceDataSource(gr.open_source(gr.write_npy(str(tmp_path / "s"), tree)), OFFSETS)
    ids = np.arange(len(src), dtype=np.int64)
    want = _expect(src, tree, ids, "edge")
    for _ in range(3):  # cold, then warm while the copy loads (or once it has)
        assert_flat_equal(flat(src.read_batch(ids)), want)
    assert windows._LOADER.started_in == os.getpid()
    for thread in threading.enumerate():
        if thread.name == "grain_replay-numba-load":
            thread.join(60)
    assert windows.loaded() is windows.compiled()
    assert_flat_equal(flat(src.read_batch(ids)), want)


# -- through SequenceDataSource on each format ----------------------------------------------

# Episodes of 1 to 20 steps: windows clip at both ends, and at the store's first and last steps.
LENGTHS = [1, 4, 2, 20, 3, 1, 9, 17, 2, 6]
OFFSETS: dict[str, list[int]] = {
    "obs/vec": [-1, 0],
    "action": list(range(6)),
    "step": [-3, -2, -1, 0, 1],
    "reward": [-2, 0, 3],  # not a run: read as rows
}
FORMATS: dict[str, Callable[[str, Any], str]] = {
    "npy": lambda path, tree: gr.write(path, tree, format="npy"),
    "hdf5": lambda path, tree: gr.write(path + ".h5", tree, format="hdf5"),
    "zarr": lambda path, tree: gr.write(path + ".zarr", tree, format="zarr"),
}


def _expect(src: SequenceDataSource, tree: Any, ids: np.ndarray, pad: str) -> dict[str, Any]:
    """The records from the view's own row plan, gathered in memory (no windows)."""
    leaves = flat(tree)
    out: dict[str, Any] = {}
    for key, (rows, is_pad) in src.sequence_steps(ids).items():
        values = leaves[key][rows]
        if pad == "zero":
            values[is_pad] = 0
        out[key] = values
        out[key + "_is_pad"] = is_pad
    return out


@pytest.mark.parametrize("pad", ["edge", "zero", "drop"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_sequence_batches_are_the_same_compiled_and_in_numpy(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fmt: str, pad: str
) -> None:
    tree = step_tree(LENGTHS, [i % 3 != 1 for i in range(len(LENGTHS))])
    path = FORMATS[fmt](str(tmp_path / "steps"), tree)
    got = {}
    for mode in ("numpy", "compiled"):
        with monkeypatch.context() as m:
            if mode == "numpy":
                _numpy_only(m)
                calls = None
            elif windows.compiled() is None:
                continue
            else:
                calls = _counting(m)
            src = SequenceDataSource(gr.open_source(path), OFFSETS, pad=pad, cache=False)
            assert src._windowed  # the windowed read is what is tested
            n = len(src)
            ids = np.concatenate([np.arange(n), np.arange(n)[::-3], [0, n - 1]]).astype(np.int64)
            want = _expect(src, tree, ids, pad)
            # A store just opened counts as cold (rows taken and read ahead); then warm.
            assert_flat_equal(flat(src.read_batch(ids)), want)
            got[mode] = flat(src.read_batch(ids))
            assert_flat_equal(got[mode], want)
            if calls is not None:
                assert calls  # the compiled copy read the windows
            src.close()
    if len(got) == 2:
        for key, value in got["numpy"].items():
            assert value.tobytes() == got["compiled"][key].tobytes(), key
