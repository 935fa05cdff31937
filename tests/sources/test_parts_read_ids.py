"""Reads by row id over several writer parts: the mapped fast path agrees with the rows."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.parts.snapshot import Snapshot

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from parts_child import check_rows, make_rows, tag_of

SEQ = (1 << 40) - 1


def _store(path: str, fmt: str, writers: int = 3) -> list[gr.ReplayWriter]:
    """Writers whose segments are whole pages per leaf (512 rows): .npy parts map them."""
    ws = []
    for i in range(writers):
        w = gr.ReplayWriter(path, fmt, capacity=1500, writer_id=f"w{i}", segment_rows=512)
        w.append(make_rows(f"w{i}", 0, 2600 + 77 * i))  # evicts: live rows start past 0
        w.flush()
        ws.append(w)
    return ws


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
@pytest.mark.parametrize("with_writer", [False, True])
def test_ids_of_several_parts_read_their_own_rows_in_batch_order(
    tmp_path: Path, fmt: str, with_writer: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "store")
    ws = _store(path, fmt)
    if fmt == "npy":  # every live row is mapped: the fast path, never the segment walk

        def walk(*args: object) -> None:
            raise AssertionError("read through the segments")

        monkeypatch.setattr(Snapshot, "readable", walk)
    keys = ["seq", "tag", "vec", "_writer"] if with_writer else None
    src = gr.open_source(path, keys=keys)
    ids = src.ids(np.random.default_rng(0).integers(0, len(src), 300))
    data, ok = src.read_ids_checked(ids)
    assert ok.all()
    check_rows(data)
    np.testing.assert_array_equal(data["seq"], ids & SEQ)
    tags = {src.writer_ordinals[f"w{i}"]: tag_of(f"w{i}") for i in range(3)}
    np.testing.assert_array_equal(data["tag"], [tags[o] for o in (ids >> 40).tolist()])
    if with_writer:
        np.testing.assert_array_equal(data["_writer"], ids >> 40)
    # the same rows one by one, through positions
    for k in (0, 57, 299):
        row = src[int(src.positions(ids[k : k + 1])[0])]
        np.testing.assert_array_equal(row["vec"], data["vec"][k])
    for w in ws:
        w.close()


def test_rows_of_the_snapshot_before_are_read_after_an_eviction(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ws = _store(path, "npy")
    src = gr.open_source(path)
    ids = src.ids(np.arange(len(src)))
    ws[0].append(make_rows("w0", ws[0].committed, 600))  # w0's oldest segment goes
    ws[0].flush()
    src.refresh()
    data, ok = src.read_ids_checked(ids)  # old rows: outside the new maps, still open
    assert ok.all()
    check_rows(data)
    np.testing.assert_array_equal(data["seq"], ids & SEQ)
    for w in ws:
        w.close()


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_a_refresh_never_closes_a_segment_the_snapshot_before_reads(
    tmp_path: Path, fmt: str, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grown tail segment is grown in place or, where its maps cannot grow so, opened
    anew for the new snapshot. Closing the old one instead would have the snapshot before (still
    read until the next refresh) reopen its files on its next read, perhaps after an
    eviction unlinked them: a StoreNotFoundError in a loader worker under eviction."""
    path = str(tmp_path / "store")
    w = gr.ReplayWriter(path, fmt, capacity=1500, writer_id="w0", segment_rows=512)
    w.append(make_rows("w0", 0, 100))
    w.flush()
    src = gr.open_source(path)
    ids = src.ids(np.arange(100))
    (before,) = src._snapshot().parts
    tail = before.segments[0]
    opens = tail._opens
    if not in_place:  # e.g. a .npy map whose address space ran out
        monkeypatch.setattr(type(tail._handle), "grow", lambda *args: False)
    w.append(make_rows("w0", 100, 50))  # the tail segment grows
    w.flush()
    src.refresh()
    (after,) = src._snapshot().parts
    assert tail._handle is not None and tail._opens == opens  # neither closed nor reopened
    assert (after.segments[0] is tail) == in_place
    # The files unlinked under both snapshots (as an eviction does): both read on.
    for _, _, _, seg in src.segments():
        shutil.rmtree(seg) if os.path.isdir(seg) else os.remove(seg)
    np.testing.assert_array_equal(tail.read_flat(np.arange(100), check=False)["seq"], ids & SEQ)
    data, ok = src.read_ids_checked(src.ids(np.arange(150)))
    assert ok.all()
    check_rows(data)
    np.testing.assert_array_equal(data["seq"], np.arange(150))
    w.close()


def test_an_unknown_writer_or_a_row_past_the_snapshot_leaves_the_fast_path(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "store")
    ws = _store(path, "npy")
    src = gr.open_source(path)
    live = src.ids(np.arange(len(src)))
    stranger = np.array([live[0], (77 << 40) | 3], dtype=np.int64)
    with pytest.raises(gr.EvictedRowError, match=r"no writer with ordinal 77.*Fix"):
        src.read_ids_checked(stranger)
    ws[1].append(make_rows("w1", ws[1].committed, 5))  # committed after the snapshot
    ws[1].flush()
    newest = (np.int64(src.writer_ordinals["w1"]) << 40) | np.int64(ws[1].committed - 1)
    data, ok = src.read_ids_checked(np.array([live[-1], newest], dtype=np.int64))
    assert ok.all()  # the reader refreshed to read it
    np.testing.assert_array_equal(data["seq"], [live[-1] & SEQ, ws[1].committed - 1])
    for w in ws:
        w.close()


@pytest.mark.parametrize("fmt", ["npy", "hdf5"])
def test_a_tail_segment_whose_map_could_not_grow_is_mapped_again_at_refresh(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refresh that cannot grow a segment's map in place (its file replaced, or gone
    between reading its metadata and growing) maps it again at once: the snapshot's rows
    stay readable after the writer evicts the segment, never opened lazily after it."""
    path = str(tmp_path / "store")
    w = gr.ReplayWriter(path, fmt, capacity=40, writer_id="w0", segment_rows=16)
    w.append(make_rows("w0", 0, 20))  # segment 16 holds 4 rows
    w.flush()
    src = gr.open_source(path, keys=["seq", "tag", "vec"])
    src.read_batch(np.arange(len(src)))  # maps both segments
    w.append(make_rows("w0", 20, 8))  # segment 16 grows to 12 rows
    w.flush()
    handle = type(src._snapshot().parts[0].segments[16]._get_handle())
    monkeypatch.setattr(handle, "grow", lambda self, source, layout: False)
    src.refresh()
    ids = src.ids(np.arange(len(src)))  # no read here: a read would map the files again
    w.append(make_rows("w0", 28, 120))  # segments 0 and 16 evicted and unlinked
    w.flush()
    segment = f"seg-{16:012d}" + ("" if fmt == "npy" else ".h5")
    assert not (Path(path) / "writers" / "w0" / segment).exists()
    got = src.read_batch(np.arange(len(src)))  # this snapshot still: no error, same rows
    check_rows(got)
    np.testing.assert_array_equal(got["seq"], np.arange(28 - len(src), 28))
    data, ok = src.read_ids_checked(ids)
    assert ok.all()
    np.testing.assert_array_equal(data["seq"], ids & SEQ)
    w.close()
