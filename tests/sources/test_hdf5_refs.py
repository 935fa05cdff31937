"""HDF5 references out of the file (external links, VDS, external storage) and raw chunk reads."""

from __future__ import annotations

import gc
import os
import pickle
import time
from typing import Any

import h5py
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.hdf5 import raw as hdf5_raw

OBS = np.arange(40, dtype=np.float32).reshape(10, 4)
OUTSIDE = -OBS - 1


@pytest.fixture
def outside(tmp_path: Any) -> str:
    path = str(tmp_path / "outside" / "data.h5")
    os.makedirs(os.path.dirname(path))
    with h5py.File(path, "w") as f:
        f["grp/pixels"] = OUTSIDE
        f["obs"] = OUTSIDE
    return path


def _store(tmp_path: Any, name: str = "store.h5") -> str:
    return gr.write_hdf5(str(tmp_path / name), {"obs": {"pixels": OBS}, "act": np.arange(10)})


def test_external_link_on_parent_group_refused_naming_leaf_and_fix(tmp_path, outside):
    path = _store(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["obs"]
        f["obs"] = h5py.ExternalLink(outside, "/grp")
    with pytest.raises(gr.InvalidStoreError) as e:
        gr.HDF5DataSource(path)
    msg = str(e.value)
    assert path in msg and "'obs/pixels'" in msg and "allow_external=True" in msg
    assert outside in msg


def test_external_link_on_parent_group_read_from_target_when_allowed(tmp_path, outside):
    path = _store(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["obs"]
        f["obs"] = h5py.ExternalLink(outside, "/grp")
    src = gr.open_source(path, allow_external=True)
    np.testing.assert_array_equal(src.read_batch(np.arange(10))["obs"]["pixels"], OUTSIDE)
    np.testing.assert_array_equal(src[3]["act"], 3)
    # The source keeps its choice through pickling (grain workers get a pickled source).
    clone = pickle.loads(pickle.dumps(src))
    np.testing.assert_array_equal(clone.read_leaf("obs/pixels", [9]), OUTSIDE[9:])


def test_soft_link_through_external_link_refused(tmp_path, outside):
    path = _store(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["obs"]
        f["ext"] = h5py.ExternalLink(outside, "/grp")
        f["obs"] = h5py.SoftLink("/ext")
    with pytest.raises(gr.InvalidStoreError, match="allow_external=True"):
        gr.HDF5DataSource(path)


def test_soft_link_cycle_refused_without_hanging(tmp_path):
    path = _store(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["obs"]
        f["obs"] = h5py.SoftLink("/loop")
        f["loop"] = h5py.SoftLink("/obs")
    t0 = time.perf_counter()
    with pytest.raises(gr.InvalidStoreError, match="obs/pixels"):
        gr.HDF5DataSource(path)
    assert time.perf_counter() - t0 < 1.0


def test_foreign_file_with_external_link_opens_when_keys_avoid_it(tmp_path, outside):
    path = str(tmp_path / "foreign.h5")
    with h5py.File(path, "w") as f:
        f["act"] = np.arange(10)
        f["obs"] = h5py.ExternalLink(outside, "/obs")
    with pytest.raises(gr.InvalidStoreError, match=r"'obs'.*allow_external=True"):
        gr.HDF5DataSource(path)
    src = gr.HDF5DataSource(path, keys=["act"])
    assert src.keys == ["act"]
    np.testing.assert_array_equal(src.read_leaf("act", [2, 1]), [2, 1])


def test_foreign_file_external_link_to_group_lists_its_datasets_when_allowed(tmp_path, outside):
    path = str(tmp_path / "foreign.h5")
    with h5py.File(path, "w") as f:
        f["act"] = np.arange(10)
        f["obs"] = h5py.ExternalLink(outside, "/grp")
    src = gr.HDF5DataSource(path, allow_external=True)
    assert src.keys == ["act", "obs/pixels"]
    np.testing.assert_array_equal(src.read_leaf("obs/pixels", np.arange(10)), OUTSIDE)


def test_external_link_target_missing_when_allowed_raises_named_error(tmp_path, outside):
    path = _store(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["obs"]
        f["obs"] = h5py.ExternalLink(str(tmp_path / "gone.h5"), "/grp")
    with pytest.raises(gr.GrainReplayError, match=os.path.basename(path)):
        gr.HDF5DataSource(path, allow_external=True)


# -- raw chunk reads (no h5py handle kept) -------------------------------------------------


def _chunked(tmp_path: Any, n: int, chunk_rows: int, skip: set[int] = frozenset()) -> str:
    """A foreign chunked dataset ``x`` (row i = i) whose chunks in ``skip`` are never written."""
    path = str(tmp_path / "chunked.h5")
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(n, 2), dtype=np.int64, chunks=(chunk_rows, 2))
        d.attrs["note"] = "filler"
        # Interleaved small writes: the chunks do not lie back to back in the file.
        for c in reversed(range(-(-n // chunk_rows))):
            if c not in skip:
                lo, hi = c * chunk_rows, min(n, (c + 1) * chunk_rows)
                d[lo:hi] = np.repeat(np.arange(lo, hi)[:, None], 2, 1)
                f.create_dataset(f"pad/{c}", data=np.zeros(3))
    return path


def test_many_scattered_chunks_read_raw_without_h5py_handle(tmp_path, monkeypatch):
    monkeypatch.setattr(hdf5_raw, "MAX_RUNS", 8)
    path = _chunked(tmp_path, 100, 3)
    src = gr.HDF5DataSource(path, keys=["x"])
    idx = np.array([99, 0, 50, 50, 3])
    np.testing.assert_array_equal(src.read_leaf("x", idx)[:, 0], idx)
    handle = src._get_handle()
    assert type(handle.readers["x"]).__name__ == "ChunkedLeafReader"
    assert handle.file is None  # a ReplayWriter in this process can open the file


def test_unwritten_chunks_read_as_fill_value_like_h5py(tmp_path):
    path = _chunked(tmp_path, 20, 4, skip={1, 3})
    src = gr.HDF5DataSource(path, keys=["x"])
    with h5py.File(path, "r") as f:
        want = f["x"][:]
    np.testing.assert_array_equal(src.read_leaf("x", np.arange(20)), want)
    assert src._get_handle().file is None


def test_raw_chunk_read_of_truncated_file_raises_named_error(tmp_path, monkeypatch):
    monkeypatch.setattr(hdf5_raw, "MAX_RUNS", 1)
    path = _chunked(tmp_path, 100, 3)
    src = gr.HDF5DataSource(path, keys=["x"])
    src.read_leaf("x", [0])
    os.truncate(path, 2048)
    with pytest.raises(gr.InvalidStoreError, match="'x'"):
        src.read_leaf("x", [99])


# -- opens retried while another process writes the file ------------------------------------


def test_open_retried_while_file_changes(tmp_path):
    path = str(tmp_path / "f.h5")
    open(path, "wb").close()
    calls = []

    def attempt() -> str:
        calls.append(1)
        if len(calls) < 3:
            with open(path, "ab") as f:  # the "writer" moves on while we fail
                f.write(b"x")
            raise OSError("truncated file")
        return "ok"

    assert hdf5_raw.retry_while_written(path, attempt) == "ok"
    assert len(calls) == 3


def test_open_of_static_broken_file_fails_at_once(tmp_path):
    path = str(tmp_path / "f.h5")
    open(path, "wb").close()
    old = time.time() - 60
    os.utime(path, (old, old))
    calls = []

    def attempt() -> None:
        calls.append(1)
        raise ValueError("corrupt")

    with pytest.raises(ValueError, match="corrupt"):
        hdf5_raw.retry_while_written(path, attempt)
    assert len(calls) == 1


def test_reader_still_running_after_refresh_reads_its_own_file(tmp_path):
    # A reader used by another thread while refresh() closes its handle must keep
    # its descriptor: a recycled descriptor number would read another file.
    path = str(tmp_path / "a.h5")
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(100, 4), chunks=(10, 4), dtype="f4")
        d[:50] = np.arange(200, dtype="f4").reshape(50, 4)  # some chunks unwritten: pread
    src = gr.HDF5DataSource(path)
    stale = src._get_handle().readers["x"]
    src.refresh()
    other = tmp_path / "other.bin"
    other.write_bytes(np.full(10_000, 7.0, "f4").tobytes())
    fds = [os.open(other, os.O_RDONLY) for _ in range(4)]  # would take the freed numbers
    try:
        np.testing.assert_array_equal(stale.take(np.array([12, 99])), [[48, 49, 50, 51], [0] * 4])
    finally:
        for fd in fds:
            os.close(fd)
    del stale
    np.testing.assert_array_equal(src.read_batch([12])["x"], [[48, 49, 50, 51]])


def test_closing_a_source_releases_its_descriptors(tmp_path):
    path = str(tmp_path / "a.h5")
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(100, 4), chunks=(10, 4), dtype="f4")
        d[:50] = 1
        f.create_dataset("y", data=np.arange(100))  # contiguous: mapped, fstat-checked

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    src = gr.HDF5DataSource(path)
    gc.collect()  # earlier tests' garbage would close its descriptors during this one
    before = open_fds()
    src.read_batch([1, 2])
    assert open_fds() > before
    src.close()
    assert open_fds() == before
