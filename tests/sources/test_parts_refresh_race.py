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
from parts_child import check_rows, make_rows

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
        self.real_remove = parts_writer.remove_path
        monkeypatch.setattr(parts_writer, "remove_path", self._remove)

    def _remove(self, path: str) -> None:
        if self.gone is None or not os.path.isdir(path):
            self.real_remove(path)
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
