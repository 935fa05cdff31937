"""filesync.atomic_replace: the one temp-file-then-rename of the package, and its naming rule."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from grain_replay.store import filesync
from grain_replay.store.filesync import atomic_replace, temp_path, temp_siblings


def test_replaces_the_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    target.write_bytes(b"old")
    with atomic_replace(str(target)) as f:
        f.write(b"new")
        assert target.read_bytes() == b"old"  # nothing in place before the block exits
    assert target.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["a.json"]


def test_creates_a_missing_file(tmp_path: Path) -> None:
    target = tmp_path / "b.npz"
    with atomic_replace(str(target), durable=False) as f:
        f.write(b"x")
    assert target.read_bytes() == b"x"


def test_a_failure_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    target.write_bytes(b"old")

    def fail() -> None:
        with atomic_replace(str(target)) as f:
            f.write(b"half")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_failed_rename_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "d"
    target.mkdir()
    (target / "keep").write_bytes(b"k")  # a non-empty folder: rename(2) onto it fails
    with pytest.raises(IsADirectoryError), atomic_replace(str(target)) as f:
        f.write(b"x")
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_an_unwritable_folder_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), atomic_replace(str(tmp_path / "missing" / "a")):
        pass


def test_concurrent_writers_of_one_path_never_collide(tmp_path: Path) -> None:
    target = str(tmp_path / "shared.bin")
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            start.wait()
            for _ in range(25):
                with atomic_replace(target, durable=False) as f:
                    f.write(bytes([i]) * 4096)
        except BaseException as e:  # reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    data = Path(target).read_bytes()
    assert len(data) == 4096 and len(set(data)) == 1  # one writer's whole file, never a mix
    assert os.listdir(tmp_path) == ["shared.bin"]


@pytest.mark.parametrize("durable", [True, False])
def test_durable_fsyncs_the_file_then_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "m.json"
    with atomic_replace(str(target), durable=durable) as f:
        f.write(b"{}")
    if durable:
        assert len(synced) == 2
        assert synced[0].endswith(".partial")  # the new file, before its rename
        assert synced[1] == str(tmp_path)  # then the folder holding the rename
    else:
        assert synced == []


def test_temp_names_are_unique_beside_the_path_and_listed(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    names = {temp_path(path) for _ in range(100)}
    assert len(names) == 100
    for name in names:
        assert os.path.dirname(name) == str(tmp_path)
        assert os.path.basename(name).startswith(f"store.{os.getpid()}.")
        assert name.endswith(".partial")
    made = temp_path(path, ".npy.partial")
    Path(made).write_bytes(b"")
    Path(tmp_path / "store.7.old").write_bytes(b"")  # not a temp write
    Path(tmp_path / "storex.1.ab.partial").write_bytes(b"")  # another path's
    assert temp_siblings(path) == [made]


def test_staged_text_publish_without_the_folder_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "meta.json"
    staged = filesync.stage_text(str(target), "{}")
    assert staged.tmp.endswith(".partial") and os.path.exists(staged.tmp)
    synced: list[str] = []
    monkeypatch.setattr(filesync, "fsync_path", synced.append)
    filesync.publish_text(staged, sync_dir=False)
    assert target.read_text() == "{}" and synced == []
    assert os.listdir(tmp_path) == ["meta.json"]
