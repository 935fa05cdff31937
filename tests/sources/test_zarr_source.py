from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conformance import DataSourceTests, make_tree, slow_in_this_class

import grain_replay as gr


class TestZarrDefault(DataSourceTests):
    cls = gr.ZarrDataSource
    suffix = ".zarr"

    def write(self, path: str, tree: Any) -> str:
        return gr.write_zarr(path, tree)


class TestZarrCompressedSmallChunks(DataSourceTests):
    # Grain's worker loader (seconds of spawns): make test runs it on TestZarrDefault.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        DataSourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    cls = gr.ZarrDataSource
    suffix = ".zarr"

    def write(self, path: str, tree: Any) -> str:
        return gr.write_zarr(path, tree, compression="zstd", chunk_rows=6)


def test_batch_fetches_each_chunk_once(tmp_path: Any) -> None:
    src = gr.ZarrDataSource(
        gr.write_zarr(str(tmp_path / "z.zarr"), make_tree(100), compression="gzip", chunk_rows=10)
    )
    src.read_batch([0, 9, 9, 55, 99])
    assert src._handle.cache.misses == 3 * 5


class TestZarrUncompressedUnalignedChunks(DataSourceTests):
    """Chunks that are not whole pages: one memory map per chunk file."""

    # Grain's worker loader (seconds of spawns): make test runs it on TestZarrDefault.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        DataSourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )

    cls = gr.ZarrDataSource
    suffix = ".zarr"

    def write(self, path: str, tree: Any) -> str:
        return gr.write_zarr(path, tree, chunk_rows=7)


def test_default_layout_is_one_stitched_mapping(tmp_path: Any) -> None:
    src = gr.ZarrDataSource(gr.write_zarr(str(tmp_path / "z.zarr"), make_tree(50_000)))
    src[0]
    for reader in src._handle.readers.values():
        assert type(reader).__name__ == "ArrayReader"


def test_unaligned_chunks_use_per_chunk_maps(tmp_path: Any) -> None:
    src = gr.ZarrDataSource(gr.write_zarr(str(tmp_path / "z.zarr"), make_tree(), chunk_rows=7))
    src[0]
    assert type(src._handle.readers["reward"]).__name__ == "SegmentedReader"


def test_missing_chunk_reads_fill_value(tmp_path: Any) -> None:
    import zarr

    path = str(tmp_path / "f.zarr")
    g = zarr.open_group(path, mode="w")
    a = g.create_array("x", shape=(20,), dtype="i4", chunks=(5,), compressors=None, fill_value=7)
    a[0:5] = np.arange(5)
    src = gr.ZarrDataSource(path)
    np.testing.assert_array_equal(src.read_batch([0, 4, 5, 19])["x"], [0, 4, 7, 7])


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("name", ["bare.zarr", "bare_dir"])
def test_open_source_reads_bare_zarr_array_as_one_root_leaf(tmp_path, zarr_format, name):
    import zarr

    data = np.arange(3000, dtype=np.float32).reshape(1000, 3)
    path = str(tmp_path / name)
    arr = zarr.create_array(path, shape=data.shape, chunks=(128, 3), dtype=data.dtype,
                            zarr_format=zarr_format)  # fmt: skip
    arr[:] = data
    from grain_replay.store.formats import detect_format

    assert detect_format(path) == "zarr"
    src = gr.open_source(path)
    assert isinstance(src, gr.ZarrDataSource) and len(src) == 1000
    np.testing.assert_array_equal(src.read_batch([999, 0, 5, 5]), data[[999, 0, 5, 5]])
    np.testing.assert_array_equal(src[-1], data[-1])
    batches = list(gr.make_data_loader(src, batch_size=250, seed=2))
    np.testing.assert_array_equal(np.sort(np.concatenate(batches)[:, 0]), data[:, 0])


def test_open_source_reads_zarr_v2_group_with_only_consolidated_metadata_marker(tmp_path):
    import zarr

    path = str(tmp_path / "g2")
    zarr.save_group(path, obs=np.arange(10), zarr_format=2)
    zarr.consolidate_metadata(path, zarr_format=2)
    src = gr.open_source(path)
    assert isinstance(src, gr.ZarrDataSource)
    np.testing.assert_array_equal(src.read_batch([4])["obs"], [4])
