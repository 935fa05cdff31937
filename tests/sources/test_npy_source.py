from __future__ import annotations

import os
import subprocess
import sys
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


def _open_fds(under: str) -> int:
    """Descriptors of this process open on files below ``under`` (others' tests don't count)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        count += target.startswith(under + os.sep)
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_npy_holds_one_descriptor_per_leaf_file(tmp_path):
    tree = {f"leaf{i}": np.arange(40, dtype=np.float32).reshape(20, 2) + i for i in range(5)}
    store = str(tmp_path / "s")
    gr.write_npy(store, tree)
    src = gr.NpyDataSource(store)
    assert _open_fds(store) == 0
    batch = src.read_batch([3, 0, 3])
    assert _open_fds(store) == 5  # one (the map's own) per leaf file; it was 10
    np.testing.assert_array_equal(batch["leaf4"], tree["leaf4"][[3, 0, 3]])
    src.close()
    del batch
    import gc

    gc.collect()
    assert _open_fds(store) == 0


_MANY_LEAVES_CHILD = """
import resource, sys
import numpy as np
import grain_replay as gr

resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
path = sys.argv[1]
if __name__ == "__main__":
    src = gr.NpyDataSource(path)
    loader = gr.make_data_loader(src, batch_size=16, shuffle=True, seed=1, worker_count=2)
    seen = np.concatenate([b["leaf599"] for b in loader])
    assert sorted(seen.tolist()) == [599 + i for i in range(64)], seen
    print("OK", len(seen))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux descriptors")
def test_npy_store_with_600_leaves_reads_with_2_workers_under_ulimit_1024(tmp_path):
    gr.write_npy(
        tmp_path / "wide", {f"leaf{i}": np.arange(64, dtype=np.int32) + i for i in range(600)}
    )
    script = tmp_path / "child.py"
    script.write_text(_MANY_LEAVES_CHILD)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "wide")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["OK", "64"]
