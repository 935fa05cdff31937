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


@dataclasses.dataclass(frozen=True)
class ObjectSnapshot:
    parts: tuple[ObjectPart, ...]
    ordinals: np.ndarray
    live_start: np.ndarray
    committed: np.ndarray
    starts: np.ndarray  # position of each part's first live row; last: the length
    part_of_ordinal: np.ndarray

    @classmethod
    def of(cls, parts: Sequence[ObjectPart]) -> ObjectSnapshot:
        ms = [p.manifest for p in parts]
        ordinals = np.array([m.ordinal for m in ms], dtype=np.int64)
        live = np.array([m.live for m in ms], dtype=np.int64)
        table = np.full(int(ordinals.max(initial=-1)) + 1, -1, dtype=np.int64)
        table[ordinals] = np.arange(len(ms))
        return cls(
            tuple(parts),
            ordinals,
            np.array([m.live_start for m in ms], dtype=np.int64),
            np.array([m.committed for m in ms], dtype=np.int64),
            np.concatenate([[0], np.cumsum(live)]).astype(np.int64),
            table,
        )

    @property
    def n(self) -> int:
        return int(self.starts[-1])

    def locate(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p = np.searchsorted(self.starts, pos, side="right") - 1
        return p, self.live_start[p] + pos - self.starts[p]

    def locate_ids(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ordinal, seq = parts_lib.split_ids(ids)
        known = (ordinal >= 0) & (ordinal < len(self.part_of_ordinal))
        p = np.where(known, self.part_of_ordinal[np.where(known, ordinal, 0)], -1)
        ahead = (p < 0) | (seq >= self.committed[np.maximum(p, 0)])
        return p, seq, ahead

    def piece_of(self, p: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(piece index in its part, ok)``: ok where a readable piece holds the row."""
        piece = np.zeros(len(p), dtype=np.int64)
        ok = np.zeros(len(p), dtype=bool)
        for k in np.unique(p):
            sel = np.flatnonzero(p == k)
            part = self.parts[int(k)]
            j = np.searchsorted(part.firsts, seq[sel], side="right") - 1
            jc = np.maximum(j, 0)
            inside = (j >= 0) & (seq[sel] < part.firsts[jc] + part.rows[jc])
            piece[sel], ok[sel] = jc, inside
        return piece, ok
