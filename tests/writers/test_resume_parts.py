"""``ReplayWriter(path, writer_id=..., resume_from=...)``: a writer part cut back to a watermark.

The rows a writer committed after a replay checkpoint are dropped (the manifest
first, then the later segments' files and the tail segment's rows), its
eviction state is that of a writer that stopped at the watermark, and appends
continue there. Bad watermarks are refused with the store, the writer and the
fix, and change nothing. The whole run (real actor and learner processes) is
tests/reliability/test_whole_run_restart.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.store import integrity
from grain_replay.store import parts as parts_lib
from grain_replay.writers import part_manifest

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from parts_child import check_rows, make_rows, run_of

CAPACITY, SEG = 40, 16
FORMATS = ["npy", "hdf5", pytest.param("zarr", marks=pytest.mark.slow)]


def _fill(path: str, fmt: str, writer_id: str = "a", rows: int = 100, **kw: object) -> None:
    kw.setdefault("capacity", CAPACITY)
    with gr.ReplayWriter(path, fmt, writer_id=writer_id, segment_rows=SEG, **kw) as w:  # type: ignore[arg-type]
        for start in range(0, rows, 5):
            w.append(make_rows(writer_id, start, 5))
            w.flush()


def _seen(path: str, writer_id: str = "a") -> tuple[np.ndarray, np.ndarray]:
    """(seq, run) of the rows a reader sees of ``writer_id``, oldest first; every row whole."""
    src = gr.open_source(path, keys=["seq", "tag", "vec", "_writer"])
    batch = src.read_batch(np.arange(len(src)))
    check_rows(batch)
    mine = batch["_writer"] == src.writer_ordinals.get(writer_id, -1)
    src.close()
    return batch["seq"][mine], run_of(batch["tag"][mine])


def _segment_files(path: str, writer_id: str = "a") -> list[str]:
    wdir = parts_lib.writer_dir(path, writer_id)
    return sorted(n for n in os.listdir(wdir) if n.startswith("seg-"))


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_cuts_a_part_mid_segment_and_appends_after_it(tmp_path: Path, fmt: str) -> None:
    if fmt == "zarr":
        pytest.importorskip("zarr")
    path = str(tmp_path / "store")
    _fill(path, fmt)
    before = _disk_bytes(path)
    mark = gr.Watermark(path, writers={"a": 77})
    with gr.ReplayWriter(path, fmt, capacity=CAPACITY, writer_id="a", resume_from=mark) as w:
        assert (w.committed, w.live, len(w)) == (77, CAPACITY, 77)
        seq, _ = _seen(path)
        np.testing.assert_array_equal(seq, np.arange(37, 77))  # as if it had stopped at 77
        # Segments past the watermark are gone; the tail holds rows [64, 77); one retired.
        assert _segment_files(path)[-1] == parts_lib.segment_name(64, fmt)
        assert parts_lib.segment_name(80, fmt) not in _segment_files(path)
        assert _disk_bytes(path) < before
        if fmt == "npy":
            tail = os.path.join(parts_lib.writer_dir(path, "a"), parts_lib.segment_name(64, fmt))
            sizes = {os.path.getsize(os.path.join(tail, f)) for f in os.listdir(tail)
                     if f.endswith(".npy")}  # fmt: skip
            assert max(sizes) <= 4096 + 13 * 32  # the page-sized header and 13 rows
        w.append(make_rows("a", 77, 13, run=2))
        w.flush()
    seq, run = _seen(path)
    np.testing.assert_array_equal(seq, np.arange(50, 90))
    np.testing.assert_array_equal(run, (seq >= 77) * 2)  # the new rows, not the dropped ones
    src = gr.open_source(path)
    for _, first, rows, seg_path in src.segments():  # every segment's checksums still hold
        seg = gr.open_source(seg_path)
        assert len(seg) >= rows
        assert integrity.verify_source(seg, seg.checksums).ok, first
        seg.close()
    src.close()


@pytest.mark.parametrize("rows", [80, 96, 0])
def test_resume_at_a_segment_boundary_or_to_nothing(tmp_path: Path, rows: int) -> None:
    path = str(tmp_path / "store")
    _fill(path, "npy")
    with gr.ReplayWriter(path, capacity=CAPACITY, writer_id="a", resume_from=rows) as w:
        assert (w.committed, w.live) == (rows, min(rows, CAPACITY))
        np.testing.assert_array_equal(_seen(path)[0], np.arange(max(0, rows - CAPACITY), rows))
        w.append(make_rows("a", rows, 7, run=2))
    seq, run = _seen(path)
    np.testing.assert_array_equal(seq, np.arange(max(0, rows + 7 - CAPACITY), rows + 7))
    assert (run[seq >= rows] == 2).all() and (run[seq < rows] == 0).all()
    if rows == 0:
        assert _segment_files(path) == [parts_lib.segment_name(0, "npy")]


def test_resume_of_one_writer_leaves_the_others_and_unnamed_writers_keep_nothing(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "store")
    _fill(path, "npy", "a")
    _fill(path, "npy", "b", rows=30)
    mark = gr.Watermark(path, writers={"a": 88})  # "b" started after the checkpoint
    with gr.ReplayWriter(path, capacity=CAPACITY, writer_id="a", resume_from=mark):
        np.testing.assert_array_equal(_seen(path, "a")[0], np.arange(48, 88))
        np.testing.assert_array_equal(_seen(path, "b")[0], np.arange(30))
    with gr.ReplayWriter(path, capacity=CAPACITY, writer_id="b", resume_from=mark) as w:
        assert w.committed == 0
    assert len(_seen(path, "b")[0]) == 0 and len(gr.open_source(path)) == 40


def test_resume_of_an_unbounded_part(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    _fill(path, "hdf5", capacity=None)
    with gr.ReplayWriter(path, writer_id="a", resume_from=33) as w:
        assert (w.committed, w.live, w.capacity) == (33, 33, None)
    np.testing.assert_array_equal(_seen(path)[0], np.arange(33))


def test_eviction_goes_on_bounded_after_a_resume(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    _fill(path, "npy")
    with gr.ReplayWriter(path, capacity=CAPACITY, writer_id="a", resume_from=90) as w:
        for start in range(90, 400, 10):
            w.append(make_rows("a", start, 10, run=2))
            w.flush()
            seq, _ = _seen(path)
            np.testing.assert_array_equal(seq, np.arange(start + 10 - CAPACITY, start + 10))
            # capacity + the partly filled head segment + one retired segment
            assert len(_segment_files(path)) <= -(-CAPACITY // SEG) + 2


def test_a_crash_after_the_cut_manifest_reopens_consistent(tmp_path: Path) -> None:
    """The cut commits the manifest first: a writer killed right after it leaves the later
    segments and the tail's extra rows on disk, which any reopen drops."""
    path = str(tmp_path / "store")
    _fill(path, "npy")
    wdir = parts_lib.writer_dir(path, "a")
    m = parts_lib.read_manifest(wdir)
    assert m is not None
    parts_lib.write_manifest(wdir, part_manifest.cut(m, 75, path))  # ... and SIGKILL here
    np.testing.assert_array_equal(_seen(path)[0], np.arange(35, 75))  # readers: the cut
    with gr.ReplayWriter(path, capacity=CAPACITY, writer_id="a") as w:
        assert w.committed == 75
        assert parts_lib.segment_name(80, "npy") not in _segment_files(path)
        w.append(make_rows("a", 75, 9, run=2))
    seq, run = _seen(path)
    np.testing.assert_array_equal(seq, np.arange(44, 84))
    np.testing.assert_array_equal(run, (seq >= 75) * 2)


def test_bad_watermarks_are_refused_naming_store_writer_and_fix(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    _fill(path, "npy")
    files, want = _segment_files(path), _seen(path)[0]

    def reopen(mark: object, capacity: int | None = CAPACITY) -> None:
        gr.ReplayWriter(path, capacity=capacity, writer_id="a", resume_from=mark)  # type: ignore[arg-type]

    with pytest.raises(gr.InvalidStoreError, match=r"writer 'a'.*covers 101 rows.*holds 100.*Fix"):
        reopen(101)
    with pytest.raises(
        gr.InvalidStoreError, match=r"writer 'a'.*\[0, 30\).*evicted.*Fix: checkpoint"
    ):
        reopen(gr.Watermark(path, writers={"a": 30}))
    with pytest.raises(gr.InvalidArgumentError, match=r"writer 'a'.*capacity=40.*Fix"):
        reopen(77, capacity=50)
    with pytest.raises(gr.InvalidArgumentError, match=r"writer 'a'.*plain store.*Fix"):
        reopen(gr.Watermark(path, rows=77))
    with pytest.raises(gr.InvalidArgumentError, match=r"writer 'a'.*elsewhere.*Fix"):
        reopen(gr.Watermark(str(tmp_path / "elsewhere"), writers={"a": 77}))
    with pytest.raises(gr.InvalidArgumentError, match=r"writer 'a'.*Watermark.*row count"):
        reopen("77")
    with pytest.raises(gr.InvalidArgumentError, match=r"writer 'a'.*>= 0"):
        reopen(-1)
    assert _segment_files(path) == files  # nothing changed, and the id is free again
    np.testing.assert_array_equal(_seen(path)[0], want)
    with gr.ReplayWriter(path, capacity=CAPACITY, writer_id="a", resume_from=100) as w:
        assert w.committed == 100  # the watermark at the end: nothing to drop
    assert _segment_files(path) == files


# -- gr.truncate_to_watermark: every writer at once -----------------------------------


def test_truncate_to_watermark_cuts_every_writer_and_drops_unnamed_ones(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    _fill(path, "npy", "a")
    _fill(path, "npy", "b", rows=95)
    _fill(path, "npy", "late", rows=20)  # started after the checkpoint
    kept = gr.truncate_to_watermark(path, gr.Watermark(path, writers={"a": 90, "b": 80}))
    assert kept == {"a": 90, "b": 80, "late": 0}
    np.testing.assert_array_equal(_seen(path, "a")[0], np.arange(50, 90))
    np.testing.assert_array_equal(_seen(path, "b")[0], np.arange(40, 80))
    assert len(_seen(path, "late")[0]) == 0


def test_truncate_to_watermark_of_a_plain_store(tmp_path: Path) -> None:
    path = str(tmp_path / "plain.h5")
    with gr.ReplayWriter(path) as w:
        w.append(make_rows("a", 0, 30))
    assert gr.truncate_to_watermark(path, gr.Watermark(path, rows=12)) == {None: 12}
    assert len(gr.open_source(path)) == 12


def test_truncate_to_watermark_checks_every_writer_before_cutting_any(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    _fill(path, "npy", "a")
    _fill(path, "npy", "b")
    files = {w: _segment_files(path, w) for w in ("a", "b")}
    with pytest.raises(gr.InvalidStoreError, match=r"writer 'b'.*evicted.*Fix"):
        gr.truncate_to_watermark(path, gr.Watermark(path, writers={"a": 90, "b": 30}))
    with pytest.raises(gr.InvalidStoreError, match=r"writer 'c'.*committed none.*Fix"):
        gr.truncate_to_watermark(path, gr.Watermark(path, writers={"a": 90, "c": 5}))
    live = gr.ReplayWriter(path, capacity=CAPACITY, writer_id="b")
    with pytest.raises(gr.WriterBusyError, match=r"writer 'b'.*live writer.*Fix: stop every actor"):
        gr.truncate_to_watermark(path, gr.Watermark(path, writers={"a": 90, "b": 90}))
    live.close()
    assert {w: _segment_files(path, w) for w in ("a", "b")} == files  # nothing was cut
    assert len(_seen(path, "a")[0]) == CAPACITY
    with gr.ReplayWriter(path, capacity=CAPACITY, writer_id="a") as w:
        assert w.committed == 100


def _commit(m: parts_lib.Manifest, n: int) -> parts_lib.Manifest:
    """``m`` after a flush of ``n`` more rows, as PartWriter.flush computes it."""
    rows = {s.first: s.rows for s in m.segments}
    seq = m.committed
    while seq < m.committed + n:
        first = seq // m.segment_rows * m.segment_rows
        take = min(m.committed + n - seq, first + m.segment_rows - seq)
        rows[first] = rows.get(first, 0) + take
        seq += take
    return part_manifest.committed(m, m.committed + n, rows, "{}")[0]


@pytest.mark.parametrize("seed", range(4))
def test_a_cut_is_possible_while_at_most_segment_rows_were_committed_after_it(seed: int) -> None:
    """What the docs promise: the newest evicted segment stays, so a watermark at most
    ``segment_rows`` rows back can always be restored, whatever the flush sizes."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        capacity, seg = int(rng.integers(1, 200)), int(rng.integers(1, 64))
        m = parts_lib.Manifest("a", 0, "npy", capacity, seg, 0, ())
        for _ in range(int(rng.integers(0, 30))):
            m = _commit(m, int(rng.integers(1, 3 * seg)))
        mark, after = m.committed, m
        while after.committed < mark + seg:
            after = _commit(after, int(rng.integers(1, mark + seg - after.committed + 1)))
            cut = part_manifest.cut(after, mark, "store")
            assert (cut.committed, cut.live_start) == (mark, m.live_start)
            held = [s for s in cut.segments if s.rows]
            assert sum(s.rows for s in held) >= cut.live and all(
                s.first + s.rows > cut.live_start for s in held
            )
            assert cut.segments == m.segments  # the state the writer had at the watermark
