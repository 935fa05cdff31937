from __future__ import annotations

import os
from typing import Any

import pytest
from conformance import make_tree

import grain_replay as gr


@pytest.mark.parametrize(
    ("name", "cls"),
    [("a.h5", gr.HDF5DataSource), ("a.hdf5", gr.HDF5DataSource), ("a.zarr", gr.ZarrDataSource),
     ("a", gr.NpyDataSource)],
)  # fmt: skip
def test_open_source_picks_class_from_disk(tmp_path: Any, name: str, cls: type) -> None:
    path = gr.write(str(tmp_path / name), make_tree())
    assert type(gr.open_source(path)) is cls


def test_open_source_detects_content_not_suffix(tmp_path: Any) -> None:
    path = gr.write(str(tmp_path / "weird.bin"), make_tree(), format="hdf5")
    assert type(gr.open_source(path)) is gr.HDF5DataSource


def test_open_source_missing_path(tmp_path: Any) -> None:
    with pytest.raises(gr.StoreNotFoundError):
        gr.open_source(str(tmp_path / "nothing"))


def test_open_source_refuses_a_fifo_instead_of_calling_it_missing(tmp_path):
    fifo = str(tmp_path / "replay.h5")
    os.mkfifo(fifo)
    with pytest.raises(gr.InvalidStoreError, match="not a regular file"):
        gr.open_source(fifo)
