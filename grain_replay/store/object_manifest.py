"""What a writer on object storage commits: its pieces (one flush's rows, every leaf's bytes
leaf after leaf) and its manifest versions (the commit points), as JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.store import parts as parts_lib
from grain_replay.store.layout import LeafSpec

__all__ = [
    "LAYOUT_VERSION",
    "ObjectManifest",
    "Piece",
    "leaf_offsets",
]

LAYOUT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Piece:
    """One flush's rows of a writer: ``rows`` rows from sequence number ``first``."""

    first: int
    rows: int
    epoch: int  # the lease epoch of the writer that wrote it
    attempt: int  # the writer's flush attempt that wrote it: with epoch, names it uniquely

    @property
    def name(self) -> str:
        return f"{self.first:012d}-{self.epoch:012d}-{self.attempt:012d}.raw"


def leaf_offsets(spec: Mapping[str, LeafSpec], rows: int) -> dict[str, tuple[int, int]]:
    """Leaf -> ``(byte offset in a piece of rows rows, bytes a row)``: leaves one after
    another in the schema's order."""
    out, at = {}, 0
    for key, leaf in spec.items():
        row = leaf.dtype.itemsize * int(np.prod(leaf.shape, dtype=np.int64))
        out[key] = (at, row)
        at += row * rows
    return out


@dataclasses.dataclass(frozen=True)
class ObjectManifest:
    """One commit of a writer on object storage (an immutable manifest version)."""

    writer_id: str
    ordinal: int
    capacity: int | None
    committed: int
    pieces: tuple[Piece, ...]  # pieces holding live rows, oldest first
    version: int
    epoch: int  # lease epoch of the writer that published it
    schema: str | None = None

    @property
    def live_start(self) -> int:
        return 0 if self.capacity is None else max(0, self.committed - self.capacity)

    @property
    def live(self) -> int:
        return self.committed - self.live_start

    def as_manifest(self) -> parts_lib.Manifest:
        """The POSIX manifest's shape (``src.writers``, sampler slot tables): pieces as
        segments (``segment_rows``: the largest piece, which no reader arithmetic uses)."""
        return parts_lib.Manifest(
            writer_id=self.writer_id,
            ordinal=self.ordinal,
            format="npy",
            capacity=self.capacity,
            segment_rows=max([p.rows for p in self.pieces] or [1]),
            committed=self.committed,
            segments=tuple(parts_lib.Segment(p.first, p.rows) for p in self.pieces),
            schema=self.schema,
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "layout": LAYOUT_VERSION,
                "writer_id": self.writer_id,
                "ordinal": self.ordinal,
                "format": "npy",
                "capacity": self.capacity,
                "committed": self.committed,
                "pieces": [[p.first, p.rows, p.epoch, p.attempt] for p in self.pieces],
                "version": self.version,
                "epoch": self.epoch,
                "schema": self.schema,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> ObjectManifest:
        try:
            raw = json.loads(text)
            if int(raw["layout"]) > LAYOUT_VERSION:
                raise ValueError(f"layout {raw['layout']} is newer than this grain_replay")
            return cls(
                writer_id=str(raw["writer_id"]),
                ordinal=int(raw["ordinal"]),
                capacity=None if raw["capacity"] is None else int(raw["capacity"]),
                committed=int(raw["committed"]),
                pieces=tuple(Piece(*(int(x) for x in p)) for p in raw["pieces"]),
                version=int(raw["version"]),
                epoch=int(raw["epoch"]),
                schema=raw.get("schema"),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidStoreError(
                f"{where}: the writer manifest is malformed ({type(e).__name__}: {e}). "
                "Fix: delete that manifest version; the writer's previous one is in force."
            ) from e
