"""``resume_from=`` on object storage: which pieces a writer part cut back to a checkpoint names.

A cut to ``rows`` keeps the writer's rows ``[max(0, rows - capacity), rows)``. Its
newest manifest version names the live pieces; rows it evicted since the checkpoint
are in pieces older versions name, which stay on the bucket for ``evict_grace_s``
(docs/replay_store.md#on-object-storage). A row ``r`` a version named is still the
writer's row ``r`` while no later version committed ``r`` rows or fewer (a cut since, after
which row ``r`` was written again). Pieces are immutable and a manifest names a piece
whole, so a piece that runs past the cut (or starts before the rows still needed) is
copied into a new piece of just the rows kept; the rest are named as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from grain_replay.errors import InvalidStoreError
from grain_replay.store import layout as layout_lib
from grain_replay.store.object_manifest import ObjectManifest, Piece, leaf_offsets
from grain_replay.store.objects import ObjectStore

__all__ = ["CutPiece", "cut_manifest", "plan_cut", "read_plan"]


@dataclasses.dataclass(frozen=True)
class CutPiece:
    """Rows ``[first, first + rows)`` of the cut part, read from the existing ``source``
    piece (named as it is when it holds exactly those rows, else copied)."""

    first: int
    rows: int
    source: Piece

    @property
    def reused(self) -> bool:
        return self.source.first == self.first and self.source.rows == self.rows


def plan_cut(
    versions: Iterable[ObjectManifest], existing: set[str], rows: int, where: str
) -> list[CutPiece]:
    """The pieces of the part cut back to its first ``rows`` rows, oldest first.

    Args:
      versions: the writer's manifest versions on the bucket (any order; the newest is
        its commit point).
      existing: the names of the writer's piece objects on the bucket.
      rows: the rows the cut keeps (the checkpoint's committed count of this writer).
      where: the writer, as messages name it.

    Raises:
      InvalidStoreError: ``rows`` is beyond what the writer committed, or a row the cut
        part holds live is in no piece left on the bucket (evicted longer than the
        grace period ago); nothing is changed.
    """
    ordered = sorted(versions, key=lambda m: m.version, reverse=True)
    if not ordered:
        raise InvalidStoreError(
            f"{where}: the writer has no manifest version left to cut back (something "
            "else deleted them). Fix: let only grain_replay delete objects of the store, "
            "or drop resume_from."
        )
    newest = ordered[0]
    if rows > newest.committed:
        raise InvalidStoreError(
            f"{where}: the checkpoint to resume from covers {rows} rows of this writer, but "
            f"it holds {newest.committed} committed rows: rows the checkpoint replayed are "
            "gone, or this is another store or writer. Fix: resume from a checkpoint of this "
            "store (an older one), or pass this writer's own id."
        )
    live_start = 0 if newest.capacity is None else max(0, rows - newest.capacity)
    # Each piece with the rows it still holds of this writer's history (newest first).
    usable: list[tuple[Piece, int]] = []
    bound = newest.committed
    for m in ordered:
        bound = min(bound, m.committed)
        usable += [(p, bound) for p in m.pieces if p.name in existing and p.first < bound]
    out: list[CutPiece] = []
    at = live_start
    while at < rows:
        found = next(((p, b) for p, b in usable if p.first <= at < min(b, p.first + p.rows)), None)
        if found is None:
            raise InvalidStoreError(
                f"{where}: the checkpoint's watermark keeps rows [{live_start}, {rows}) of this "
                f"writer (capacity {newest.capacity}), but row {at} is in no piece left on the "
                f"bucket: it committed {newest.committed - rows} rows after the checkpoint, "
                "and the pieces it evicted are deleted evict_grace_s after their eviction. "
                "Fix: resume from a newer checkpoint (checkpoint the learner more often than "
                "evict_grace_s), give the writers a longer evict_grace_s, or reopen without "
                "resume_from (the rows written after the checkpoint stay)."
            )
        piece, bound = found
        start = piece.first if at == live_start else at  # the first piece may start earlier
        end = min(rows, bound, piece.first + piece.rows)
        out.append(CutPiece(start, end - start, piece))
        at = end
    return out


def read_plan(store: ObjectStore, writer_id: str, rows: int, where: str) -> list[CutPiece]:
    """:func:`plan_cut` of ``writer_id``'s part on the bucket now (its manifest versions
    and piece objects listed and read)."""
    keys = [store.manifest_key(writer_id, v) for v, _ in store.manifest_versions(writer_id)]
    versions = [
        ObjectManifest.from_json(raw, f"{store.shown}:{key}")
        for key, raw in store.get_many(keys).items()
    ]
    existing = {key.rsplit("/", 1)[-1] for key, _ in store.list_pieces(writer_id)}
    return plan_cut(versions, existing, rows, where)


def cut_manifest(
    store: ObjectStore,
    m: ObjectManifest,
    rows: int,
    epoch: int,
    next_attempt: Callable[[], int],
    where: str,
) -> ObjectManifest:
    """The manifest version after ``m`` (the commit point, this writer's) that cuts the part
    back to ``rows`` rows, its copied pieces written (not yet published); ``m`` itself when
    ``rows`` is its committed count. ``next_attempt`` numbers each new piece (with
    ``epoch``, its unique name)."""
    if rows == m.committed:
        return m
    plan = read_plan(store, m.writer_id, rows, where)
    pieces = []
    spec = None if m.schema is None else layout_lib.StoreMetadata.from_json(m.schema, where=where)
    for cut in plan:
        if cut.reused:
            pieces.append(cut.source)
            continue
        assert spec is not None  # rows were committed: the schema is bound
        raw = store.get(store.piece_key(m.writer_id, cut.source))
        if raw is None:
            raise InvalidStoreError(
                f"{where}: piece {cut.source.name} vanished while the part was cut back to "
                "the checkpoint (something else deletes the store's objects). Fix: let only "
                "grain_replay delete objects of the store, and reopen the writer."
            )
        skip = cut.first - cut.source.first
        offsets = leaf_offsets(spec.leaves, cut.source.rows)
        data = b"".join(
            raw[at + skip * width : at + (skip + cut.rows) * width]
            for at, width in offsets.values()
        )
        piece = Piece(cut.first, cut.rows, epoch, next_attempt())
        store.put(store.piece_key(m.writer_id, piece), data)
        pieces.append(piece)
    return dataclasses.replace(
        m, committed=rows, pieces=tuple(pieces), version=m.version + 1, epoch=epoch
    )
