"""Rows of the pieces of an object-storage snapshot: cached ones with one take per leaf a
batch, the rest fetched (whole pieces into the cache, or ranges), all of a batch at once.

A warm batch costs a few numpy calls over the batch's rows whatever the pieces it touches:
the snapshot's pieces are found with one search, their places in the
:class:`~grain_replay.sources.parts.piece_cache.PieceArena` with one gather (a table
per snapshot of each piece's ``(slot, token)``, checked under the arena's lock), and
each leaf's rows with one take.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.parts.object_snapshot import ObjectSnapshot
from grain_replay.sources.parts.piece_cache import PieceArena
from grain_replay.sources.surface import current_pid
from grain_replay.store.layout import LeafSpec
from grain_replay.store.object_manifest import leaf_offsets

__all__ = ["Bucket", "PieceReader"]

# Rows of one piece closer than this many bytes apart are fetched by one ranged GET.
MERGE_GAP_BYTES = 64 * 1024


class Bucket(Protocol):
    """What the reader needs of :class:`~grain_replay.store.objects.ObjectStore`."""

    def writer_key(self, writer_id: str, *parts: str) -> str: ...

    def cat_ranges(
        self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]
    ) -> list[bytes | BaseException]: ...


class _Slots:
    """Where the arena held each piece of one snapshot when last seen: a hint, checked
    against the arena's token under its lock (a stale or torn entry only misses)."""

    def __init__(self, pieces: int) -> None:
        self.slot = np.full(pieces, -1, dtype=np.int64)
        self.token = np.full(pieces, -1, dtype=np.int64)


class PieceReader:
    """Reads rows of a snapshot's pieces for one source in one process (``pid``).

    Args:
      where: the store, for messages.
      stored: every stored leaf, in piece order (a piece's byte layout).
      leaves: the leaves read (and cached), a subset of ``stored``.
      cache_bytes: bound of the arena of whole pieces (0: none; ranged GETs only).
    """

    def __init__(
        self,
        where: str,
        stored: Mapping[str, LeafSpec],
        leaves: Mapping[str, LeafSpec],
        cache_bytes: int,
    ) -> None:
        self.pid = current_pid()
        self.where = where
        self._stored = dict(stored)
        self._piece_row_bytes = sum(row for _, row in leaf_offsets(self._stored, 1).values())
        self.arena = PieceArena(cache_bytes, leaves) if cache_bytes else None
        self._slots: weakref.WeakKeyDictionary[ObjectSnapshot, _Slots] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return 0 if self.arena is None else self.arena.nbytes

    def _table(self, snap: ObjectSnapshot) -> _Slots:
        table = self._slots.get(snap)
        if table is None:
            with self._lock:
                table = self._slots.get(snap)
                if table is None:
                    table = self._slots[snap] = _Slots(len(snap.piece_names))
        return table

    def keep_only(self, snap: ObjectSnapshot) -> None:
        """Drops the cached pieces ``snap`` does not name (never read again) and tells
        its table where the others are."""
        if self.arena is None:
            return
        self.arena.keep_only(snap.piece_at)
        table = self._table(snap)
        for key, slot, token in self.arena.entries():
            g = snap.piece_at.get(key)  # type: ignore[call-overload]  # (writer id, name)
            if g is not None:
                table.slot[g], table.token[g] = slot, token

    def read(
        self,
        bucket: Bucket,
        snap: ObjectSnapshot,
        ids: np.ndarray,
        out: Mapping[str, np.ndarray],
    ) -> np.ndarray:
        """Fills ``out[leaf][i]`` with the row of id ``ids[i]`` for each leaf of ``out``;
        returns which rows were read (False: no piece of the snapshot holds it, or its
        piece is gone from the bucket)."""
        g, local, ok = snap.pieces_of(ids)
        if not out or not len(ids) or not ok.any():
            return ok
        at = None if ok.all() else np.flatnonzero(ok)
        if self.arena is not None:
            at = self._from_arena(self.arena, snap, g, local, out, at)
            if at is not None and not len(at):
                return ok
        if at is None:
            at = np.arange(len(ids))
        self._fetch(bucket, snap, g, local, out, at, ok)
        return ok

    def _from_arena(
        self,
        arena: PieceArena,
        snap: ObjectSnapshot,
        g: np.ndarray,
        local: np.ndarray,
        out: Mapping[str, np.ndarray],
        at: np.ndarray | None,
    ) -> np.ndarray | None:
        """Copies the rows at ``at`` (None: all) that the arena holds; returns those left
        (None: all)."""
        table = self._table(snap)
        gs, ls = (g, local) if at is None else (g[at], local[at])
        hit = arena.copy_rows(table.slot[gs], table.token[gs], ls, out, at)
        if hit.all():
            return np.zeros(0, dtype=np.int64)
        left = np.flatnonzero(~hit) if at is None else at[~hit]
        # pieces this table has not seen held (put through another snapshot, another
        # thread, or before this snapshot's table was made): one look-up each
        found = False
        for x in np.unique(g[left]).tolist():
            held = arena.find(snap.piece_names[x])
            if held is not None:
                table.slot[x], table.token[x] = held
                found = True
        if found:
            gl = g[left]
            again = arena.copy_rows(table.slot[gl], table.token[gl], local[left], out, left)
            left = left[~again]
        return left

    def _fetch(
        self,
        bucket: Bucket,
        snap: ObjectSnapshot,
        g: np.ndarray,
        local: np.ndarray,
        out: Mapping[str, np.ndarray],
        at: np.ndarray,
        ok: np.ndarray,
    ) -> None:
        """Rows ``at`` from the bucket, all requests at once: whole pieces that fit the
        arena (then held), ranges of the others (one GET per leaf per run of rows)."""
        arena = self.arena
        order = np.argsort(g[at], kind="stable")
        srt = at[order]  # rows grouped by piece
        gs = g[srt]
        edges = [0, *(np.flatnonzero(np.diff(gs)) + 1).tolist(), len(srt)]
        whole: list[tuple[int, np.ndarray]] = []  # (piece, its rows of the batch)
        keys, starts, ends, plan = [], [], [], []
        for lo_g, hi_g in itertools.pairwise(edges):
            x = int(gs[lo_g])
            sel = srt[lo_g:hi_g]
            count = int(snap.piece_rows[x])
            if arena is not None and arena.fits(count):
                whole.append((x, sel))
                continue
            key = self._object(bucket, snap, x)
            offs = leaf_offsets(self._stored, count)
            rows = local[sel]
            by_row = np.argsort(rows, kind="stable")
            sel, rows = sel[by_row], rows[by_row]
            for name in out:
                start, row = offs[name]
                gap = max(1, MERGE_GAP_BYTES // max(row, 1))
                cuts = np.flatnonzero(np.diff(rows) > gap) + 1
                for run_sel, run in zip(np.split(sel, cuts), np.split(rows, cuts), strict=True):
                    lo, hi = int(run[0]), int(run[-1]) + 1
                    keys.append(key)
                    starts.append(start + lo * row)
                    ends.append(start + hi * row)
                    plan.append((name, run_sel, run - lo))
        sizes = [self._piece_row_bytes * int(snap.piece_rows[x]) for x, _ in whole]
        piece_keys = [self._object(bucket, snap, x) for x, _ in whole]
        # network I/O outside every lock
        got = bucket.cat_ranges(piece_keys + keys, [0] * len(whole) + starts, sizes + ends)
        if arena is not None:  # the pieces that came: the arrays grow once, to hold them
            came = [x for (x, _), d in zip(whole, got, strict=False) if isinstance(d, bytes)]
            arena.reserve(sum(int(snap.piece_rows[x]) for x in came))
        table = self._table(snap)
        for (x, sel), key, size, data in zip(
            whole, piece_keys, sizes, got[: len(whole)], strict=True
        ):
            if isinstance(data, FileNotFoundError):
                ok[sel] = False  # deleted: past the grace period
                continue
            if isinstance(data, BaseException):
                raise data
            if len(data) != size:
                raise InvalidStoreError(
                    f"{self.where}: piece {key!r} holds {len(data)} bytes, its manifest "
                    f"promises {size}. Fix: the store was changed by something other than "
                    "its writers; write it again."
                )
            count = int(snap.piece_rows[x])
            views = self._views(data, count)
            rows = local[sel]
            for name, dst in out.items():
                dst[sel] = views[name][rows]
            assert arena is not None
            held = arena.put(snap.piece_names[x], views, count)
            if held is not None:
                table.slot[x], table.token[x] = held
        for (name, run_sel, rel), data in zip(plan, got[len(whole) :], strict=True):
            if isinstance(data, FileNotFoundError):
                ok[run_sel] = False  # deleted: past the grace period
                continue
            if isinstance(data, BaseException):
                raise data
            leaf = self._stored[name]
            block = np.frombuffer(data, dtype=leaf.dtype).reshape(-1, *leaf.shape)
            out[name][run_sel] = block[rel]

    @staticmethod
    def _object(bucket: Bucket, snap: ObjectSnapshot, x: int) -> str:
        writer_id, name = snap.piece_names[x]
        return f"{bucket.writer_key(writer_id, 'pieces')}/{name}"

    def _views(self, data: bytes, count: int) -> dict[str, np.ndarray]:
        """Every stored leaf of a whole piece of ``count`` rows, as arrays over its bytes."""
        buf = np.frombuffer(data, dtype=np.uint8)
        views = {}
        for name, (at, row) in leaf_offsets(self._stored, count).items():
            leaf = self._stored[name]
            views[name] = buf[at : at + row * count].view(leaf.dtype).reshape(count, *leaf.shape)
        return views
