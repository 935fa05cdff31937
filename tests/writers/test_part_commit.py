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


def test_a_filled_segment_commits_in_one_round_and_the_flush_syncs_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """commit_filled (a device writer's sync thread): a filled segment's rows, headers and
    metadata in one fsync round, its folder left to the next flush, which syncs it with
    its own before the commit point (the manifest)."""
    rounds: list[str] = []
    real_all, real_dirs = parts_writer.fsync_all, parts_writer.fsync_dirs

    def fsync_all(fds: list[int]) -> None:
        rounds.append(f"files:{len(fds)}")
        real_all(fds)

    def fsync_dirs(paths: list[str]) -> None:
        rounds.append("dirs:" + ",".join(sorted(os.path.basename(p) for p in paths)))
        real_dirs(paths)

    def fsync_path(path: str) -> None:
        rounds.append(f"path:{os.path.basename(path)}")

    monkeypatch.setattr(parts_writer, "fsync_all", fsync_all)
    monkeypatch.setattr(parts_writer, "fsync_dirs", fsync_dirs)
    monkeypatch.setattr("grain_replay.store.filesync.fsync_path", fsync_path)
    path = str(tmp_path / "s")
    w = PartWriter(path, "npy", writer_id="a", capacity=None, segment_rows=8,
                   chunk_rows=None, compression=None)  # fmt: skip
    rounds.clear()  # the writer's own files, made
    w.write(*w.check(make_rows("a", 0, 11)), by_leaf=True)  # [0, 8) filled, [8, 11) open
    w.commit_filled()
    assert rounds == ["files:4"]  # three leaves and the segment's metadata; no folder
    seg0 = os.path.join(parts_lib.writer_dir(path, "a"), parts_lib.segment_name(0, "npy"))
    on_disk = NpySegmentBackend.read_metadata(seg0)
    assert on_disk is not None and on_disk.num_records == 8
    assert gr.open_source(path).segments() == []  # no manifest names it yet
    rounds.clear()
    assert w.flush() == 11
    # The open segment's files and the manifest; both folders (the filled segment's,
    # synced by no one before); the writer's folder (the manifest's rename).
    assert rounds == ["files:5", f"dirs:{parts_lib.segment_name(0, 'npy')},"
                      f"{parts_lib.segment_name(8, 'npy')}", "path:a"]  # fmt: skip
    rounds.clear()
    w.write(*w.check(make_rows("a", 11, 2)), by_leaf=True)
    assert w.flush() == 13
    assert rounds[1] == f"dirs:{parts_lib.segment_name(8, 'npy')}"  # synced once, not again
    w.close()
    batch = gr.open_source(path).read_batch(np.arange(13))
    np.testing.assert_array_equal(batch["seq"], np.arange(13))
    check_rows(batch)


def test_a_leftover_at_a_new_segments_path_is_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    w = PartWriter(path, "npy", writer_id="a", capacity=None, segment_rows=8,
                   chunk_rows=None, compression=None)  # fmt: skip
    w.append(make_rows("a", 0, 5))
    assert w.flush() == 5
    wdir = parts_lib.writer_dir(path, "a")
    stale = os.path.join(wdir, parts_lib.segment_name(8, "npy"))
    os.mkdir(stale)  # as a crash before this segment's first commit leaves it
    with open(os.path.join(stale, "seq.npy"), "wb") as f:
        f.write(b"torn")
    w.append(make_rows("a", 5, 10))  # fills [0, 8), makes [8, 16) over the leftover
    assert w.flush() == 15
    w.close()
    batch = gr.open_source(path).read_batch(np.arange(15))
    np.testing.assert_array_equal(batch["seq"], np.arange(15))
    check_rows(batch)


def test_a_segment_made_in_place_remakes_a_removed_folder_and_leaves_no_half(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = _meta(_tree(1))
    made = str(tmp_path / "gone" / "again" / "seg")  # its folder removed (or never made)
    NpySegmentBackend.create_open(made, meta, None, None, sync=False).close()
    assert NpySegmentBackend.read_metadata(made) is not None

    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    half = str(tmp_path / "half")
    monkeypatch.setattr(NpySegmentBackend, "_make", classmethod(boom))
    with pytest.raises(OSError, match="No space left"):
        NpySegmentBackend.create_open(half, meta, None, None, sync=False)
    assert not os.path.exists(half)  # removed, as a .partial would be


def test_remove_segment_removes_known_files_and_falls_back_on_strays(tmp_path: Path) -> None:
    meta = _meta(_tree(1))
    plain, stray = str(tmp_path / "plain"), str(tmp_path / "stray")
    for p in (plain, stray):
        NpySegmentBackend.create_open(p, meta, None, None, sync=False).close()
    with open(os.path.join(stray, "other.bin"), "wb") as f:
        f.write(b"x")  # not a file the segment's metadata names
    part_segments.remove_segment(plain, "npy", meta)
    part_segments.remove_segment(stray, "npy", meta)
    part_segments.remove_segment(str(tmp_path / "never"), "npy", meta)  # gone: nothing
    assert os.listdir(tmp_path) == []
