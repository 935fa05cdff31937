"""Local Zarr stores whose files lie, block or lead outside: refused, naming file and leaf."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import pytest

import grain_replay as gr

zarr = pytest.importorskip("zarr")
codecs = pytest.importorskip("zarr.codecs")

pytestmark = pytest.mark.timeout(60)

N = 300


def _tree() -> dict[str, np.ndarray]:
    return {
        "obs": np.arange(N * 4, dtype="f4").reshape(N, 4),
        "act": np.arange(N, dtype="i8"),
    }


def _store(tmp_path: Any, name: str = "s.zarr", **kwargs: Any) -> str:
    return gr.write_zarr(str(tmp_path / name), _tree(), chunk_rows=128, **kwargs)


def _chunk(path: str, leaf: str = "obs", c: int = 0) -> str:
    parts = ["c", str(c)] + (["0"] if leaf == "obs" else [])
    return os.path.join(path, leaf, *parts)


def _edit_array_json(path: str, leaf: str, fn: Any) -> None:
    f = os.path.join(path, leaf, "zarr.json")
    with open(f) as fh:
        meta = json.load(fh)
    fn(meta)
    with open(f, "w") as fh:
        json.dump(meta, fh)


def _first_read(path: str, **kwargs: Any) -> None:
    with gr.ZarrDataSource(path, **kwargs) as src:
        src.read_batch([0, N - 1])


# -- metadata that lies ------------------------------------------------------------------------


def test_array_dtype_other_than_metadata_dtype_refused_at_open(tmp_path: Any) -> None:
    path = _store(tmp_path)
    _edit_array_json(path, "obs", lambda m: m.__setitem__("data_type", "float64"))
    with pytest.raises(gr.InvalidStoreError) as e:
        gr.ZarrDataSource(path)
    msg = str(e.value)
    assert os.path.join(path, "obs", "zarr.json") in msg and "'obs'" in msg
    assert "float64" in msg and "float32" in msg and "re-create" in msg


def test_giant_chunk_shape_refused_at_open_without_allocating(tmp_path: Any) -> None:
    path = _store(tmp_path)
    _edit_array_json(
        path,
        "obs",
        lambda m: m["chunk_grid"]["configuration"].__setitem__("chunk_shape", [2**60, 4]),
    )
    with pytest.raises(gr.InvalidStoreError, match="'obs' declares chunks of shape") as e:
        gr.ZarrDataSource(path)
    assert "chunk_rows" in str(e.value)


@pytest.mark.parametrize("content", [b"", b'{"zarr_format": 3, "node', b"\x00\xff binary"])
def test_unreadable_array_json_names_file_and_leaf(tmp_path: Any, content: bytes) -> None:
    path = _store(tmp_path)
    f = os.path.join(path, "act", "zarr.json")
    with open(f, "wb") as fh:
        fh.write(content)
    with pytest.raises(gr.InvalidStoreError) as e:
        gr.ZarrDataSource(path)
    assert f in str(e.value) and "'act'" in str(e.value)


# -- raw (memory-mapped) chunk files of the wrong size -------------------------------------------


@pytest.mark.parametrize("cut", ["empty", "in_rows", "in_padding"])
def test_raw_chunk_of_wrong_size_refused_naming_chunk_and_leaf(tmp_path: Any, cut: str) -> None:
    path = _store(tmp_path)
    last = _chunk(path, c=2)  # rows 256..299 of a 128-row chunk: the rest is padding
    size = os.path.getsize(last)
    os.truncate(last, {"empty": 0, "in_rows": 100, "in_padding": size - 16}[cut])
    with pytest.raises(gr.InvalidStoreError) as e:
        _first_read(path)
    assert last in str(e.value) and "'obs'" in str(e.value) and str(size) in str(e.value)


@pytest.mark.parametrize("rows", [64, 512])
def test_chunk_shape_that_lies_about_raw_chunks_refused(tmp_path: Any, rows: int) -> None:
    path = _store(tmp_path)
    _edit_array_json(
        path,
        "obs",
        lambda m: m["chunk_grid"]["configuration"].__setitem__("chunk_shape", [rows, 4]),
    )
    with pytest.raises(gr.InvalidStoreError, match="'obs'"):
        _first_read(path)


def test_missing_raw_chunk_still_reads_fill_value(tmp_path: Any) -> None:
    path = _store(tmp_path)
    os.remove(_chunk(path, c=1))
    with gr.ZarrDataSource(path) as src:
        got = src.read_flat([0, 130, 299])["obs"]
    np.testing.assert_array_equal(got[[0, 2]], _tree()["obs"][[0, 299]])
    np.testing.assert_array_equal(got[1], 0)


def test_sharded_chunk_garbage_names_leaf(tmp_path: Any) -> None:
    """Arrays zarr decodes itself (sharding): codec errors still name store and leaf."""
    path = str(tmp_path / "sh.zarr")
    group = zarr.open_group(path, mode="w", zarr_format=3)
    arr = group.create_array(
        "x",
        shape=(64, 4),
        dtype="f4",
        chunks=(8, 4),
        shards=(32, 4),
        compressors=codecs.ZstdCodec(),
    )
    arr[...] = 1.0
    shard = os.path.join(path, "x", "c", "0", "0")
    with open(shard, "r+b") as fh:
        fh.write(b"\xff" * 64)
    with gr.ZarrDataSource(path) as src, pytest.raises(gr.InvalidStoreError) as e:
        src.read_batch([0, 40])
    assert path in str(e.value) and "'x'" in str(e.value)


# -- FIFOs: refused before anything opens them ---------------------------------------------------


@pytest.mark.parametrize("where", ["zarr.json", "obs/zarr.json", "obs/c/0/0"])
def test_fifo_in_place_of_a_store_file_refused_without_blocking(tmp_path: Any, where: str) -> None:
    path = _store(tmp_path)
    f = os.path.join(path, *where.split("/"))
    os.remove(f)
    os.mkfifo(f)
    with pytest.raises(gr.InvalidStoreError, match="not a regular file") as e:
        _first_read(path)
    assert f in str(e.value)


def test_fifo_array_json_in_foreign_group_refused_without_blocking(tmp_path: Any) -> None:
    path = str(tmp_path / "f.zarr")
    group = zarr.open_group(path, mode="w", zarr_format=3)
    group.create_array("a", shape=(10,), dtype="i4")
    group.create_group("g").create_array("b", shape=(10,), dtype="i4")
    f = os.path.join(path, "g", "b", "zarr.json")
    os.remove(f)
    os.mkfifo(f)
    with pytest.raises(gr.InvalidStoreError, match="not a regular file") as e:
        gr.ZarrDataSource(path)
    assert f in str(e.value)


# -- symlinks out of the store ------------------------------------------------------------------


def _outside(tmp_path: Any) -> str:
    return gr.write_zarr(
        str(tmp_path / "elsewhere" / "o.zarr"), {"obs": -_tree()["obs"], "act": _tree()["act"]},
        chunk_rows=128,
    )  # fmt: skip


@pytest.mark.parametrize("what", ["array", "chunk_folder", "chunk"])
def test_symlink_out_of_store_refused_unless_allow_external(tmp_path: Any, what: str) -> None:
    path, other = _store(tmp_path), _outside(tmp_path)
    link = {
        "array": os.path.join(path, "obs"),
        "chunk_folder": os.path.join(path, "obs", "c"),
        "chunk": _chunk(path),
    }[what]
    target = os.path.join(other, os.path.relpath(link, path))
    shutil.rmtree(link) if os.path.isdir(link) else os.remove(link)
    os.symlink(target, link)
    with pytest.raises(gr.InvalidStoreError, match="allow_external=True") as e:
        _first_read(path)
    assert link in str(e.value) and "'obs'" in str(e.value)
    with gr.open_source(path, allow_external=True) as src:
        np.testing.assert_array_equal(src.read_flat([0, 5])["obs"], -_tree()["obs"][[0, 5]])


def test_symlink_inside_store_reads(tmp_path: Any) -> None:
    path = _store(tmp_path)
    os.remove(_chunk(path, c=1))
    os.symlink(_chunk(path, c=0), _chunk(path, c=1))  # chunk 1 now holds chunk 0's rows
    with gr.ZarrDataSource(path) as src:
        np.testing.assert_array_equal(src.read_flat([128])["obs"], _tree()["obs"][[0]])


def test_foreign_group_array_symlinked_outside_refused(tmp_path: Any) -> None:
    path = str(tmp_path / "f.zarr")
    zarr.open_group(path, mode="w", zarr_format=3).create_array("a", shape=(10,), dtype="i4")
    other = str(tmp_path / "elsewhere.zarr")
    zarr.open_group(other, mode="w", zarr_format=3).create_array("b", shape=(10,), dtype="i4")
    os.symlink(os.path.join(other, "b"), os.path.join(path, "b"))
    with pytest.raises(gr.InvalidStoreError, match="allow_external=True"):
        gr.ZarrDataSource(path)
    assert gr.ZarrDataSource(path, allow_external=True).keys == ["a", "b"]


# -- byte order ----------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_big_endian_leaf_round_trips_through_write(tmp_path: Any, compression: Any) -> None:
    tree = {"be": np.arange(N, dtype=">f4"), "le": np.arange(N, dtype="<i4")}
    path = gr.write_zarr(str(tmp_path / "be.zarr"), tree, compression=compression)
    with gr.ZarrDataSource(path) as src:
        assert src.spec["be"].dtype == np.dtype(">f4")
        got = src.read_flat([0, 7, N - 1])
        assert src[7]["be"] == 7.0
    np.testing.assert_array_equal(got["be"], [0.0, 7.0, N - 1.0])
    np.testing.assert_array_equal(got["le"], [0, 7, N - 1])


def test_big_endian_bytes_codec_reads_values_not_swapped(tmp_path: Any) -> None:
    path = str(tmp_path / "bc.zarr")
    group = zarr.open_group(path, mode="w", zarr_format=3)
    arr = group.create_array(
        "x", shape=(N, 2), dtype="f4", chunks=(128, 2), compressors=None,
        serializer=codecs.BytesCodec(endian="big"),
    )  # fmt: skip
    arr[...] = np.arange(N * 2, dtype="f4").reshape(N, 2)
    with gr.ZarrDataSource(path) as src:
        np.testing.assert_array_equal(src.read_flat([3])["x"], [[6.0, 7.0]])


# -- the same checks over S3 ----------------------------------------------------------------------


def _lie_garbage(path: str) -> None:
    with open(os.path.join(path, "obs", "zarr.json"), "wb") as fh:
        fh.write(b"\x00\xff binary")


def _lie_dtype(path: str) -> None:
    _edit_array_json(path, "obs", lambda m: m.__setitem__("data_type", "float64"))


def _lie_giant_chunk(path: str) -> None:
    _edit_array_json(
        path,
        "obs",
        lambda m: m["chunk_grid"]["configuration"].__setitem__("chunk_shape", [2**60, 4]),
    )


@pytest.fixture(scope="module")
def s3() -> Any:
    s3_server = pytest.importorskip("s3_server")
    reason = s3_server.moto_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    server = s3_server.S3Server().start()
    server.create_bucket("zarr-checks")
    yield server
    server.stop()


@pytest.mark.parametrize(
    "lie, words",
    [
        (_lie_garbage, "cannot be read"),
        (_lie_dtype, "float64"),
        (_lie_giant_chunk, "declares chunks"),
    ],
)
def test_remote_array_metadata_that_lies_names_url_file_and_leaf(
    tmp_path: Any, s3: Any, lie: Any, words: str
) -> None:
    path = _store(tmp_path)
    lie(path)
    url = s3.upload(path, "zarr-checks", f"{lie.__name__}/s.zarr")
    with pytest.raises(gr.InvalidStoreError, match=words) as e:
        gr.ZarrDataSource(url, storage_options=s3.storage_options(), retries=0)
    assert f"{url}/obs/zarr.json" in str(e.value) and "'obs'" in str(e.value)
