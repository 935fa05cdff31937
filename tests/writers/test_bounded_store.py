"""Bounded, many-writer stores: capacity, eviction, writer ids, reopening, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from parts_child import check_rows, make_rows, spawn_writer

import grain_replay as gr
from grain_replay.store import parts as parts_lib

FORMATS = ["npy", "hdf5", "zarr"]


def _disk_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.stat(os.path.join(root, f)).st_size
    return total


def _segments(path: str, writer_id: str) -> list[str]:
    return sorted(
        n for n in os.listdir(parts_lib.writer_dir(path, writer_id)) if n.startswith("seg-")
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_capacity_keeps_the_newest_rows_oldest_first(tmp_path: Path, fmt: str) -> None:
    path = str(tmp_path / "store")
    with gr.ReplayWriter(path, fmt, capacity=100, writer_id="a") as w:
        for k in range(20):
            w.append(make_rows("a", 10 * k, 10))
            w.flush()
            src = gr.open_source(path)
            n = min(10 * (k + 1), 100)
            assert len(src) == n == w.live
            batch = src.read_batch(np.arange(n))
            np.testing.assert_array_equal(batch["seq"], np.arange(10 * (k + 1) - n, 10 * (k + 1)))
            check_rows(batch)
        assert w.committed == 200


@pytest.mark.parametrize(
    "fmt",
    [
        "npy",
        pytest.param("hdf5", marks=pytest.mark.slow),
        pytest.param("zarr", marks=pytest.mark.slow),
    ],
)
def test_disk_use_stays_bounded_however_long_the_run(tmp_path: Path, fmt: str) -> None:
    path = str(tmp_path / "store")
    row_bytes = 8 + 8 + 4 * 8
    with gr.ReplayWriter(path, fmt, capacity=1600, writer_id="a") as w:
        sizes = []
        for k in range(25):
            w.append(make_rows("a", 400 * k, 400))
            w.flush()
            sizes.append(_disk_bytes(path))
        seg = w._store.manifest.segment_rows
    assert seg == 100
    # capacity + the partly filled head segment + one retired segment, plus headers
    # and chunk padding (a fixed amount per segment file).
    segments = len(_segments(path, "a"))
    assert segments <= 1600 // seg + 2
    assert max(sizes[10:]) < 1.5 * max(sizes[5:10])  # flat, not growing with the run
    if fmt == "npy":
        assert max(sizes[10:]) <= (1600 + 2 * seg) * row_bytes + segments * 4 * 4096


@pytest.mark.parametrize("fmt", FORMATS)
def test_snapshot_stays_readable_however_much_is_evicted(tmp_path: Path, fmt: str) -> None:
    path = str(tmp_path / "store")
    with gr.ReplayWriter(path, fmt, capacity=50, writer_id="a", segment_rows=10) as w:
        w.append(make_rows("a", 0, 120))
        w.flush()
        src = gr.open_source(path)
        before = src.read_batch(np.arange(len(src)))
        for k in range(6):  # every segment of the snapshot is evicted and unlinked
            w.append(make_rows("a", 120 + 100 * k, 100))
            w.flush()
        assert not set(_segments(path, "a")) & {parts_lib.segment_name(70, fmt)}
        again = src.read_batch(np.arange(len(src)))
        for k in before:
            np.testing.assert_array_equal(again[k], before[k])
        assert len(src) == 50
        src.refresh()
        np.testing.assert_array_equal(src.read_batch(np.arange(50))["seq"], np.arange(670, 720))


@pytest.mark.parametrize("fmt", FORMATS)
def test_reopen_continues_after_the_last_committed_row(tmp_path: Path, fmt: str) -> None:
    path = str(tmp_path / "store")
    w = gr.ReplayWriter(path, fmt, capacity=64, writer_id="a")
    w.append(make_rows("a", 0, 90))
    w.flush()
    w.append(make_rows("a", 90, 5))  # never committed
    w._store.abandon()
    w = gr.ReplayWriter(path, fmt, capacity=64, writer_id="a")
    assert w.committed == 90 and len(w) == 90
    w.append(make_rows("a", 90, 20))
    w.close()
    src = gr.open_source(path)
    batch = src.read_batch(np.arange(len(src)))
    np.testing.assert_array_equal(batch["seq"], np.arange(110 - 64, 110))
    check_rows(batch)


def test_many_writers_read_as_one_store_with_a_writer_leaf(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ws = {wid: gr.ReplayWriter(path, capacity=cap, writer_id=wid) for wid, cap in
          [("b", 30), ("a", 20), ("c", None)]}  # fmt: skip
    for wid, w in ws.items():
        w.append(make_rows(wid, 0, 45))
        w.flush()
    src = gr.open_source(path, keys=["seq", "tag", "_writer"])
    assert len(src) == 20 + 30 + 45
    batch = src.read_batch(np.arange(len(src)))
    ordinals = src.writer_ordinals
    want_writer = np.repeat([ordinals["a"], ordinals["b"], ordinals["c"]], [20, 30, 45])
    np.testing.assert_array_equal(batch["_writer"], want_writer)  # sorted ids, oldest first
    np.testing.assert_array_equal(
        batch["seq"], np.concatenate([np.arange(25, 45), np.arange(15, 45), np.arange(45)])
    )
    assert set(batch) == {"seq", "tag", "_writer"}
    # ids are stable: after more commits and evictions they map to the same rows
    ids = src.ids(np.arange(len(src)))
    assert len(np.unique(ids)) == len(ids)
    for w in ws.values():
        w.append(make_rows("x", 45, 10))
        w.flush()
    src.refresh()
    pos = src.positions(ids)
    alive = pos >= 0
    assert alive.sum() == (20 - 10) + (30 - 10) + 45
    np.testing.assert_array_equal(src.read_batch(pos[alive])["seq"], batch["seq"][alive])
    np.testing.assert_array_equal(src.ids(pos[alive]), ids[alive])
    for w in ws.values():
        w.close()


def test_reader_refresh_sees_new_writers_and_rereads_only_changed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "store")
    ws = [gr.ReplayWriter(path, capacity=100, writer_id=f"w{i}") for i in range(4)]
    for i, w in enumerate(ws[:3]):
        w.append(make_rows(f"w{i}", 0, 10))
        w.flush()
    src = gr.open_source(path)
    assert len(src) == 30
    ws[1].append(make_rows("w1", 10, 5))
    ws[1].flush()
    ws[3].append(make_rows("w3", 0, 7))
    ws[3].flush()
    reads: list[str] = []
    real = parts_lib.read_manifest
    monkeypatch.setattr(parts_lib, "read_manifest", lambda d: reads.append(d) or real(d))
    assert src.refresh() == 30 + 5 + 7
    assert sorted(os.path.basename(d) for d in reads) == ["w1", "w3"]
    assert src.refresh() == 42 and len(reads) == 2  # nothing changed: nothing re-read
    for w in ws:
        w.close()


def _holder(path: str, writer_id: str) -> subprocess.Popen[bytes]:
    proc = spawn_writer(
        path, "npy", writer_id, 50, "--blocks", "3", "--hold", stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == b"idle":
            return proc
    raise AssertionError(f"child exited {proc.wait()}")


def test_a_live_id_is_refused_naming_its_holder_and_a_dead_ones_is_taken_over(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "store")
    proc = _holder(path, "actor-3")
    try:
        with pytest.raises(gr.WriterBusyError, match=rf"'actor-3'.*pid {proc.pid}"):
            gr.ReplayWriter(path, capacity=50, writer_id="actor-3")
        other = gr.ReplayWriter(path, capacity=50, writer_id="actor-4")  # no shared lock
        other.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    with gr.ReplayWriter(path, capacity=50, writer_id="actor-3") as w:  # died: taken over
        assert w.committed == 21
        owner = json.loads(Path(parts_lib.writer_dir(path, "actor-3"), "owner.json").read_text())
        assert owner["pid"] == os.getpid()


def test_writer_processes_append_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    procs = [
        spawn_writer(path, "npy", f"p{i}", 200, "--blocks", "60", "--block", "5") for i in range(3)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    src = gr.open_source(path, keys=["seq", "tag", "vec", "_writer"])
    assert len(src) == 600
    batch = src.read_batch(np.arange(600))
    check_rows(batch)
    for wid in ("p0", "p1", "p2"):
        mine = batch["_writer"] == src.writer_ordinals[wid]
        np.testing.assert_array_equal(batch["seq"][mine], np.arange(100, 300))


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "100"])
def test_capacity_must_be_a_positive_int(tmp_path: Path, bad: object) -> None:
    with pytest.raises(gr.InvalidArgumentError, match=r"store.*writer 'a'.*capacity.*Fix"):
        gr.ReplayWriter(str(tmp_path / "store"), capacity=bad, writer_id="a")  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "fmt"), [("buf2.h5", "hdf5"), ("buf2.HDF5", "hdf5")])
def test_bounded_store_at_an_h5_path_is_a_directory_of_hdf5_segments(
    tmp_path: Path, name: str, fmt: str
) -> None:
    path = tmp_path / name
    with gr.ReplayWriter(str(path), capacity=100) as w:  # the format from the suffix
        w.append(make_rows("default", 0, 5))
    assert path.is_dir() and parts_lib.read_store_file(str(path)) == fmt
    segments = os.listdir(parts_lib.writer_dir(str(path), "default"))
    assert any(f.startswith("seg-") and f.endswith(".h5") for f in segments), segments
    src = gr.open_source(path)
    assert len(src) == 5 and src.read_batch(np.arange(5))["seq"].tolist() == list(range(5))
    with gr.ReplayWriter(str(path), capacity=100) as w:  # reopens
        assert w.committed == 5


@pytest.mark.parametrize(
    ("name", "given", "named", "fix"),
    [
        ("buf2.h5", "npy", "hdf5", "format='hdf5' for hdf5 segments"),
        ("buf2.hdf5", "zarr", "hdf5", "format='hdf5' for hdf5 segments"),
        ("buf2.zarr", "hdf5", "zarr", "format='zarr' for zarr segments"),
        ("buf2.npy", "zarr", "npy", "format='npy' for npy segments"),
        ("buf2.npz", None, None, "a directory without a suffix"),
    ],
)
def test_bounded_store_suffix_naming_another_format_is_refused(
    tmp_path: Path, name: str, given: str | None, named: str | None, fix: str
) -> None:
    path = tmp_path / name
    fmt = given or "npy"
    stem = str(tmp_path / "buf2")
    for kwargs in ({"capacity": 100}, {"writer_id": "a"}):
        with pytest.raises(gr.InvalidArgumentError) as e:
            gr.ReplayWriter(str(path), given, **kwargs)  # type: ignore[arg-type]
        msg = str(e.value)
        assert f"directory of {fmt} segments" in msg, msg
        assert f"names {named}" in msg if named else "names no format" in msg, msg
        assert f"Fix: gr.ReplayWriter({stem!r}, format={fmt!r}, ...)" in msg and fix in msg
        assert isinstance(e.value, ValueError)
        assert not path.exists()  # nothing made
    with gr.ReplayWriter(stem, fmt, capacity=100) as w:  # the fix works
        w.append(make_rows("default", 0, 5))
    assert len(gr.open_source(stem)) == 5


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "a b", 3, "x" * 200])
def test_writer_id_must_be_a_safe_file_name(tmp_path: Path, bad: object) -> None:
    with pytest.raises(gr.InvalidArgumentError, match=r"writer_id.*safe file name.*Fix"):
        gr.ReplayWriter(str(tmp_path / "store"), capacity=10, writer_id=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_capacity_cannot_change_on_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    with gr.ReplayWriter(path, capacity=10, writer_id="a") as w:
        w.append(make_rows("a", 0, 3))
    for bad in (20, None):
        with pytest.raises(gr.InvalidArgumentError, match=r"writer 'a'.*capacity=10.*Fix"):
            gr.ReplayWriter(path, capacity=bad, writer_id="a")
    with gr.ReplayWriter(path, capacity=10, writer_id="a") as w:  # nothing was lost
        assert w.committed == 3


def test_a_tree_unlike_the_stores_is_refused_naming_the_writers(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    with gr.ReplayWriter(path, capacity=10, writer_id="a") as w:
        w.append(make_rows("a", 0, 3))
        bad = make_rows("a", 3, 2)
        bad["vec"] = bad["vec"].astype(np.float32)
        with pytest.raises(gr.InvalidTreeError, match=r"writer 'a'.*float32.*Fix"):
            w.append(bad)
        assert len(w) == 3
    with gr.ReplayWriter(path, capacity=10, writer_id="b") as w:
        with pytest.raises(gr.InvalidTreeError, match=r"writer 'b'.*writer 'a'.*Fix"):
            w.append({"seq": np.arange(3)})
        w.append(make_rows("b", 0, 2))
    assert len(gr.open_source(path)) == 5


def test_single_and_many_writer_stores_do_not_mix(tmp_path: Path) -> None:
    plain, parts = str(tmp_path / "plain"), str(tmp_path / "parts")
    with gr.ReplayWriter(plain) as w:
        w.append(make_rows("a", 0, 3))
    with pytest.raises(gr.InvalidStoreError, match=r"single-writer store.*Fix"):
        gr.ReplayWriter(plain, capacity=10, writer_id="a")
    with gr.ReplayWriter(parts, writer_id="a") as w:
        w.append(make_rows("a", 0, 3))
    with pytest.raises(gr.InvalidStoreError, match=r"many-writer store.*Fix: pass writer_id"):
        gr.ReplayWriter(parts)
    with pytest.raises(gr.InvalidStoreError, match=r"is a npy store but format='zarr'"):
        gr.ReplayWriter(parts, "zarr", writer_id="b")
    assert len(gr.open_source(plain)) == 3 and len(gr.open_source(parts)) == 3


def test_empty_store_then_first_commit(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    w = gr.ReplayWriter(path, capacity=10, writer_id="a")
    src = gr.open_source(path)
    assert len(src) == 0 and src.spec == {}
    w.append(make_rows("a", 0, 4))
    w.flush()
    assert src.refresh() == 4 and set(src.spec) == {"seq", "tag", "vec"}
    assert int(src[-1]["seq"]) == 3 and int(src[-4]["seq"]) == 0
    for bad in (4, -5):
        with pytest.raises(gr.RecordIndexError, match=rf"index {bad} is out of range.* 4 records"):
            src[bad]
    with pytest.raises(TypeError, match="PartsDataSource indices must be integers"):
        src[1.5]
    w.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_segment_committed_past_its_manifest_reads_as_the_manifest_says(
    tmp_path: Path, fmt: str
) -> None:
    path = str(tmp_path / "store")
    w = gr.ReplayWriter(path, fmt, capacity=100, writer_id="a", segment_rows=50)
    w.append(make_rows("a", 0, 10))
    w.flush()
    w.append(make_rows("a", 10, 5))
    part = w._store
    part._open.backend.commit(15, None)
    part.abandon()
    again = gr.ReplayWriter(path, fmt, capacity=100, writer_id="a", segment_rows=50)
    src = gr.open_source(path)  # while the reopened writer has not flushed yet
    np.testing.assert_array_equal(src.read_batch(np.arange(len(src)))["seq"], np.arange(10))
    again.append(make_rows("a", 10, 3))
    again.close()
    src.refresh()
    batch = src.read_batch(np.arange(len(src)))
    np.testing.assert_array_equal(batch["seq"], np.arange(13))
    check_rows(batch)
