"""A local Zarr array's chunk files and codecs, read from its metadata file as the spec says."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.zarr.checks import ChunkGuard
from grain_replay.sources.zarr.decode import chunk_decoder
from grain_replay.sources.zarr.meta import ArrayFiles, read_array_files

zarr = pytest.importorskip("zarr")
codecs = pytest.importorskip("zarr.codecs")


def _files_of_every_chunk(folder: str) -> set[str]:
    out = set()
    for where, _, names in os.walk(folder):
        out |= {
            os.path.join(where, n) for n in names if n not in ("zarr.json", ".zarray", ".zattrs")
        }
    return out


@pytest.mark.parametrize(
    ("zarr_format", "extra"),
    [
        (3, {}),
        (3, {"chunk_key_encoding": {"name": "default", "separator": "."}}),
        (3, {"chunk_key_encoding": {"name": "v2", "separator": "/"}}),
        (3, {"chunk_key_encoding": {"name": "v2", "separator": "."}}),
        (2, {}),
        (2, {"chunk_key_encoding": {"name": "v2", "separator": "/"}}),
    ],
)
def test_chunk_paths_are_the_files_zarr_wrote(
    tmp_path: Any, zarr_format: int, extra: dict[str, Any]
) -> None:
    folder = str(tmp_path / "a.zarr")
    arr = zarr.create_array(
        folder, shape=(50, 7), chunks=(8, 3), dtype="i4", zarr_format=zarr_format, **extra
    )
    arr[...] = np.arange(350).reshape(50, 7)
    files = read_array_files(folder)
    assert files is not None and files.zarr_format == zarr_format
    assert files.grid == (8, 3) and files.shape == (50, 7)
    assert set(files.paths_of_rows(0, 50)) == _files_of_every_chunk(folder)
    assert list(files.paths_of_rows(9, 16)) == [files.path((1, j)) for j in range(3)]


def test_sharded_array_grid_is_the_shard_and_not_decoded_by_us(tmp_path: Any) -> None:
    folder = str(tmp_path / "s.zarr")
    arr = zarr.create_array(folder, shape=(64, 4), chunks=(8, 4), shards=(32, 4), dtype="f4")
    arr[...] = 1.0
    files = read_array_files(folder)
    assert files is not None and files.grid == (32, 4)
    assert set(files.paths_of_rows(0, 64)) == _files_of_every_chunk(folder)
    assert chunk_decoder(files, np.dtype("f4")) is None


def _v3(folder: Any, **meta: Any) -> str:
    base: dict[str, Any] = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [10],
        "data_type": "float32",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": 0.0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }
    base.update(meta)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "zarr.json"), "w") as f:
        json.dump(base, f)
    return str(folder)


@pytest.mark.parametrize(
    "meta",
    [
        {"chunk_key_encoding": {"name": "something-else"}},
        {"chunk_key_encoding": {"name": "default", "configuration": {"separator": "-"}}},
        {"shape": "ten"},
        {"codecs": [42]},
    ],
)
def test_metadata_we_cannot_follow_returns_none(tmp_path: Any, meta: dict[str, Any]) -> None:
    assert read_array_files(_v3(tmp_path / "a", **meta)) is None


def test_unparsable_or_group_metadata_returns_none(tmp_path: Any) -> None:
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "zarr.json").write_text("{not json")
    assert read_array_files(str(folder)) is None
    (folder / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    assert read_array_files(str(folder)) is None
    assert read_array_files(str(tmp_path / "missing")) is None


def test_other_grids_have_no_computed_keys(tmp_path: Any) -> None:
    grid = {"name": "rectilinear", "configuration": {"chunk_shapes": [[4, 6]]}}
    files = read_array_files(_v3(tmp_path / "a", chunk_grid=grid))
    assert files is not None and files.grid is None
    assert chunk_decoder(files, np.dtype("f4")) is None


@pytest.mark.parametrize(
    ("codec_list", "decoded"),
    [
        ([{"name": "bytes", "configuration": {"endian": "big"}}, "zstd"], True),
        (["bytes"], False),  # a 4-byte type needs its byte order
        ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "lz4"}], False),
        ([{"name": "vlen-utf8"}], False),
        ([{"name": "transpose", "configuration": {"order": [1]}}, "bytes"], False),
    ],
)
def test_chunk_decoder_takes_only_codecs_it_decodes(
    tmp_path: Any, codec_list: list[Any], decoded: bool
) -> None:
    files = read_array_files(_v3(tmp_path / "a", codecs=codec_list))
    assert files is not None
    assert (chunk_decoder(files, np.dtype("f4")) is not None) == decoded


def test_storage_transformers_leave_the_array_to_zarr(tmp_path: Any) -> None:
    files = read_array_files(_v3(tmp_path / "a", storage_transformers=[{"name": "x"}]))
    assert isinstance(files, ArrayFiles) and not files.plain
    assert chunk_decoder(files, np.dtype("f4")) is None


# -- ChunkGuard.check_tree: every file below an array whose keys are not computed ----------


def test_check_tree_refuses_fifo_and_links_out_and_passes_a_clean_tree(tmp_path: Any) -> None:
    store = tmp_path / "store"
    root = store / "x"
    (root / "c" / "0").mkdir(parents=True)
    (root / "c" / "0" / "0").write_bytes(b"chunk")
    (root / "c" / "0" / "twin").symlink_to(root / "c" / "0" / "0")
    guard = ChunkGuard(str(store), str(root), "x", allow_external=False)
    guard.check_tree()

    outside = tmp_path / "secret"
    outside.write_bytes(b"not yours")
    (root / "c" / "0" / "1").symlink_to(outside)
    with pytest.raises(gr.InvalidStoreError, match="outside"):
        guard.check_tree()
    ChunkGuard(str(store), str(root), "x", allow_external=True).check_tree()

    os.remove(root / "c" / "0" / "1")
    os.mkfifo(root / "c" / "0" / "2")
    with pytest.raises(gr.InvalidStoreError, match="regular"):
        guard.check_tree()


def test_guard_check_names_missing_and_refuses_dangling_nothing(tmp_path: Any) -> None:
    store = tmp_path / "store"
    (store / "x").mkdir(parents=True)
    guard = ChunkGuard(str(store), str(store / "x"), "x", allow_external=False)
    assert guard.check(str(store / "x" / "c" / "0")) is False  # never written
    (store / "x" / "c").mkdir()
    (store / "x" / "c" / "0").symlink_to(store / "x" / "gone")
    assert guard.check(str(store / "x" / "c" / "0")) is False  # dangling: unwritten too
    assert guard.read(str(store / "x" / "c" / "0")) is None
