"""A snapshot of a bounded store on object storage: each writer's newest manifest version
and the pieces readable through it, and where a position or row id lies in them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from grain_replay.store import parts as parts_lib
from grain_replay.store.object_manifest import ObjectManifest

__all__ = ["ObjectPart", "ObjectSnapshot"]


@dataclasses.dataclass(frozen=True)
class ObjectPart:
    """One writer in a snapshot: its manifest and the pieces readable (this manifest's and
    those of the writer's manifest in the snapshot before)."""

    manifest: ObjectManifest
    firsts: np.ndarray  # int64, sorted
    rows: np.ndarray  # int64
    names: tuple[str, ...]

    @classmethod
    def of(cls, m: ObjectManifest, previous: ObjectPart | None) -> ObjectPart:
        pieces = {p.first: (p.rows, p.name) for p in m.pieces}
        # The previous manifest's own pieces only (not those it kept in turn): one
        # snapshot back, as the writers' grace period promises.
        for p in () if previous is None else previous.manifest.pieces:
            pieces.setdefault(p.first, (p.rows, p.name))
        order = sorted(pieces)
        return cls(
            m,
            np.array(order, dtype=np.int64),
            np.array([pieces[f][0] for f in order], dtype=np.int64),
            tuple(pieces[f][1] for f in order),
        )


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (weak keys)
class ObjectSnapshot:
    parts: tuple[ObjectPart, ...]
    ordinals: np.ndarray
    live_start: np.ndarray
    committed: np.ndarray
    starts: np.ndarray  # position of each part's first live row; last: the length
    part_of_ordinal: np.ndarray
    # Every readable piece of every writer ("piece g"), by the id of its first row
    # (sorted): that id, its rows, its (writer id, object name), and g by name.
    piece_ids: np.ndarray
    piece_rows: np.ndarray
    piece_names: tuple[tuple[str, str], ...]
    piece_at: dict[tuple[str, str], int]

    @classmethod
    def of(cls, parts: Sequence[ObjectPart]) -> ObjectSnapshot:
        ms = [p.manifest for p in parts]
        ordinals = np.array([m.ordinal for m in ms], dtype=np.int64)
        live = np.array([m.live for m in ms], dtype=np.int64)
        table = np.full(int(ordinals.max(initial=-1)) + 1, -1, dtype=np.int64)
        table[ordinals] = np.arange(len(ms))
        first_ids = np.concatenate(
            [np.zeros(0, np.int64)] + [parts_lib.make_ids(m.ordinal, p.firsts) for m, p in
                                       zip(ms, parts, strict=True)]
        )  # fmt: skip
        order = np.argsort(first_ids, kind="stable")
        every = [(m.writer_id, n) for m, p in zip(ms, parts, strict=True) for n in p.names]
        names = tuple(every[g] for g in order.tolist())
        return cls(
            tuple(parts),
            ordinals,
            np.array([m.live_start for m in ms], dtype=np.int64),
            np.array([m.committed for m in ms], dtype=np.int64),
            np.concatenate([[0], np.cumsum(live)]).astype(np.int64),
            table,
            first_ids[order],
            np.concatenate([np.zeros(0, np.int64)] + [p.rows for p in parts])[order],
            names,
            {name: g for g, name in enumerate(names)},
        )

    @property
    def n(self) -> int:
        return int(self.starts[-1])

    def locate(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = np.searchsorted(self.starts, pos, side="right") - 1
        return p, self.live_start[p] + pos - self.starts[p]

    def ids_at(self, pos: np.ndarray) -> np.ndarray:
        """The row id of each position (int64 in ``[0, n)``)."""
        if len(self.parts) == 1:
            return pos + parts_lib.make_ids(int(self.ordinals[0]), int(self.live_start[0]))
        p, seq = self.locate(pos)
        return parts_lib.make_ids(self.ordinals[p], seq)

    def locate_ids(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ordinal, seq = parts_lib.split_ids(ids)
        known = (ordinal >= 0) & (ordinal < len(self.part_of_ordinal))
        p = np.where(known, self.part_of_ordinal[np.where(known, ordinal, 0)], -1)
        ahead = (p < 0) | (seq >= self.committed[np.maximum(p, 0)])
        return p, seq, ahead

    def pieces_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(piece g, row in it, ok)`` of each row id (one search over every writer's
        pieces); ok where a readable piece of the snapshot holds the row."""
        if not len(self.piece_ids):
            zero = np.zeros(len(ids), dtype=np.int64)
            return zero, zero, np.zeros(len(ids), dtype=bool)
        g = np.searchsorted(self.piece_ids, ids, side="right") - 1
        np.maximum(g, 0, out=g)
        # below a writer's first piece: g is another writer's piece (or -1 -> 0), and the
        # row lies before it (local < 0: wraps past any count, unsigned) or 2**40 rows on
        local = ids - self.piece_ids[g]
        return g, local, local.view(np.uint64) < self.piece_rows[g].view(np.uint64)
