"""Reads by row id over several writers' back-to-back maps: a few numpy calls a leaf.

A bounded, many-writer store's snapshot maps each ``.npy`` writer's live segments
back to back (:class:`grain_replay.sources.parts.snapshot.Mapped`). A batch of
row ids from several writers is then grouped by writer with one sort, read with
one gather per leaf per writer, and put back in the batch's order with one
gather per leaf: no per-row Python, no segment walk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from grain_replay.sources.parts.snapshot import Snapshot
from grain_replay.store import parts as parts_lib
from grain_replay.store.layout import LeafSpec

__all__ = ["OrdinalMaps", "ordinal_maps", "read_mapped"]


class OrdinalMaps(NamedTuple):
    """Per writer ordinal, plus one last entry for ordinal -1 and unknown writers."""

    first: np.ndarray  # int64: the id of row 0 of the writer's map
    span: np.ndarray  # uint64: the map's rows (0: no writer)
    arrays: list[Any]  # the map's leaf -> array, or None


def ordinal_maps(snap: Snapshot) -> OrdinalMaps | None:
    """The tables of :func:`read_mapped` for ``snap``; None unless every writer is mapped."""
    maps = [part.mapped for part in snap.parts]
    if not all(m is not None for m in maps):
        return None
    size = len(snap.part_of_ordinal) + 1
    first = np.zeros(size, dtype=np.int64)
    span = np.zeros(size, dtype=np.uint64)
    arrays: list[Any] = [None] * size
    for o, m in zip(snap.ordinals.tolist(), maps):
        assert m is not None
        first[o] = parts_lib.make_ids(o, m.base)
        span[o] = m.stop - m.base
        arrays[o] = m.arrays
    return OrdinalMaps(first, span, arrays)


def read_mapped(
    maps: OrdinalMaps, ids: np.ndarray, spec: Mapping[str, LeafSpec], keys: Sequence[str]
) -> dict[str, np.ndarray] | None:
    """Leaves ``keys`` of the rows ``ids`` (int64) when each lies in its writer's map;
    None when one does not (another snapshot's row, an unknown writer: the caller's
    general path)."""
    first, span, arrays = maps
    # An id of an unknown or negative ordinal clips to an ordinal whose rows it misses
    # (below its first id, or 2**40 past it): caught with the rows outside a map.
    ordinal = np.clip(parts_lib.id_ordinals(ids), -1, len(first) - 1)
    rows = ids - first[ordinal]
    if not (rows.view(np.uint64) < span[ordinal]).all():  # negative rows wrap: outside
        return None
    order = np.argsort(ordinal, kind="stable")
    back = np.argsort(order)
    rows = rows[order]
    ends = np.cumsum(np.bincount(ordinal, minlength=len(first))).tolist()
    spans = [(o, lo, hi) for o, (lo, hi) in enumerate(zip([0, *ends], ends)) if hi > lo]
    out: dict[str, np.ndarray] = {}
    for key in keys:
        leaf = spec[key]
        buf = np.empty((len(ids), *leaf.shape), leaf.dtype)
        for o, lo, hi in spans:  # rows checked above: "clip" writes out unbuffered
            np.take(arrays[o][key], rows[lo:hi], axis=0, out=buf[lo:hi], mode="clip")
        out[key] = np.take(buf, back, axis=0)
    return out
