from __future__ import annotations

from typing import Any

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
