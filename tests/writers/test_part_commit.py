"""A writer part's commit: segments opened as made, a flush in three rounds of fsync, and
what a flush that fails before its commit point leaves (the last commit, intact)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from parts_child import check_rows, make_rows

import grain_replay as gr
from grain_replay.errors import StoreExistsError
from grain_replay.store import layout as layout_lib
from grain_replay.store import parts as parts_lib
from grain_replay.store.filesync import fsync_path as fsync_path_
from grain_replay.writers import part_segments, parts_writer
from grain_replay.writers.backends import (
    Backend,
    HDF5Backend,
    NpyBackend,
    NpySegmentBackend,
    ZarrBackend,
)
from grain_replay.writers.parts_writer import PartWriter

FORMATS = ["npy", "hdf5", "zarr"]
BACKENDS: list[type[Backend]] = [NpyBackend, NpySegmentBackend, HDF5Backend, ZarrBackend]


def _tree(n: int, start: int = 0) -> dict[str, Any]:
    seq = np.arange(start, start + n, dtype=np.int64)
    return {"obs": {"pixels": (seq[:, None] * np.arange(3)).astype(np.float32)}, "seq": seq}


def _meta(tree: dict[str, Any]) -> layout_lib.StoreMetadata:
    arrays, treedef, _ = layout_lib.check_leaves(tree, where="test")
    leaves = {k: layout_lib.LeafSpec(a.dtype, tuple(a.shape[1:])) for k, a in arrays.items()}
    return layout_lib.StoreMetadata(0, leaves, treedef)


def _suffix(cls: type[Backend]) -> str:
    return {HDF5Backend: ".h5", ZarrBackend: ".zarr"}.get(cls, "")


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_create_open_appends_and_reopens(tmp_path: Path, cls: type[Backend], sync: bool) -> None:
    tree = _tree(7)
    arrays, _, _ = layout_lib.check_leaves(tree, where="test")
    meta = _meta(tree)
    made = str(tmp_path / f"made{_suffix(cls)}")
    backend = cls.create_open(made, meta, None, None, sync=sync)
    try:
        backend.write(arrays, 0)
        backend.commit(7, None)
    finally:
        backend.close()
    on_disk = cls.read_metadata(made)
    assert on_disk is not None and on_disk.num_records == 7
    assert on_disk.leaves == meta.leaves
    if cls is not NpySegmentBackend:  # a segment's rows start a page in: readers map them
        src = gr.open_source(made)
        batch = src.read_batch(np.arange(7))
        np.testing.assert_array_equal(batch["seq"], tree["seq"])
        np.testing.assert_array_equal(batch["obs"]["pixels"], tree["obs"]["pixels"])
    reopened = cls(made, on_disk)  # and it reopens as any store made by create()
    try:
        np.testing.assert_array_equal(reopened.read("seq", 0, 7), tree["seq"])
    finally:
        reopened.close()
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(made)]  # no .partial left


@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
def test_create_open_refuses_an_existing_path(
    tmp_path: Path, cls: type[Backend], sync: bool
) -> None:
    meta = _meta(_tree(1))
    made = str(tmp_path / f"made{_suffix(cls)}")
    cls.create_open(made, meta, None, None, sync=sync).close()
    with pytest.raises(StoreExistsError, match="already exists"):
        cls.create_open(made, meta, None, None, sync=sync).close()
    assert cls.read_metadata(made) is not None  # untouched


def test_a_segment_is_made_without_reading_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a just-made segment was read back")

    monkeypatch.setattr("grain_replay.writers.backends.npy.read_npy_header", refuse)
    w = PartWriter(str(tmp_path / "s"), "npy", writer_id="a", capacity=None,
                   segment_rows=10, chunk_rows=None, compression=None)  # fmt: skip
    try:
        w.append(make_rows("a", 0, 35))  # four segments
        assert w.flush() == 35
    finally:
        w.close()
    batch = gr.open_source(str(tmp_path / "s")).read_batch(np.arange(35))
    np.testing.assert_array_equal(batch["seq"], np.arange(35))


def test_a_flush_syncs_in_three_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rounds: list[str] = []
    real_all, real_dirs, real_path = parts_writer.fsync_all, parts_writer.fsync_dirs, fsync_path_

    def fsync_all(fds: list[int]) -> None:
        rounds.append(f"files:{len(fds)}")
        real_all(fds)

    def fsync_dirs(paths: list[str]) -> None:
        rounds.append(f"dirs:{len(paths)}")
        real_dirs(paths)

    def fsync_path(path: str) -> None:
        rounds.append("path")
        real_path(path)

    w = PartWriter(str(tmp_path / "s"), "npy", writer_id="a", capacity=None,
                   segment_rows=None, chunk_rows=None, compression=None)  # fmt: skip
    try:
        w.append(make_rows("a", 0, 5))
        w.flush()
        monkeypatch.setattr(parts_writer, "fsync_all", fsync_all)
        monkeypatch.setattr(parts_writer, "fsync_dirs", fsync_dirs)
        monkeypatch.setattr("grain_replay.store.filesync.fsync_path", fsync_path)
        w.append(make_rows("a", 5, 5))
        w.flush()
    finally:
        monkeypatch.undo()
        w.close()
    # Three leaves, the segment's metadata and the manifest; the segment's folder; the
    # writer's folder (the manifest's rename).
    assert rounds == ["files:5", "dirs:1", "path"]


def test_a_flush_at_interpreter_exit_still_syncs_every_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At exit, threading's hooks shut every thread pool before a non-daemon thread (an
    actor closing its writer) is joined: the fsync pool refuses work ("cannot schedule new
    futures after interpreter shutdown", seen in the README's actor/learner example). The
    flush syncs its files one after another instead, and commits."""
    import concurrent.futures

    from grain_replay.writers.backends import durable

    shut = concurrent.futures.ThreadPoolExecutor(1)
    shut.shutdown()
    monkeypatch.setattr(durable, "_FSYNC_POOL", (os.getpid(), shut))
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path, writer_id="a", capacity=100) as w:
        w.append(make_rows("a", 0, 5))
        w.flush()
    assert len(synced) >= 5  # three leaves, the segment's metadata, the manifest
    check_rows(gr.open_source(path).read_batch(np.arange(5)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("fail", ["files", "dirs", "publish"])
def test_a_flush_failing_before_its_commit_point_keeps_the_last_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, fail: str
) -> None:
    path = str(tmp_path / "s")
    w = PartWriter(path, fmt, writer_id="a", capacity=None, segment_rows=8,
                   chunk_rows=None, compression=None)  # fmt: skip
    w.append(make_rows("a", 0, 12))
    assert w.flush() == 12
    w.append(make_rows("a", 12, 9))  # the tail segment grows, a new one is made

    def boom(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    target = {"files": "fsync_all", "dirs": "fsync_dirs", "publish": "publish_text"}[fail]
    if fmt != "npy" and fail == "dirs":
        target = "fsync_all"  # HDF5 and Zarr segments leave no folder to sync
    with monkeypatch.context() as m:
        m.setattr(parts_writer, target, boom)
        with pytest.raises(OSError, match="No space left"):
            w.flush()
    assert w.committed == 12 and w.pending == 9
    wdir = parts_lib.writer_dir(path, "a")
    assert not [n for n in os.listdir(wdir) if n.endswith(".partial")]  # the staged manifest
    src = gr.open_source(path)
    assert len(src) == 12
    np.testing.assert_array_equal(src.read_batch(np.arange(12))["seq"], np.arange(12))
    # The next flush commits all that was appended, once.
    assert w.flush() == 21
    src.refresh()
    batch = src.read_batch(np.arange(21))
    np.testing.assert_array_equal(batch["seq"], np.arange(21))
    check_rows(batch)
    w.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_writer_dead_before_the_commit_point_reopens_after_the_last_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """Segments staged past the manifest (headers and metadata ahead of it) are cut back."""
    path = str(tmp_path / "s")
    w = PartWriter(path, fmt, writer_id="a", capacity=None, segment_rows=8,
                   chunk_rows=None, compression=None)  # fmt: skip
    w.append(make_rows("a", 0, 12))
    w.flush()
    w.append(make_rows("a", 12, 3))

    def die(*args: Any) -> None:
        raise KeyboardInterrupt  # as a kill right before the manifest's rename

    with monkeypatch.context() as m:
        m.setattr(parts_writer, "publish_text", die)
        with pytest.raises(KeyboardInterrupt):
            w.flush()
    w.abandon()
    seg = os.path.join(parts_lib.writer_dir(path, "a"), parts_lib.segment_name(8, fmt))
    ahead = part_segments.segment_backend(fmt).read_metadata(seg)
    assert ahead is not None and ahead.num_records == 7  # the tail segment, staged
    src = gr.open_source(path)
    assert len(src) == 12
    w = PartWriter(path, fmt, writer_id="a", capacity=None, segment_rows=8,
                   chunk_rows=None, compression=None)  # fmt: skip
    assert w.committed == 12
    w.append(make_rows("a", 12, 10, run=1))
    assert w.flush() == 22
    w.close()
    src.refresh()
    batch = src.read_batch(np.arange(22))
    np.testing.assert_array_equal(batch["seq"], np.arange(22))
    np.testing.assert_array_equal(batch["tag"][12:] >> 16, np.ones(10))
    check_rows(batch)
