"""Hypothesis round trips: any small tree of numeric arrays survives write -> read."""

from __future__ import annotations

import itertools
import os
import tempfile

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import example, given, settings

import grain_replay as gr
from grain_replay import tree as tree_lib

DTYPES = [
    np.dtype(name)
    for name in (
        "bool",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
    )
]
MAX_DEPTH = 3
NAMES = st.from_regex(r"[a-z]{1,6}", fullmatch=True)


def _split(draw, total: int) -> list[int]:
    """Splits ``total`` leaves into one or more non-empty groups."""
    if total == 1:
        return [1]
    cuts = draw(st.lists(st.integers(1, total - 1), max_size=total - 1, unique=True))
    bounds = [0, *sorted(cuts), total]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _container(draw, n: int, num_leaves: int, depth: int):
    """A dict/tuple/list holding ``num_leaves`` leaves, at most ``depth`` containers deep."""
    sizes = [1] * num_leaves if depth == 1 else _split(draw, num_leaves)
    children = []
    for size in sizes:
        if size == 1 and (depth == 1 or draw(st.booleans())):
            dtype = draw(st.sampled_from(DTYPES))
            shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
            children.append(draw(hnp.arrays(dtype, (n, *shape))))
        else:
            children.append(_container(draw, n, size, depth - 1))
    kind = draw(st.sampled_from(["dict", "tuple", "list"]))
    if kind == "dict":
        keys = draw(st.lists(NAMES, min_size=len(children), max_size=len(children), unique=True))
        return dict(zip(keys, children))
    return tuple(children) if kind == "tuple" else children


@st.composite
def replay_trees(draw):
    n = draw(st.integers(0, 7))
    num_leaves = draw(st.integers(1, 4))
    depth = draw(st.integers(1, MAX_DEPTH))
    return n, _container(draw, n, num_leaves, depth)


def _assert_leaves_equal(got, want: dict[str, np.ndarray], index=None) -> None:
    got_leaves, _ = tree_lib.flatten(got)
    assert list(got_leaves) == list(want)
    for key, w in want.items():
        w = w if index is None else w[index]
        g = got_leaves[key]
        assert isinstance(g, (np.ndarray, np.generic)), (key, type(g))
        assert g.dtype == w.dtype, key
        assert np.shape(g) == np.shape(w), key
        np.testing.assert_array_equal(g, w, err_msg=key)


SUFFIXES = {"hdf5": "store.h5", "npy": "store", "zarr": "store.zarr"}


def _check_round_trip(fmt: str, n: int, tree, **options) -> None:
    want, treedef = tree_lib.flatten(tree)
    with tempfile.TemporaryDirectory() as d:
        path = gr.write(os.path.join(d, SUFFIXES[fmt]), tree, **options)
        with gr.open_source(path) as src:
            assert len(src) == n
            assert {k: (v.dtype, v.shape) for k, v in src.spec.items()} == {
                k: (v.dtype, v.shape[1:]) for k, v in want.items()
            }
            empty = src.read_batch([])
            assert tree_lib.treedef_of(empty) == treedef
            _assert_leaves_equal(empty, {k: v[:0] for k, v in want.items()})
            if n > 0:
                batch = src.read_batch(np.arange(n))
                assert tree_lib.treedef_of(batch) == treedef
                _assert_leaves_equal(batch, want)
                idx = np.arange(n)[::-1].repeat(2)
                _assert_leaves_equal(src.read_batch(idx), want, index=idx)
            for i in range(n):
                rec = src[i]
                assert tree_lib.treedef_of(rec) == treedef
                _assert_leaves_equal(rec, want, index=i)


@pytest.mark.parametrize("fmt", ["hdf5", "npy", "zarr"])
@settings(max_examples=25, deadline=None)
@given(case=replay_trees())
def test_write_read_round_trip_random_trees(fmt, case):
    n, tree = case
    _check_round_trip(fmt, n, tree)


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        pytest.param(
            "hdf5",
            {"chunk_rows": 3, "compression": "gzip"},
            id="hdf5-gzip",
        ),
        pytest.param("zarr", {"chunk_rows": 3, "compression": "zstd"}, id="zarr-zstd"),
        pytest.param("zarr", {"chunk_rows": 2, "compression": "blosc"}, id="zarr-blosc"),
    ],
)
@settings(max_examples=25, deadline=None)
@given(case=replay_trees())
# A zero-size per-record dim in a chunked layout, tried first on every run.
@example(case=(4, {"a": np.zeros((4, 0), np.float32), "b": [np.arange(4)]}))
def test_write_read_round_trip_random_trees_chunked(fmt, options, case):
    n, tree = case
    _check_round_trip(fmt, n, tree, **options)
