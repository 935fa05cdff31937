from __future__ import annotations

from typing import Any

import numpy as np
from conformance import DataSourceTests, make_tree

import grain_replay as gr


class TestZarrDefault(DataSourceTests):
    cls = gr.ZarrDataSource
    suffix = ".zarr"

    def write(self, path: str, tree: Any) -> str:
        return gr.write_zarr(path, tree)


class TestZarrCompressedSmallChunks(DataSourceTests):
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
