"""The HDF5 ReplayWriter's metadata attribute grows safely as checksums accumulate."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np

import grain_replay as gr
from grain_replay.store import layout as layout_lib
from grain_replay.store.integrity import verify_source


def _block(i: int, rows: int = 3000) -> dict[str, Any]:
    # 20 leaves of 1-byte rows: a checksum block per ~1M rows each, so the
    # metadata grows with every commit only through N; many leaves make it long.
    return {f"leaf{k:02d}": np.full((rows, 400), (i + k) % 251, np.uint8) for k in range(20)}


def test_metadata_attribute_grows_and_store_stays_readable(tmp_path: Any) -> None:
    path = str(tmp_path / "g.h5")
    with gr.ReplayWriter(path) as w:
        w.append(_block(0))
        w.flush()
        with h5py.File(path, "r", locking=False) as f:
            first = f.attrs.get_id(layout_lib.METADATA_ATTR).dtype.itemsize
        for i in range(1, 12):
            w.append(_block(i))
            w.flush()
            assert len(gr.open_source(path)) == 3000 * (i + 1)
    with h5py.File(path, "r", locking=False) as f:
        assert f.attrs.get_id(layout_lib.METADATA_ATTR).dtype.itemsize > first
        assert layout_lib.METADATA_ATTR_NEXT not in f.attrs
    src = gr.open_source(path)
    assert verify_source(src, src.checksums).ok
    np.testing.assert_array_equal(src[-1]["leaf05"], np.full(400, (11 + 5) % 251, np.uint8))


def test_commit_interrupted_while_growing_is_recovered(tmp_path: Any) -> None:
    path = str(tmp_path / "g.h5")
    with gr.ReplayWriter(path) as w:
        w.append(_block(0))
    src_rows = len(gr.open_source(path))
    # Simulate a crash after the grown copy was written but before the main
    # attribute was replaced: readers and the next writer use the copy.
    with h5py.File(path, "r+", locking=False) as f:
        f.attrs[layout_lib.METADATA_ATTR_NEXT] = f.attrs[layout_lib.METADATA_ATTR]
        del f.attrs[layout_lib.METADATA_ATTR]
    assert len(gr.open_source(path)) == src_rows
    with gr.ReplayWriter(path) as w:
        w.append(_block(1))
    with h5py.File(path, "r", locking=False) as f:
        assert layout_lib.METADATA_ATTR_NEXT not in f.attrs
    assert len(gr.open_source(path)) == 2 * src_rows
