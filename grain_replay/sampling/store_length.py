"""A growing store's committed length as replay sees it (re-read when due), and its row layout."""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import numpy as np

from grain_replay.errors import ReplayCheckpointError
from grain_replay.sources.capabilities import ReadsIds, Refreshable
from grain_replay.store import parts as parts_lib

__all__ = ["StoreLength", "parse_layout", "probe_copy"]


def _stamp(path: str) -> tuple[int, int, int] | None:
    """``(mtime_ns, size, inode)`` of ``path``, None if it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _tick_bound(mtime_ns: int) -> int:
    """Nanoseconds after a change within which another change may share its mtime.

    File systems that keep nanoseconds (ext4, xfs, btrfs, tmpfs, overlayfs)
    stamp with the kernel's coarse clock, a tick of at most 10 ms: 50 ms is
    safe. A whole-millisecond mtime suggests a coarse file system (FAT, HFS+,
    ext3, some network file systems): 2 s.
    """
    return 2_000_000_000 if mtime_ns % 1_000_000 == 0 else 50_000_000


def probe_copy(source: Any) -> Any:
    """An independent copy of a growing ``source`` to refresh apart from the one that
    reads (grain_replay's sources pickle without handles); ``source`` itself when it
    cannot grow or does not pickle."""
    if isinstance(source, Refreshable):
        try:
            return pickle.loads(pickle.dumps(source))
        except Exception:
            return source
    return source


class StoreLength:
    """The committed length of a source, re-read on a schedule of steps or on request.

    The length is read from a copy of the source that never reads rows (its
    ``refresh()`` re-reads the metadata only), so looking costs no reopening of the
    store's files; the reading copy refreshes only when a drawn row is past its end
    (``RowReader`` in ``sampling/replay.py``). A scheduled look at a local store first
    compares the store's ``stat`` (a commit replaces the metadata file, which changes the
    directory's or the file's mtime) and re-reads the metadata only on a change
    (and once more after the file system's clock has ticked, in case a second
    commit shared the first one's mtime); ``refresh()`` always re-reads.
    """

    def __init__(self, source: Any, refresh_every: int | None) -> None:
        self._every = refresh_every
        self._forced = False
        self.looks = 0  # times the length was re-read
        self.n = len(source)
        self.source = source  # the store (for its checkpoint's watermark)
        self._stamp: tuple[int, int, int] | None = None
        self._settled = False  # whether the stamp was seen after its tick had passed
        self._probe = probe_copy(source)
        # By-id stores: the snapshot's writers as [writer_id, ordinal, live_start,
        # committed] (made once per look), and a restored checkpoint's layout that the
        # positions map through until the next look (None: the probe's snapshot).
        self._layout: list[list[Any]] | None = None
        self._pinned: list[list[Any]] | None = None

    @property
    def by_id(self) -> bool:
        """Whether rows travel as ids: a bounded or many-writer store, whose positions
        move as writers evict (see :class:`grain_replay.sources.PartsDataSource`)."""
        return isinstance(self._probe, ReadsIds)

    @property
    def writers(self) -> list[Any]:
        """The writers' manifests of the snapshot the length was read from (by-id stores)."""
        writers: list[Any] = self._probe.writers
        return writers

    def layout(self) -> list[list[Any]]:
        """The writers the positions map through (by-id stores), oldest row first each:
        ``[writer_id, ordinal, live_start, committed]`` in reading order. Not to be mutated."""
        if self._pinned is not None:
            return self._pinned
        if self._layout is None:
            self._layout = [
                [m.writer_id, int(m.ordinal), int(m.live_start), int(m.committed)]
                for m in self.writers
            ]
        return self._layout

    @property
    def bound(self) -> int:
        """The length the last draw drew below (a plain store's watermark)."""
        return self.n

    def commit_watermark(self) -> dict[str, int] | None:
        """Each writer's committed rows in the snapshot the draws come from (by-id stores;
        None for a plain store, whose watermark is :attr:`bound`)."""
        if not self.by_id:
            return None
        return {w: hi for w, _, _, hi in self.layout()}

    def pin(self, layout: list[list[Any]] | None) -> None:
        """Maps positions through ``layout`` (a checkpoint's, checked by :func:`parse_layout`)
        until the next look, as the run that saved it did: the rows drawn stay below its
        watermark until then. None: through the probe's snapshot."""
        self._pinned = layout

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """The row ids of ``positions`` in the snapshot the length was read from."""
        if self._pinned is None:
            ids: np.ndarray = self._probe.ids(positions, check=False)
            return ids
        table = np.array([row[1:] for row in self._pinned], dtype=np.int64).reshape(-1, 3)
        ordinal, lo, hi = table.T
        starts = np.concatenate([[0], np.cumsum(hi - lo)])
        pos = np.asarray(positions, dtype=np.int64)
        p = np.searchsorted(starts, pos, side="right") - 1
        return parts_lib.make_ids(ordinal[p], lo[p] + pos - starts[p])

    def _changed(self) -> bool:
        """False only when the local store's stat is what it was at the last look."""
        if self.by_id:
            return True  # its refresh() is the listing of what changed
        path = getattr(self._probe, "path", None)
        if not isinstance(path, str) or "://" in path:
            return True
        stamp = _stamp(path)
        if stamp is None:
            return True
        # Two commits within one tick of the file system's clock leave the same
        # stamp. A stamp first seen within a tick of its change is confirmed by
        # one more look once that tick has surely passed.
        recent = time.time_ns() - stamp[0] < _tick_bound(stamp[0])
        if stamp != self._stamp:
            self._stamp, self._settled = stamp, not recent
            return True
        if not self._settled and not recent:
            self._settled = True
            return True
        return False

    def request(self) -> None:
        """The next draw re-reads the length."""
        self._forced = True

    def at(self, step: int) -> int:
        """The length to draw step ``step`` from (re-read when due)."""
        due = self._forced or (
            self._every is not None and step % self._every == 0 and self._changed()
        )
        if due:
            self._forced = False
            self.looks += 1
            probe = self._probe
            n = int(probe.refresh()) if isinstance(probe, Refreshable) else len(probe)
            self._layout = self._pinned = None
            # A reader never goes back: a store is only appended to (a bounded
            # store's positions are its snapshot's, whatever their count).
            self.n = n if self.by_id else max(self.n, n)
        return self.n


def parse_layout(layout: Any, n: int) -> list[list[Any]]:
    """A saved positions' layout (``[writer_id, ordinal, live_start, committed]`` a writer)
    as :meth:`StoreLength.pin` takes it.

    Raises:
      ReplayCheckpointError: it is malformed, or its live rows are not the state's ``n``.
    """
    try:
        out: list[list[Any]] = [[str(w), int(o), int(lo), int(hi)] for w, o, lo, hi in layout]
    except (TypeError, ValueError) as e:
        raise ReplayCheckpointError(
            f"Not a uniform replay state: its writers' layout is malformed ({e}). Fix: pass "
            "bytes from get_state() of a loader made with the same arguments."
        ) from None
    bad = any(o < 0 or not 0 <= lo <= hi for _, o, lo, hi in out)
    if bad or sum(hi - lo for _, _, lo, hi in out) != n:
        raise ReplayCheckpointError(
            f"Not a uniform replay state: its writers' layout {out} does not hold the {n} "
            "live rows it drew from. Fix: pass bytes from get_state() of a loader made "
            "with the same arguments."
        )
    return out
