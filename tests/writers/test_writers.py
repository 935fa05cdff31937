"""Tests of the one-shot writers: round trips, layouts, atomicity and user errors."""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import h5py
import numpy as np
import pytest
import zarr
from conformance import assert_same_tree

import grain_replay as gr
from grain_replay import tree as tree_lib

SUFFIXES = {"hdf5": "x.h5", "npy": "x", "zarr": "x.zarr"}
FORMATS = tuple(SUFFIXES)


class Transition(NamedTuple):
    obs: np.ndarray
    action: np.ndarray
    reward: np.ndarray


def _store(tmp_path, fmt: str) -> str:
    return str(tmp_path / SUFFIXES[fmt])


def _same(got, want) -> None:
    assert_same_tree(got, want, numpy_scalars=True)


def _index(tree, i):
    leaves, treedef = tree_lib.flatten(tree)
    return tree_lib.unflatten(treedef, {k: np.asarray(v)[i] for k, v in leaves.items()})


def _partials(directory) -> list[str]:
    return [name for name in os.listdir(directory) if ".partial" in name]


def _trees(n: int = 6):
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(n, 3)).astype(np.float32)
    action = rng.integers(0, 4, size=n).astype(np.int64)
    reward = rng.normal(size=n)
    return {
        "dict": {"obs": obs, "action": action, "reward": reward},
        "tuple": (obs, action, reward),
        "list": [obs, action, reward],
        "namedtuple": Transition(obs, action, reward),
        "nested": {
            "obs": {"pixels": rng.integers(0, 255, size=(n, 2, 2), dtype=np.uint8), "vel": obs},
            "step": (action, [reward, np.arange(n, dtype=np.int16)]),
            "done": np.arange(n) % 2 == 0,
        },
    }


# -- round trips --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dict", "tuple", "list", "namedtuple", "nested"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_equal_values_and_dtypes_each_format(tmp_path, fmt, kind):
    tree = _trees()[kind]
    written = gr.write(_store(tmp_path, fmt), tree)
    assert written == os.path.abspath(_store(tmp_path, fmt))
    with gr.open_source(written) as src:
        assert len(src) == 6
        _same(src.read_batch(np.arange(6)), tree)
        for i in (0, 3, -1):
            _same(src[i], _index(tree, i))
        _same(src.read_batch([5, 0, 5, -6]), _index(tree, np.array([5, 0, 5, 0])))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_namedtuple_type_is_the_importable_class(tmp_path, fmt):
    tree = _trees()["namedtuple"]
    with gr.open_source(gr.write(_store(tmp_path, fmt), tree)) as src:
        assert type(src[0]) is Transition
        assert type(src.read_batch([1, 2])) is Transition


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_keeps_dict_insertion_order(tmp_path, fmt):
    tree = {
        "zeta": np.arange(3),
        "alpha": np.arange(3.0),
        "mid": {"b": np.ones(3), "a": np.ones(3)},
    }
    with gr.open_source(gr.write(_store(tmp_path, fmt), tree)) as src:
        rec = src[1]
        assert list(rec) == ["zeta", "alpha", "mid"]
        assert list(rec["mid"]) == ["b", "a"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_keeps_empty_containers(tmp_path, fmt):
    tree = {"a": np.arange(4), "b": {}, "c": [], "d": ()}
    with gr.open_source(gr.write(_store(tmp_path, fmt), tree)) as src:
        assert tree_lib.treedef_of(src[0]) == tree_lib.treedef_of(tree)


@pytest.mark.parametrize("fmt", FORMATS)
def test_spec_lists_per_record_dtype_and_shape(tmp_path, fmt):
    tree = {"obs": np.zeros((5, 2, 3), np.float16), "done": np.zeros(5, bool)}
    with gr.open_source(gr.write(_store(tmp_path, fmt), tree)) as src:
        assert {k: (v.dtype, v.shape) for k, v in src.spec.items()} == {
            "obs": (np.dtype(np.float16), (2, 3)),
            "done": (np.dtype(bool), ()),
        }


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_zero_records(tmp_path, fmt):
    tree = {"obs": np.zeros((0, 3), np.float32), "action": np.zeros(0, np.int32)}
    with gr.open_source(gr.write(_store(tmp_path, fmt), tree)) as src:
        assert len(src) == 0
        _same(src.read_batch([]), tree)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_creates_missing_parent_directories(tmp_path, fmt):
    path = tmp_path / "a" / "b" / SUFFIXES[fmt]
    gr.write(path, {"x": np.arange(3)})
    with gr.open_source(path) as src:
        np.testing.assert_array_equal(src.read_batch([0, 1, 2])["x"], np.arange(3))


# -- format selection -----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("x.h5", "hdf5"),
        ("x.hdf5", "hdf5"),
        ("X.H5", "hdf5"),
        ("x.zarr", "zarr"),
        ("x", "npy"),
        ("x.data", "npy"),
    ],
)
def test_write_picks_format_by_suffix(tmp_path, name, fmt):
    path = gr.write(tmp_path / name, {"a": np.arange(4)})
    if fmt == "hdf5":
        assert h5py.is_hdf5(path)
    elif fmt == "zarr":
        assert os.path.isfile(os.path.join(path, "zarr.json"))
    else:
        assert os.path.isfile(os.path.join(path, "a.npy"))
        assert os.path.isfile(os.path.join(path, "grain_replay.json"))
    with gr.open_source(path) as src:
        np.testing.assert_array_equal(src.read_batch(np.arange(4))["a"], np.arange(4))


@pytest.mark.parametrize(("fmt", "cls"), [("hdf5", "HDF5DataSource"), ("zarr", "ZarrDataSource")])
def test_write_format_override_beats_suffix(tmp_path, fmt, cls):
    path = gr.write(tmp_path / "store.bin", {"a": np.arange(4)}, format=fmt)
    with gr.open_source(path) as src:
        assert type(src).__name__ == cls
        np.testing.assert_array_equal(src[2]["a"], 2)


def test_write_format_npy_override_on_h5_suffix_writes_directory(tmp_path):
    path = gr.write(tmp_path / "x.h5", {"a": np.arange(4)}, format="npy")
    assert os.path.isdir(path)
    with gr.open_source(path) as src:
        assert isinstance(src, gr.NpyDataSource)


def test_write_raises_value_error_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="format"):
        gr.write(tmp_path / "x", {"a": np.arange(3)}, format="parquet")


@pytest.mark.parametrize(
    ("writer", "name", "cls"),
    [
        (gr.write_hdf5, "x.bin", gr.HDF5DataSource),
        (gr.write_npy, "x.bin", gr.NpyDataSource),
        (gr.write_zarr, "x.bin", gr.ZarrDataSource),
    ],
)
def test_format_writers_write_their_format_whatever_suffix(tmp_path, writer, name, cls):
    tree = {"obs": np.arange(8.0).reshape(4, 2), "t": (np.arange(4),)}
    path = writer(tmp_path / name, tree)
    with cls(path) as src:
        _same(src.read_batch(np.arange(4)), tree)
    with gr.open_source(path) as src:
        assert type(src) is cls


# -- chunking and compression ---------------------------------------------------


@pytest.mark.parametrize("compression", [None, "gzip", "lzf"])
def test_hdf5_chunk_rows_and_compression_layout(tmp_path, compression):
    tree = {"obs": np.arange(60.0).reshape(20, 3), "act": np.arange(20)}
    path = gr.write(tmp_path / "x.h5", tree, chunk_rows=7, compression=compression)
    with h5py.File(path, "r") as f:
        for key in ("obs", "act"):
            assert f[key].chunks is not None
            assert f[key].chunks[0] == 7
            assert f[key].compression == compression
    with gr.open_source(path) as src:
        _same(src.read_batch(np.arange(20)), tree)
        _same(src.read_batch([19, 0, 7, 7]), _index(tree, np.array([19, 0, 7, 7])))


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_hdf5_compression_alone_gives_chunked_layout(tmp_path, compression):
    tree = {"obs": np.arange(30.0).reshape(10, 3)}
    path = gr.write(tmp_path / "x.h5", tree, compression=compression)
    with h5py.File(path, "r") as f:
        assert f["obs"].chunks is not None
        assert f["obs"].compression == compression
    with gr.open_source(path) as src:
        _same(src.read_batch(np.arange(10)), tree)


def test_hdf5_default_layout_contiguous_uncompressed(tmp_path):
    path = gr.write(tmp_path / "x.h5", {"obs": np.arange(10.0)})
    with h5py.File(path, "r") as f:
        assert f["obs"].chunks is None
        assert f["obs"].compression is None


@pytest.mark.parametrize(
    ("compression", "codec"),
    [
        (None, None),
        ("zstd", zarr.codecs.ZstdCodec),
        ("gzip", zarr.codecs.GzipCodec),
        ("blosc", zarr.codecs.BloscCodec),
    ],
)
def test_zarr_chunk_rows_and_compression_layout(tmp_path, compression, codec):
    tree = {"obs": np.arange(60.0).reshape(20, 3), "act": np.arange(20)}
    path = gr.write(tmp_path / "x.zarr", tree, chunk_rows=7, compression=compression)
    for key in ("obs", "act"):
        arr = zarr.open_array(os.path.join(path, key), mode="r")
        assert arr.chunks[0] == 7
        if codec is None:
            assert not arr.compressors
        else:
            assert [type(c) for c in arr.compressors] == [codec]
    with gr.open_source(path) as src:
        _same(src.read_batch(np.arange(20)), tree)
        _same(src.read_batch([19, 0, 7, 7]), _index(tree, np.array([19, 0, 7, 7])))


@pytest.mark.parametrize(
    ("fmt", "compression"), [("hdf5", "zstd"), ("hdf5", "blosc"), ("zarr", "lzf"), ("zarr", "xz")]
)
def test_write_raises_value_error_invalid_compression(tmp_path, fmt, compression):
    with pytest.raises(ValueError, match="compression") as info:
        gr.write(_store(tmp_path, fmt), {"a": np.arange(3)}, compression=compression)
    assert repr(compression) in str(info.value)
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("chunk_rows", [0, -1, 2.5])
@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_write_raises_value_error_invalid_chunk_rows(tmp_path, fmt, chunk_rows):
    with pytest.raises(ValueError, match="chunk_rows"):
        gr.write(_store(tmp_path, fmt), {"a": np.arange(3)}, chunk_rows=chunk_rows)
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("option", [{"compression": "gzip"}, {"chunk_rows": 4}])
def test_write_npy_raises_value_error_chunking_or_compression(tmp_path, option):
    with pytest.raises(ValueError, match="compress") as info:
        gr.write(tmp_path / "x", {"a": np.arange(3)}, **option)
    assert "Fix" in str(info.value)
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_checks_path_and_options_once_before_reading_leaves(tmp_path, monkeypatch, fmt):
    from grain_replay.writers import oneshot

    calls = []
    for name in ("_local", "_check_options"):
        real = getattr(oneshot, name)
        monkeypatch.setattr(
            oneshot, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    monkeypatch.setattr(
        oneshot.layout_lib,
        "prepare_leaves",
        lambda *a, _real=oneshot.layout_lib.prepare_leaves, **k: (
            calls.append("prepare_leaves") or _real(*a, **k)
        ),
    )
    path = gr.write(_store(tmp_path, fmt), {"a": np.arange(3)})
    assert calls == ["_local", "_check_options", "prepare_leaves"]
    assert path == os.path.abspath(_store(tmp_path, fmt))
    np.testing.assert_array_equal(gr.open_source(path).read_batch([2, 0])["a"], [2, 0])


@pytest.mark.parametrize("option", [{"compression": "gzip"}, {"chunk_rows": 2}])
def test_hdf5_chunked_round_trip_zero_size_record_dim(tmp_path, option):
    tree = {"a": np.zeros((4, 0), np.float32), "b": np.arange(4)}
    path = gr.write(tmp_path / "x.h5", tree, **option)
    with gr.open_source(path) as src:
        _same(src.read_batch(np.arange(4)), tree)


def test_zarr_chunked_round_trip_zero_size_record_dim(tmp_path):
    tree = {"a": np.zeros((4, 0), np.float32), "b": np.arange(4)}
    path = gr.write(tmp_path / "x.zarr", tree, chunk_rows=3, compression="zstd")
    with gr.open_source(path) as src:
        _same(src.read_batch(np.arange(4)), tree)


# -- jax and bare arrays ----------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_accepts_jax_arrays(tmp_path, fmt):
    import jax.numpy as jnp

    tree = {"obs": jnp.arange(12.0).reshape(6, 2), "act": jnp.arange(6), "done": jnp.arange(6) > 2}
    want = {k: np.asarray(v) for k, v in tree.items()}
    with gr.open_source(gr.write(_store(tmp_path, fmt), tree)) as src:
        got = src.read_batch(np.arange(6))
        _same(got, want)
        assert all(type(v) is np.ndarray for v in got.values())


def test_write_bare_array_to_npy_suffix_writes_single_npy_file(tmp_path):
    data = np.arange(20, dtype=np.float32).reshape(10, 2)
    path = gr.write(tmp_path / "x.npy", data)
    assert os.path.isfile(path)
    np.testing.assert_array_equal(np.load(path, allow_pickle=False), data)
    with gr.open_source(path) as src:
        assert len(src) == 10
        np.testing.assert_array_equal(src[3], data[3])
        np.testing.assert_array_equal(src.read_batch([9, 1]), data[[9, 1]])


def test_write_bare_jax_array_to_npy_suffix(tmp_path):
    import jax.numpy as jnp

    path = gr.write(tmp_path / "x.npy", jnp.arange(5))
    np.testing.assert_array_equal(np.load(path, allow_pickle=False), np.arange(5))


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_bare_array_record_is_array_not_dict(tmp_path, fmt):
    data = np.arange(12, dtype=np.int32).reshape(4, 3)
    with gr.open_source(gr.write(_store(tmp_path, fmt), data)) as src:
        rec = src[2]
        assert isinstance(rec, np.ndarray)
        np.testing.assert_array_equal(rec, data[2])
        batch = src.read_batch(np.arange(4))
        assert isinstance(batch, np.ndarray)
        assert batch.dtype == data.dtype
        np.testing.assert_array_equal(batch, data)


# -- atomicity ----------------------------------------------------------------------


def _snapshot(path: str) -> dict[str, bytes]:
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": f.read()}
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_store_exists_error_destination_exists(tmp_path, fmt):
    path = gr.write(_store(tmp_path, fmt), {"a": np.arange(3)})
    before = _snapshot(path)
    with pytest.raises(gr.StoreExistsError) as info:
        gr.write(path, {"b": np.arange(5)})
    assert isinstance(info.value, FileExistsError)
    assert "overwrite=True" in str(info.value)
    assert path in str(info.value)
    assert _snapshot(path) == before
    assert _partials(tmp_path) == []


def test_write_raises_store_exists_error_bare_npy_file(tmp_path):
    path = gr.write(tmp_path / "x.npy", np.arange(3))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        gr.write(path, np.arange(5))
    np.testing.assert_array_equal(np.load(path), np.arange(3))


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_overwrite_replaces_existing_store(tmp_path, fmt):
    path = gr.write(_store(tmp_path, fmt), {"a": np.arange(3), "old": np.zeros(3)})
    new = {"b": np.arange(5.0)}
    assert gr.write(path, new, overwrite=True) == path
    with gr.open_source(path) as src:
        assert src.keys == ["b"]
        _same(src.read_batch(np.arange(5)), new)
    if fmt != "hdf5":
        # The old store's files are gone, not merged with the new ones.
        names = set(os.listdir(path))
        assert "a.npy" not in names and "old.npy" not in names
        assert "a" not in names and "old" not in names
    assert _partials(tmp_path) == []


def test_write_overwrite_replaces_file_with_directory_store(tmp_path):
    path = gr.write(tmp_path / "store", {"a": np.arange(3)}, format="hdf5")
    gr.write(path, {"b": np.arange(4)}, format="npy", overwrite=True)
    with gr.open_source(path) as src:
        assert isinstance(src, gr.NpyDataSource)
        assert src.keys == ["b"]
    assert _partials(tmp_path) == []


def test_write_overwrite_replaces_directory_with_file_store(tmp_path):
    path = gr.write(tmp_path / "store", {"a": np.arange(3)}, format="npy")
    gr.write(path, {"b": np.arange(4)}, format="hdf5", overwrite=True)
    with gr.open_source(path) as src:
        assert isinstance(src, gr.HDF5DataSource)
        assert src.keys == ["b"]
    assert _partials(tmp_path) == []


class _Boom(RuntimeError):
    pass


def _fail_on_second_call(monkeypatch, owner, name):
    real = getattr(owner, name)
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise _Boom("injected failure on the 2nd leaf")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


_INJECT = {
    "hdf5": (h5py.Group, "create_dataset"),
    "npy": (np.lib.format, "write_array_header_1_0"),
    "zarr": (zarr.Group, "create_array"),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_failure_mid_write_leaves_old_store_intact(tmp_path, monkeypatch, fmt):
    old = {"a": np.arange(3), "b": np.ones(3)}
    path = gr.write(_store(tmp_path, fmt), old)
    before = _snapshot(path)
    calls = _fail_on_second_call(monkeypatch, *_INJECT[fmt])
    with pytest.raises(_Boom):
        gr.write(path, {"x": np.arange(7), "y": np.arange(7), "z": np.arange(7)}, overwrite=True)
    monkeypatch.undo()
    assert len(calls) == 2
    assert _snapshot(path) == before
    assert _partials(tmp_path) == []
    with gr.open_source(path) as src:
        _same(src.read_batch(np.arange(3)), old)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_failure_mid_write_leaves_nothing_new_destination(tmp_path, monkeypatch, fmt):
    calls = _fail_on_second_call(monkeypatch, *_INJECT[fmt])
    with pytest.raises(_Boom):
        gr.write(_store(tmp_path, fmt), {"x": np.arange(7), "y": np.arange(7)})
    assert len(calls) == 2
    assert os.listdir(tmp_path) == []


# -- user errors ------------------------------------------------------------------


def _check_error(info, builtin, *names):
    err = info.value
    assert isinstance(err, gr.GrainReplayError)
    assert isinstance(err, builtin)
    msg = str(err)
    for name in names:
        assert name in msg, (name, msg)
    assert "Fix" in msg, msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_object_dtype_leaf(tmp_path, fmt):
    tree = {"obs": np.arange(2), "info": {"payload": np.array([{"a": 1}, None], dtype=object)}}
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), tree)
    _check_error(info, TypeError, "'info/payload'", "object")
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("dtype", ["U", "S"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_string_dtype_leaf(tmp_path, fmt, dtype):
    tree = {"obs": np.arange(2), "name": np.array(["ab", "c"], dtype=dtype)}
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), tree)
    _check_error(info, TypeError, "'name'")
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_leading_dims_differ(tmp_path, fmt):
    tree = {"obs": np.zeros((5, 2)), "action": np.zeros(5), "reward": np.zeros(3)}
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), tree)
    _check_error(info, TypeError, "'reward'", "3", "5")
    assert "'obs'" not in str(info.value) and "'action'" not in str(info.value)
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_two_leaves_differ_names_both(tmp_path, fmt):
    # No majority: blaming either leaf alone would point at the wrong one half the time.
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), {"obs": np.zeros(10), "reward": np.zeros(9)})
    _check_error(info, TypeError, "'obs' has 10", "'reward' has 9")
    assert "expected" not in str(info.value)
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_minority_named_not_majority(tmp_path, fmt):
    tree = {"obs": np.zeros(10), "reward": np.zeros(9), "done": np.zeros(9)}
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), tree)
    _check_error(info, TypeError, "'obs' has 10 records but expected 9")
    assert "'reward' has" not in str(info.value) and "'done' has" not in str(info.value)


@pytest.mark.parametrize("empty", [{}, [], (), {"a": {}}])
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_empty_tree(tmp_path, fmt, empty):
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), empty)
    _check_error(info, TypeError, "no leaves")
    assert not os.path.exists(_store(tmp_path, fmt))


class _Opaque:
    pass


@pytest.mark.parametrize(
    ("tree", "leaf"),
    [
        ({1, 2}, "'<root>'"),
        (7, "'<root>'"),
        (_Opaque(), "'<root>'"),
        ({"obs": np.arange(2), "extra": {1, 2}}, "'extra'"),
        ({"obs": np.arange(2), "count": 3}, "'count'"),
        ({"obs": np.arange(2), "policy": [np.arange(2), _Opaque()]}, "'policy/1'"),
    ],
    ids=["set", "int", "object", "nested-set", "nested-int", "nested-object"],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_non_pytree(tmp_path, fmt, tree, leaf):
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), tree)
    _check_error(info, TypeError, leaf)
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("scalar", [np.float32(0.99), np.array(3)], ids=["np-scalar", "0d-array"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_scalar_leaf(tmp_path, fmt, scalar):
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), {"obs": np.arange(2), "gamma": scalar})
    _check_error(info, TypeError, "'gamma'", "scalar")
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_non_string_dict_key(tmp_path, fmt):
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), {"obs": {1: np.arange(2)}})
    _check_error(info, TypeError, "1", "'obs'")
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize("key", ["obs/pixels", "", "/"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_write_raises_invalid_tree_error_dict_key_with_slash(tmp_path, fmt, key):
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(_store(tmp_path, fmt), {"ok": np.arange(2), key: np.arange(2)})
    _check_error(info, TypeError, repr(key))
    assert not os.path.exists(_store(tmp_path, fmt))


@pytest.mark.parametrize(
    ("fmt", "key"),
    [
        pytest.param("hdf5", "."),
        ("hdf5", ".."),
        ("npy", "."),
        ("npy", ".."),
        pytest.param("zarr", "."),
        pytest.param("zarr", ".."),
    ],
)
def test_write_dot_segment_dict_key_refused_or_contained(tmp_path, fmt, key):
    parent = tmp_path / "parent"
    parent.mkdir()
    path = str(parent / SUFFIXES[fmt])
    # The sibling "x" catches a dot key that aliases another leaf's path.
    tree = {key: {"x": np.arange(3)}, "x": np.arange(3) + 10}
    try:
        gr.write(path, tree)
    except gr.InvalidTreeError as e:
        assert repr(key) in str(e) and "Fix" in str(e)  # noqa: PT017 - raising is allowed
        assert os.listdir(parent) == []
        return
    # Accepted: then it must round-trip and stay inside the store.
    assert os.listdir(parent) == [SUFFIXES[fmt]]
    with gr.open_source(path) as src:
        _same(src.read_batch(np.arange(3)), tree)


def test_write_zarr_reserved_key_refused_or_round_trips(tmp_path):
    path = str(tmp_path / "x.zarr")
    tree = {"zarr.json": np.arange(3)}
    try:
        gr.write(path, tree)
    except gr.InvalidTreeError as e:
        assert "'zarr.json'" in str(e) and "Fix" in str(e)  # noqa: PT017 - raising is allowed
        return
    with gr.open_source(path) as src:
        _same(src.read_batch(np.arange(3)), tree)


@pytest.mark.parametrize(
    "tree",
    [{1: np.arange(2)}, {"a/b": np.arange(2)}, {"a": {1, 2}}],
    ids=["int-key", "slash-key", "set-leaf"],
)
def test_write_tree_structure_error_names_destination(tmp_path, tree):
    path = _store(tmp_path, "hdf5")
    with pytest.raises(gr.InvalidTreeError) as info:
        gr.write(path, tree)
    assert path in str(info.value)


# -- metadata -----------------------------------------------------------------------


def _check_metadata(text, n, keys):
    meta = json.loads(text)
    assert meta["format"] == "grain_replay"
    assert meta["version"] >= 1
    assert meta["num_records"] == n
    assert list(meta["leaves"]) == keys
    assert tree_lib.leaf_keys(meta["treedef"]) == keys


def test_hdf5_metadata_root_attr_written(tmp_path):
    path = gr.write(tmp_path / "x.h5", {"obs": {"p": np.zeros((4, 2))}, "a": np.arange(4)})
    with h5py.File(path, "r") as f:
        _check_metadata(f.attrs["grain_replay"], 4, ["obs/p", "a"])
        assert "obs/p" in f and "a" in f


def test_npy_metadata_file_written(tmp_path):
    path = gr.write(tmp_path / "x", {"obs": {"p": np.zeros((4, 2))}, "a": np.arange(4)})
    with open(os.path.join(path, "grain_replay.json")) as f:
        _check_metadata(f.read(), 4, ["obs/p", "a"])
    assert os.path.isfile(os.path.join(path, "obs", "p.npy"))
    assert os.path.isfile(os.path.join(path, "a.npy"))


def test_zarr_metadata_group_attrs_written(tmp_path):
    path = gr.write(tmp_path / "x.zarr", {"obs": {"p": np.zeros((4, 2))}, "a": np.arange(4)})
    group = zarr.open_group(path, mode="r")
    raw = group.attrs["grain_replay"]
    _check_metadata(raw if isinstance(raw, str) else json.dumps(raw), 4, ["obs/p", "a"])
    assert group["obs/p"].shape == (4, 2)
