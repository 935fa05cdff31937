from __future__ import annotations

from typing import Any

import h5py
import numpy as np
import pytest
from conformance import DataSourceTests, make_tree, slow_in_this_class

import grain_replay as gr


class TestHDF5Contiguous(DataSourceTests):
    cls = gr.HDF5DataSource
    suffix = ".h5"

    def write(self, path: str, tree: Any) -> str:
        return gr.write_hdf5(path, tree)


class TestHDF5Compressed(DataSourceTests):
    # Grain's worker loader (seconds of spawns): make test runs it on TestHDF5Contiguous.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        DataSourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    cls = gr.HDF5DataSource
    suffix = ".h5"

    def write(self, path: str, tree: Any) -> str:
        return gr.write_hdf5(path, tree, compression="gzip", chunk_rows=7)


def test_contiguous_dataset_is_memory_mapped(tmp_path: Any) -> None:
    src = gr.HDF5DataSource(gr.write_hdf5(str(tmp_path / "a.h5"), make_tree()))
    src[0]
    reader = src._handle.readers["obs/vec"]
    assert type(reader).__name__ == "ArrayReader"


def test_compressed_dataset_decodes_each_chunk_once_per_batch(tmp_path: Any) -> None:
    tree = make_tree(200)
    src = gr.HDF5DataSource(
        gr.write_hdf5(str(tmp_path / "c.h5"), tree, compression="lzf", chunk_rows=10)
    )
    src.read_batch([0, 1, 2, 3, 15, 15, 199])
    cache = src._handle.cache
    # 3 chunks (0, 1, 19) for each of the 5 leaves, each decoded once.
    assert cache.misses == 15 and cache.hits == 0
    src.read_batch([4, 16])
    assert cache.hits == 10


def test_cache_is_bounded(tmp_path: Any) -> None:
    tree = make_tree(400)
    path = gr.write_hdf5(str(tmp_path / "c.h5"), tree, compression="gzip", chunk_rows=4)
    src = gr.HDF5DataSource(path, cache_bytes=2048)
    for start in range(0, 400, 50):
        src.read_batch(np.arange(start, start + 50))
    assert src._handle.cache.nbytes <= 2048


def test_truncated_file_raises_invalid_store(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "t.h5"), make_tree())
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 3])
    with pytest.raises(gr.GrainReplayError, match=r"t\.h5"):
        gr.HDF5DataSource(path)[0]


def test_not_hdf5_raises_invalid_store(tmp_path: Any) -> None:
    path = tmp_path / "x.h5"
    path.write_bytes(b"hello world, not hdf5")
    with pytest.raises(gr.InvalidStoreError, match="not an HDF5 file"):
        gr.HDF5DataSource(str(path))


def test_scalar_datasets_in_foreign_files_are_skipped(tmp_path: Any) -> None:
    path = str(tmp_path / "f.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(5)
        f["version"] = 3
    src = gr.HDF5DataSource(path)
    assert list(src.spec) == ["x"]


class TestHDF5ChunkedUnaligned(DataSourceTests):
    """Unfiltered chunks that are not whole pages: memory maps per run of chunks."""

    # Grain's worker loader (seconds of spawns): make test runs it on TestHDF5Contiguous.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        DataSourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )

    cls = gr.HDF5DataSource
    suffix = ".h5"

    def write(self, path: str, tree: Any) -> str:
        return gr.write_hdf5(path, tree, chunk_rows=7)


def test_chunked_uncompressed_is_one_stitched_mapping(tmp_path: Any) -> None:
    path = gr.write_hdf5(str(tmp_path / "c.h5"), make_tree(50_000), chunk_rows=4096)
    src = gr.HDF5DataSource(path)
    src[0]
    assert all(type(r).__name__ == "ArrayReader" for r in src._handle.readers.values())


def test_unaligned_foreign_chunks_read_correctly(tmp_path: Any) -> None:
    path = str(tmp_path / "f.h5")
    data = np.arange(1000 * 3, dtype=np.float32).reshape(1000, 3)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(33, 3))
        f.create_dataset("y", data=data[:, 0], chunks=(50,))
    src = gr.HDF5DataSource(path)
    idx = np.random.default_rng(0).integers(0, 1000, 300)
    np.testing.assert_array_equal(src.read_batch(idx)["x"], data[idx])
    assert type(src._handle.readers["x"]).__name__ == "SegmentedReader"


def _open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("chunked", [False, True], ids=["contiguous", "raw-chunks"])
def test_leaves_of_one_file_share_one_descriptor(tmp_path: Any, chunked: bool) -> None:
    path = str(tmp_path / "many.h5")
    with h5py.File(path, "w") as f:  # a foreign file with many leaves
        for i in range(60):
            f.create_dataset(
                f"leaf{i}",
                data=np.arange(100, dtype=np.float32) + i,
                chunks=(25,) if chunked else None,
            )
    before = _open_fds()
    with gr.HDF5DataSource(path) as src:
        batch = src.read_batch(np.array([3, 7, 99]))
        np.testing.assert_array_equal(batch["leaf59"], [62.0, 66.0, 158.0])
        assert _open_fds() - before <= 2  # one shared descriptor (+ h5py's, if it kept one)
    assert _open_fds() <= before + 1
