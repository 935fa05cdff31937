from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
from conformance import DataSourceTests, N, flat, make_tree, slow_in_this_class
from format_checks import assert_loader_delivers_every_record, sorted_tree
from torchrl_fixture import write_dump

import grain_replay as gr
from grain_replay.store.formats import detect_format


class _TorchRLTests(DataSourceTests):
    cls = gr.TorchRLDataSource
    capacity_extra = 0
    pytree = False

    def write(self, path: str, tree: Any) -> str:
        n = len(flat(tree)["reward"])
        return write_dump(path, tree, capacity=n + self.capacity_extra, pytree=self.pytree)

    @pytest.fixture
    def tree(self) -> dict[str, Any]:
        return sorted_tree(make_tree())

    def test_spec_gives_per_record_dtype_and_shape(self, src: gr.ReplaySource) -> None:
        assert src.spec["obs/pixels"].shape == (3, 4)
        assert src.spec["obs/pixels"].dtype == np.uint8
        assert src.spec["action"].shape == ()
        assert list(src.spec) == ["action", "done", "obs/pixels", "obs/vec", "reward"]


class TestTorchRLPartlyFilled(_TorchRLTests):
    capacity_extra = 40  # only the rows storage_metadata.json counts are records

    def test_unfilled_rows_are_not_records(self, src: gr.ReplaySource) -> None:
        assert len(src) == N
        with pytest.raises(IndexError, match=str(N)):
            src[N]


class TestTorchRLPytree(_TorchRLTests):
    # Grain's worker loader (seconds of spawns): make test runs it on TestTorchRLPartlyFilled.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        DataSourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    pytree = True  # a storage of a dict of tensors (no TensorDict): storage_metadata.json


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_and_sharded_device_put(tmp_path: Any, workers: int) -> None:
    tree = make_tree(64)
    tree["index"] = np.arange(64, dtype=np.int64)
    ml_dtypes = pytest.importorskip("ml_dtypes")  # bfloat16 leaves cross the worker pipe too
    tree["hidden"] = np.linspace(0, 1, 64 * 2).reshape(64, 2).astype(ml_dtypes.bfloat16)
    src = gr.TorchRLDataSource(write_dump(str(tmp_path / "l"), tree, capacity=100))
    assert_loader_delivers_every_record(src, "index", workers=workers)


def test_wrapped_circular_buffer_reads_oldest_first(tmp_path: Any) -> None:
    capacity, written = 10, 14  # 14 rows written into 10 slots: slots 0-3 overwritten
    chrono = np.arange(written, dtype=np.int64)[-capacity:]  # rows 4..13, oldest first
    cursor = written % capacity
    slots = np.empty(capacity, np.int64)
    slots[(np.arange(capacity) + cursor) % capacity] = chrono  # where the writer put them
    obs = (slots[:, None] * np.ones((1, 3))).astype(np.float32)
    path = write_dump(
        str(tmp_path / "rb"),
        {"step": slots, "obs": obs, "next": {"reward": slots.astype(np.float32)}},
        cursor=cursor,
        write_count=written,
    )
    src = gr.open_source(path)
    assert isinstance(src, gr.TorchRLDataSource) and len(src) == capacity
    assert src.read_batch(np.arange(capacity))["step"].tolist() == chrono.tolist()
    assert src[0]["step"] == 4 and src[-1]["step"] == 13
    got = src.read_batch([9, 0, 5])
    assert got["step"].tolist() == [13, 4, 9] and got["next"]["reward"].tolist() == [13, 4, 9]
    out = {"obs": np.empty((2, 3), np.float32)}
    src.read_into([1, 2], out)
    assert out["obs"][:, 0].tolist() == [5, 6]
    # Windows of records across the ring's wrap (slot 9 -> slot 0) read in record order.
    for _ in range(2):  # cold, then warm
        windows = src.read_windows("step", [4, 0, 6], 4)
        assert windows.tolist() == [[8, 9, 10, 11], [4, 5, 6, 7], [10, 11, 12, 13]]
        assert src.read_windows("obs", [5], 5)[0, :, 0].tolist() == [9, 10, 11, 12, 13]


def test_storage_directory_opens_too_and_nested_keys_are_leaves(tmp_path: Any) -> None:
    tree = {
        "obs": np.arange(12.0, dtype=np.float32).reshape(6, 2),
        "next": {"done": np.eye(6, dtype=bool)[:, :1]},
    }
    path = write_dump(str(tmp_path / "rb"), tree, capacity=8)
    for where in (path, os.path.join(path, "storage")):
        assert detect_format(where) == "torchrl"
        src = gr.open_source(where)
        assert src.keys == ["next/done", "obs"] and len(src) == 6
        np.testing.assert_array_equal(src.read_batch([5])["obs"], tree["obs"][[5]])
    assert gr.TorchRLDataSource(path, keys=["next"]).keys == ["next/done"]


def test_bfloat16_leaves_read_through_ml_dtypes(tmp_path: Any) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    h = (np.arange(10, dtype=np.float32) / 4).astype(ml_dtypes.bfloat16)
    src = gr.TorchRLDataSource(write_dump(str(tmp_path / "rb"), {"h": h, "x": np.arange(10)}))
    assert src.spec["h"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert src.read_batch([3, 8])["h"].astype(np.float32).tolist() == [0.75, 2.0]


def test_single_tensor_buffer_is_a_bare_leaf(tmp_path: Any) -> None:
    a = np.arange(12.0).reshape(6, 2)
    src = gr.TorchRLDataSource(write_dump(str(tmp_path / "rb"), {"": a}, pytree=True))
    np.testing.assert_array_equal(src.read_batch([5, 0]), a[[5, 0]])


# -- bad input ---------------------------------------------------------------------------


def _edit_meta(path: str, key: str, **change: Any) -> None:
    file = os.path.join(path, "storage", "meta.json")
    with open(file) as f:
        meta = json.load(f)
    meta[key].update(change)
    with open(file, "w") as f:
        json.dump(meta, f)


def test_unknown_torch_dtype_names_file_leaf_and_fix(tmp_path: Any) -> None:
    path = write_dump(str(tmp_path / "rb"), {"a": np.arange(4), "q": np.arange(4, dtype=np.int8)})
    _edit_meta(path, "q", dtype="torch.qint8")
    with pytest.raises(
        gr.InvalidStoreError, match=r"meta\.json: leaf 'q' has dtype 'torch\.qint8'.*keys="
    ):
        gr.TorchRLDataSource(path)


def test_truncated_memmap_file_names_it(tmp_path: Any) -> None:
    path = write_dump(str(tmp_path / "rb"), {"a": np.arange(100), "b": np.arange(100)})
    with open(os.path.join(path, "storage", "b.memmap"), "r+b") as f:
        f.truncate(80)
    src = gr.TorchRLDataSource(path)
    with pytest.raises(gr.InvalidStoreError, match=r"b\.memmap: leaf 'b'.*truncated"):
        src.read_batch([0])


def test_jagged_multidim_and_missing_dumps_are_refused(tmp_path: Any) -> None:
    path = write_dump(str(tmp_path / "rb"), {"a": np.arange(4), "j": np.arange(4)})
    _edit_meta(path, "j", is_nested=True)
    with pytest.raises(gr.InvalidStoreError, match=r"'j' is a nested \(jagged\) tensor"):
        gr.TorchRLDataSource(path)
    assert gr.TorchRLDataSource(path, keys=["a"]).keys == ["a"]  # keys= leaves it out
    path2 = write_dump(str(tmp_path / "rb2"), {"a": np.arange(4)})
    file = os.path.join(path2, "storage", "meta.json")
    with open(file) as f:
        meta = json.load(f)
    meta["shape"] = [2, 2]
    with open(file, "w") as f:
        json.dump(meta, f)
    with pytest.raises(gr.InvalidStoreError, match=r"batch shape is \[2, 2\].*ndim=1"):
        gr.TorchRLDataSource(path2)
    with pytest.raises(FileNotFoundError, match=r"ReplayBuffer\.dumps"):
        gr.TorchRLDataSource(str(tmp_path / "nothing"))


def test_filled_length_past_the_capacity_is_refused(tmp_path: Any) -> None:
    path = write_dump(str(tmp_path / "rb"), {"a": np.arange(4)})
    with open(os.path.join(path, "storage", "storage_metadata.json"), "w") as f:
        json.dump({"metadata": {}, "is_pytree": False, "len": 9}, f)
    with pytest.raises(gr.InvalidStoreError, match="len=9"):
        gr.TorchRLDataSource(path)
