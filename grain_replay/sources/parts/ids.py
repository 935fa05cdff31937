"""Row ids of a many-writer store's snapshot: positions to ids and back, reads by id.

A row's id is ``ordinal << ID_SHIFT | seq`` (:func:`grain_replay.store.parts.make_ids`): it
names the row while it lives, whatever the snapshot. These functions map ids to
the writer part and sequence number of a :class:`~grain_replay.sources.parts.snapshot.Snapshot`
and decide what a read by id returns for a row that is gone; the source
(:class:`~grain_replay.sources.parts.source.PartsDataSource`) refreshes and gathers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from grain_replay.errors import EvictedRowError, InvalidArgumentError
from grain_replay.sources.checks import check_indices
from grain_replay.sources.parts.schema import WRITER_KEY
from grain_replay.sources.parts.snapshot import Snapshot
from grain_replay.store import parts as parts_lib

__all__ = [
    "EVICTED_MODES",
    "check_evicted",
    "ids_at",
    "locate_ids",
    "positions_of",
    "read_mapped",
    "stand_ins",
]

# What a read by id does with a row that cannot be read any more.
EVICTED_MODES = ("raise", "replace")


def check_evicted(evicted: object, where: str) -> str:
    if evicted not in EVICTED_MODES:
        raise InvalidArgumentError(
            f"{where}: evicted must be one of {EVICTED_MODES}, got {evicted!r}. Fix: pass "
            "evicted='raise' or evicted='replace'."
        )
    return str(evicted)


def ids_at(
    snap: Snapshot, positions: Sequence[int] | np.ndarray, *, check: bool, where: str
) -> np.ndarray:
    """The row id (int64) of each position of ``snap``; ``check=False`` trusts positions to
    be int64 in ``[0, len)`` (a sampler's draws)."""
    if not check and len(snap.parts) == 1:
        shift = parts_lib.make_ids(int(snap.ordinals[0]), int(snap.live_start[0]))
        return np.asarray(positions, dtype=np.int64) + shift
    pos = check_indices(positions, snap.n, where)
    p, seq = snap.locate(pos)
    return parts_lib.make_ids(snap.ordinals[p], seq)


def positions_of(snap: Snapshot, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The position of each id in ``snap``, -1 where the row is not live in it."""
    ids = np.asarray(ids, dtype=np.int64)
    if not len(snap.parts):
        return np.full(ids.shape, -1, dtype=np.int64)
    ordinal, seq = parts_lib.split_ids(ids)
    known = (ordinal >= 0) & (ordinal < len(snap.part_of_ordinal))
    p = np.where(known, snap.part_of_ordinal[np.where(known, ordinal, 0)], -1)
    pc = np.maximum(p, 0)
    live = (p >= 0) & (seq >= snap.live_start[pc]) & (seq < snap.committed[pc])
    return np.where(live, snap.starts[pc] + seq - snap.live_start[pc], -1)


def read_mapped(
    snap: Snapshot, ids: np.ndarray, seg_keys: Sequence[str], keys: Sequence[str]
) -> dict[str, np.ndarray] | None:
    """Leaves ``keys`` of rows ``ids`` in one gather per leaf, when the snapshot is one
    writer whose live rows are mapped and holds them all; else None."""
    if len(snap.parts) != 1 or not len(ids) or snap.parts[0].mapped is None:
        return None
    m = snap.parts[0].mapped
    rows = ids - parts_lib.make_ids(int(snap.ordinals[0]), m.base)
    if int(rows.min()) < 0 or int(rows.max()) >= m.stop - m.base:
        return None
    out = {k: np.take(m.arrays[k], rows, axis=0) for k in seg_keys}
    if WRITER_KEY in keys:
        out[WRITER_KEY] = np.full(len(ids), snap.ordinals[0], dtype=np.int64)
    return {k: out[k] for k in keys}


def locate_ids(snap: Snapshot, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(part, seq, ahead)`` of each id: its part in ``snap`` (-1: no such writer), its
    sequence number, and whether it is newer than ``snap`` (a refresh may find it)."""
    ordinal, seq = parts_lib.split_ids(ids)
    known = (ordinal >= 0) & (ordinal < len(snap.part_of_ordinal))
    p = np.where(known, snap.part_of_ordinal[np.where(known, ordinal, 0)], -1)
    ahead = (p < 0) | (seq >= snap.committed[np.maximum(p, 0)])
    return p, seq, ahead


def stand_ins(
    snap: Snapshot, ids: np.ndarray, p: np.ndarray, seq: np.ndarray, evicted: str, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(seq, ok)``: the rows to read for ``ids`` and which of them are the rows asked for.

    With ``evicted="replace"`` a row that cannot be read any more is replaced by a live
    row of its writer (``live_start + (seq - live_start) % live``, a function of the
    snapshot); with ``"raise"`` it raises.

    Raises:
      EvictedRowError: an id of no writer of the store, or (``"raise"``, or a writer
        with no live row) a row that cannot be read any more.
    """
    if (p < 0).any():
        raise EvictedRowError(
            f"{where}: no writer with ordinal {parts_lib.id_ordinals(int(ids[p < 0][0]))} in "
            "the store. Fix: pass ids returned by src.ids() of this store."
        )
    ok = snap.readable(p, seq)
    if ok.all():
        return seq, ok
    bad = int(np.argmin(ok))
    part = snap.parts[int(p[bad])]
    if evicted != "replace" or part.manifest.live == 0:
        raise EvictedRowError(
            f"{where}: writer {part.manifest.writer_id!r}: row {int(seq[bad])} was evicted "
            "before this reader opened its segment. Fix: refresh() more often than the "
            "writers evict, or raise capacity."
        )
    start, live = snap.live_start[p], snap.committed[p] - snap.live_start[p]
    return np.where(ok, seq, start + (seq - start) % np.maximum(live, 1)), ok
