"""A reader's refresh() beside a writer that evicts the segment it is growing or opening.

The writer publishes the manifest that drops a segment, then unlinks the segment file by
file (``shutil.rmtree``). A reader that read the manifest before can find the segment
half removed when it grows it in place (``grow_in_place``: ``_inspect`` reads the
metadata, then the handle looks at every leaf again) or opens it. Here the writer's
eviction is injected at each of those moments, leaving each partial state of the removal;
refresh() must never raise, must serve each row whole and live in the manifest it
returns, and the previous snapshot's rows must stay readable by id, as committed.
(First seen as ``KeyError: 'seq'`` from the Zarr handle's ``grow``: the leaf ``seq``
removed between ``_inspect`` and the handle's ``group['seq']``.)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from parts_child import check_rows, make_rows, open_writers

import grain_replay as gr
from grain_replay.sources import base
from grain_replay.sources.parts import snapshot
from grain_replay.sources.reading.readers import Handle
from grain_replay.store import parts as parts_lib
from grain_replay.writers import parts_writer

CAPACITY, SEGMENT = 120, 20
# What of an evicted segment is gone when the reader looks (None: all of it): the
# removal is file by file, in directory order.
PARTIAL = {
    "npy": ["seq.npy", "grain_replay.json", None],
    "hdf5": [None],
    "zarr": ["seq", "seq/zarr.json", "zarr.json", "vec/c", None],
}
CASES = [(fmt, gone) for fmt, states in PARTIAL.items() for gone in states]


def _handles() -> list[type[Handle]]:
    """Every format's handle class (the zarr, hdf5 and npy rooms are imported above)."""
    found, todo = [], list(Handle.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return [c for c in found if "grow" in vars(c)]


class _Evictor:
    """Runs the writer's eviction of one segment, once, leaving only ``gone`` removed."""

    def __init__(self, writer: Any, gone: str | None, monkeypatch: pytest.MonkeyPatch):
        self.writer, self.gone, self.fired = writer, gone, []
        self.real_remove = parts_writer.remove_segment
        monkeypatch.setattr(parts_writer, "remove_segment", self._remove)

    def _remove(self, path: str, *args: Any) -> None:
        if self.gone is None or not os.path.isdir(path):
            self.real_remove(path, *args)
            return
        target = os.path.join(path, self.gone)
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.unlink(target)

    def __call__(self, segment: str) -> None:
        if self.fired:
            return
        self.fired.append(segment)
        w = self.writer
        w.append(make_rows("w0", w.committed, CAPACITY + 4 * SEGMENT))  # evicts `segment`
        w.flush()
        assert not any(p == segment for _, _, _, p in _live_segments(w))


def _live_segments(w: Any) -> list[tuple[str, int, int, str]]:
    return gr.open_source(w.path).segments()


def _writer(path: str, fmt: str) -> Any:
    w = gr.ReplayWriter(path, fmt, capacity=CAPACITY, writer_id="w0", segment_rows=SEGMENT)
    w.append(make_rows("w0", 0, 150))
    w.flush()
    return w


def _check(src: Any, commits: tuple[int, int]) -> None:
    """The snapshot is the live rows of one of the two commits around the eviction (the
    one before it where the segment could still be read whole), each row whole."""
    n = len(src)
    batch = src.read_flat(np.arange(n))
    check_rows(batch)
    committed = int(batch["seq"][-1]) + 1
    assert committed in commits
    assert n == min(committed, CAPACITY)
    np.testing.assert_array_equal(batch["seq"], np.arange(committed - n, committed))


def _inject(where: str, evict: Callable[[str], None], monkeypatch: pytest.MonkeyPatch) -> None:
    if where == "before_grow":  # manifest read, segment not looked at yet
        real = base.ReplaySource.grow_in_place

        def grow_in_place(self: Any) -> bool:
            evict(self.path)
            return real(self)

        monkeypatch.setattr(base.ReplaySource, "grow_in_place", grow_in_place)
    elif where == "in_grow":  # _inspect read the metadata; the handle looks again

        def wrap(real: Callable[..., bool]) -> Callable[..., bool]:
            def grow(self: Any, source: Any, layout: Any) -> bool:
                evict(source.path)
                return real(self, source, layout)

            return grow

        for cls in _handles():
            monkeypatch.setattr(cls, "grow", wrap(vars(cls)["grow"]))
    else:  # a segment new to this reader, evicted before it is opened
        real_open = snapshot.open_segment

        def open_segment(store: str, m: Any, first: int, keys: Any, kwargs: Any) -> Any:
            wdir = os.path.join(store, "writers", m.writer_id)
            evict(os.path.join(wdir, parts_lib.segment_name(first, m.format)))
            return real_open(store, m, first, keys, kwargs)

        monkeypatch.setattr(snapshot, "open_segment", open_segment)


@pytest.mark.parametrize("where", ["before_grow", "in_grow", "open"])
@pytest.mark.parametrize(("fmt", "gone"), CASES)
def test_refresh_beside_an_eviction_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, gone: str | None, where: str
) -> None:
    path = str(tmp_path / "store")
    w = _writer(path, fmt)
    src = gr.open_source(path)
    before = src.ids(np.arange(len(src)))
    w.append(make_rows("w0", w.committed, 5 if where != "open" else 30))
    w.flush()  # the tail grew (and, for "open", a segment the reader never opened)
    grown = w.committed
    evict = _Evictor(w, gone, monkeypatch)
    _inject(where, evict, monkeypatch)
    src.refresh()
    assert evict.fired, "the injection did not run"
    _check(src, (grown, w.committed))
    # The previous snapshot's rows stay readable by id, each as committed.
    rows = src.read_ids_flat(before)
    check_rows(rows)
    np.testing.assert_array_equal(rows["seq"], np.arange(150 - CAPACITY, 150))
    w.close()


class _AheadOfEachOpen:
    """Drives writers between the reader's manifest read and its opens: each time the
    reader builds a writer's part, ``ahead[writer_id]`` writers commit two segments'
    rows first (two evictions: the oldest segment of the manifest the reader just read is
    unlinked before it opens it, the writer's promise being only the newest evicted one)."""

    def __init__(self, ws: dict[str, Any], ahead: dict[str, list[str]], monkeypatch: Any):
        self.ws, self.ahead, self.calls = ws, ahead, 0
        real = snapshot.build_part

        def build_part(store: str, m: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            for wid in self.ahead.get(m.writer_id, []):
                w = self.ws[wid]
                w.append(make_rows(wid, w.committed, 2 * SEGMENT))
                w.flush()
            return real(store, m, *args, **kwargs)

        monkeypatch.setattr(snapshot, "build_part", build_part)


def _whole_and_live(src: Any, ws: dict[str, Any]) -> None:
    """Each writer's rows in the snapshot are whole, back to back, the newest ``CAPACITY``
    of a commit the writer made (the snapshot's manifest)."""
    batch = src.read_flat(np.arange(len(src)))
    check_rows(batch)
    starts = [*src.writer_starts(), len(src)]
    for m, start, stop in zip(src.writers, starts[:-1], starts[1:]):
        seq = batch["seq"][start:stop]
        assert m.committed <= ws[m.writer_id].committed
        np.testing.assert_array_equal(seq, np.arange(m.committed - CAPACITY, m.committed))


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_refresh_catches_up_with_a_writer_that_evicts_before_every_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    # However fast the writer, each attempt keeps the segments it opened: the next one
    # only opens the segments committed since (the newest, the last to be evicted).
    path = str(tmp_path / "store")
    w = _writer(path, fmt)
    src = gr.open_source(path)
    w.append(make_rows("w0", w.committed, 2 * CAPACITY))  # none of the snapshot's is live
    w.flush()
    driver = _AheadOfEachOpen({"w0": w}, {"w0": ["w0"]}, monkeypatch)
    src.refresh()
    assert driver.calls >= 2, "no attempt found its oldest segment evicted"
    _whole_and_live(src, {"w0": w})
    w.close()


def test_refresh_reads_each_writers_manifest_just_before_opening_its_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # w1 commits (and evicts) while the reader opens w0's segments: the reader must not
    # open w1's segments from the manifest it read before that, nor open w0's again.
    path = str(tmp_path / "store")
    ws = {}
    for wid in ("w0", "w1"):
        ws[wid] = gr.ReplayWriter(
            path, "npy", capacity=CAPACITY, writer_id=wid, segment_rows=SEGMENT
        )
        ws[wid].append(make_rows(wid, 0, 150))
        ws[wid].flush()
    src = gr.open_source(path)
    for wid, w in ws.items():
        w.append(make_rows(wid, w.committed, 2 * CAPACITY))
        w.flush()
    driver = _AheadOfEachOpen(ws, {"w0": ["w1"]}, monkeypatch)
    src.refresh()
    assert driver.calls == 2  # one build a writer: no attempt failed
    _whole_and_live(src, ws)
    for w in ws.values():
        w.close()


def test_refresh_gives_up_after_the_deadline_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grain_replay.sources.parts import catch_up

    path = str(tmp_path / "store")
    w = _writer(path, "npy")
    src = gr.open_source(path)
    w.append(make_rows("w0", w.committed, 2 * CAPACITY))
    w.flush()
    _AheadOfEachOpen({"w0": w}, {"w0": ["w0"]}, monkeypatch)
    monkeypatch.setattr(catch_up, "CATCH_UP_S", 0.0)
    with pytest.raises(gr.InvalidStoreError, match=r"evict faster.*Fix: raise capacity"):
        src.refresh()
    w.close()


def test_a_segment_missing_under_an_unchanged_manifest_is_named_as_damage(
    tmp_path: Path,
) -> None:
    # No writer evicts: retrying cannot help, and the error says what is wrong.
    path = str(tmp_path / "store")
    w = _writer(path, "npy")
    w.close()
    (_, _, _, seg), *_ = _live_segments(w)
    shutil.rmtree(seg)
    with pytest.raises(gr.InvalidStoreError, match=r"seg-0+20: writer 'w0'.*damaged.*Fix"):
        gr.open_source(path)


def test_a_writer_removed_during_a_refresh_leaves_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "store")
    ws = open_writers(path, "npy", capacity=CAPACITY)
    src = gr.open_source(path)
    for w in ws:
        w.append(make_rows(w.writer_id, w.committed, 30))
        w.flush()
    ws[1].close()
    real = snapshot.build_part

    def build_part(store: str, m: Any, *args: Any, **kwargs: Any) -> Any:
        if m.writer_id == "w0":  # w1's folder goes after its manifest was read
            shutil.rmtree(os.path.join(path, "writers", "w1"), ignore_errors=True)
        return real(store, m, *args, **kwargs)

    monkeypatch.setattr(snapshot, "build_part", build_part)
    assert src.refresh() == CAPACITY
    assert [m.writer_id for m in src.writers] == ["w0"]
    ws[0].close()
