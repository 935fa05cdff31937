from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conformance import DataSourceTests, make_tree

import grain_replay as gr


class TestNpyDirectory(DataSourceTests):
    cls = gr.NpyDataSource

    def write(self, path: str, tree: Any) -> str:
        return gr.write_npy(path, tree)


def test_single_npy_file_is_one_unnamed_leaf(tmp_path: Any) -> None:
    arr = np.arange(30, dtype=np.int16).reshape(10, 3)
    path = str(tmp_path / "a.npy")
    np.save(path, arr)
    src = gr.NpyDataSource(path)
    assert len(src) == 10
    np.testing.assert_array_equal(src[3], arr[3])
    np.testing.assert_array_equal(src.read_batch([9, 0, 9]), arr[[9, 0, 9]])
    assert list(src.spec) == [""]


def test_object_npy_is_refused_without_unpickling(tmp_path: Any) -> None:
    path = str(tmp_path / "o.npy")
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(gr.InvalidStoreError, match="object"):
        gr.NpyDataSource(path)


def test_memory_map_is_read_only(tmp_path: Any) -> None:
    src = gr.NpyDataSource(gr.write_npy(str(tmp_path / "d"), make_tree()))
    src[0]
    arr = src._handle.readers["reward"]._array
    assert not arr.flags.writeable


def test_metadata_disagreeing_with_files_is_refused(tmp_path: Any) -> None:
    path = gr.write_npy(str(tmp_path / "d"), make_tree())
    np.save(f"{path}/reward.npy", np.zeros(5, np.float32))
    with pytest.raises(gr.InvalidStoreError, match="reward"):
        gr.NpyDataSource(path)


def test_empty_store_opens(tmp_path: Any) -> None:
    src = gr.NpyDataSource(gr.write_npy(str(tmp_path / "e"), make_tree(0)))
    assert len(src) == 0
    assert src.read_batch([])["reward"].shape == (0,)
    with pytest.raises(IndexError):
        src[0]
