"""A ``.npy`` header read while a writer rewrites it in place (torn) is read again.

A ReplayWriter rewrites each leaf file's header at every commit. A read of the page
cache racing that write can return a mix of both headers' bytes: rows 1383 from 1385
and 1393, or 100 from 999 and 1000. The reader reads such a header again; a header
that keeps disagreeing with the metadata is corruption, named.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.errors import InvalidStoreError
from grain_replay.sources import npy as npy_source
from grain_replay.store import layout as layout_lib
from grain_replay.writers.backends.durable import NPY_HEADER, npy_header


def _store(path: str, rows: int) -> None:
    with gr.ReplayWriter(path, "npy") as w:
        w.append({"obs": np.arange(rows * 12, dtype=np.float32).reshape(rows, 4, 3)})
        w.flush()


def _torn_first(monkeypatch: pytest.MonkeyPatch, torn: list[tuple[int, ...]]) -> list[str]:
    """read_npy_header as seen by the source: the shapes in ``torn`` first, then the file's."""
    real = npy_source.read_npy_header
    calls: list[str] = []

    def read(path: str, key: str, **kwargs: Any) -> Any:
        calls.append(key)
        shape, dtype, fortran, offset = real(path, key, **kwargs)
        if torn:
            return torn.pop(0), dtype, fortran, offset
        return shape, dtype, fortran, offset

    monkeypatch.setattr(npy_source, "read_npy_header", read)
    return calls


@pytest.mark.parametrize(
    "torn",
    [
        [(1383, 4, 3)],  # fewer rows than committed
        [(999, 44, 3)],  # a trailing dimension shifted by a digit more
        [(100, 4, 3), (1383, 4, 3), (1385, 4)],  # torn again and again
    ],
    ids=["rows", "trailing", "three-times"],
)
def test_a_torn_header_is_read_again_when_opening_and_refreshing(tmp_path, monkeypatch, torn):
    path = str(tmp_path / "s")
    _store(path, 1385)
    calls = _torn_first(monkeypatch, list(torn))
    src = gr.NpyDataSource(path)
    assert len(src) == 1385 and len(calls) == len(torn) + 1
    np.testing.assert_array_equal(src[1384]["obs"], np.arange(1384 * 12, 1385 * 12).reshape(4, 3))
    _torn_first(monkeypatch, list(torn))
    assert src.refresh() == 1385  # the open handle's header, then the inspection's
    np.testing.assert_array_equal(src[7]["obs"].ravel(), np.arange(84, 96))


def test_a_header_that_keeps_disagreeing_names_the_file_and_the_leaf(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    _store(path, 20)
    calls = _torn_first(monkeypatch, [(19, 4, 3)] * 100)
    with pytest.raises(
        InvalidStoreError,
        match=r"obs\.npy: leaf 'obs' holds float32\[19, 4, 3\] but the metadata says "
        r"float32\[20, \.\.\.\[4, 3\]\]\. The store is corrupt; re-create it",
    ):
        gr.NpyDataSource(path)
    assert len(calls) == npy_source._HEADER_READS


def test_a_header_broken_for_good_is_reported_after_the_reads_again(tmp_path, monkeypatch):
    path = str(tmp_path / "s")
    _store(path, 20)
    with open(os.path.join(path, "obs.npy"), "r+b") as f:
        f.write(b"\x93NUMPY\x01\x00\xf6\x00{'descr': '<f4', 'fortran_order': Nope")
    calls = _torn_first(monkeypatch, [])
    with pytest.raises(InvalidStoreError, match=r"obs\.npy: leaf 'obs' is not a valid \.npy"):
        gr.NpyDataSource(path)
    assert len(calls) == npy_source._HEADER_READS


def _rewrite_headers(file: str, rows: list[int], stop: Any) -> None:
    """Rewrites ``file``'s header in place, cycling through ``rows``, until ``stop``."""
    headers = [npy_header(np.dtype(np.float32), (n, 4, 3), NPY_HEADER) for n in rows]
    fd = os.open(file, os.O_RDWR)
    i = 0
    while not stop.is_set():
        os.pwrite(fd, headers[i % len(headers)], 0)
        i += 1


@pytest.mark.parametrize("rows", [[1385, 1393], [999, 1000]])
def test_sources_open_and_refresh_while_a_process_rewrites_the_header(tmp_path, rows):
    path = str(tmp_path / "s")
    _store(path, rows[-1])
    meta_rows = rows[0]
    # The metadata commits the fewer rows; the header runs ahead or not (both valid).
    meta_file = os.path.join(path, layout_lib.METADATA_FILE)
    meta = layout_lib.StoreMetadata.from_json(open(meta_file, "rb").read(), where=meta_file)
    with open(meta_file, "w") as f:
        f.write(dataclasses.replace(meta, num_records=meta_rows, checksums=None).to_json())
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    writer = ctx.Process(
        target=_rewrite_headers, args=(os.path.join(path, "obs.npy"), rows, stop), daemon=True
    )
    writer.start()
    opens = 0
    try:
        live = gr.NpyDataSource(path)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            src = gr.NpyDataSource(path)
            assert len(src) == meta_rows and src[-1]["obs"].shape == (4, 3)
            src.close()
            assert live.refresh() == meta_rows
            live.close()  # the next read reopens: the handle reads the header too
            assert live[0]["obs"].shape == (4, 3)
            opens += 1
    finally:
        stop.set()
        writer.join(10)
    print(f"\n{rows}: {opens} opens and refreshes beside the rewrites")
    assert opens > 100
