"""A writer part's manifest arithmetic: segment sizes, what a commit evicts, what a resume cuts.

Pure functions of :class:`~grain_replay.store.parts.Manifest`; the files they describe are
written and removed by :class:`~grain_replay.writers.parts_writer.PartWriter`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from grain_replay.errors import InvalidArgumentError, InvalidStoreError
from grain_replay.store import layout as layout_lib
from grain_replay.store import parts as parts_lib
from grain_replay.store.formats import PAGE

__all__ = ["check_reopen", "committed", "cut", "default_segment_rows"]

# Segments of an unbounded writer.
UNBOUNDED_SEGMENT_ROWS = 1 << 20
# A bounded writer's segment: capacity / SEGMENTS_PER_CAPACITY rows, so the disk
# holds at most capacity + (1 + RETAIN_SEGMENTS) segments of rows.
SEGMENTS_PER_CAPACITY = 16


def default_segment_rows(
    capacity: int | None, fmt: str = "", leaves: dict[str, layout_lib.LeafSpec] | None = None
) -> int:
    """``ceil(capacity / 16)`` rows; for ``.npy``, rounded up to whole pages of every leaf
    (so readers map a writer's segments back to back) when that at most doubles it or
    stays within a quarter of the capacity."""
    rows = (
        UNBOUNDED_SEGMENT_ROWS
        if capacity is None
        else max(1, -(-capacity // SEGMENTS_PER_CAPACITY))
    )
    if fmt == "npy" and leaves:
        unit = 1
        for spec in leaves.values():
            b = spec.dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64))
            if b:
                unit = math.lcm(unit, PAGE // math.gcd(PAGE, b))
        rounded = -(-rows // unit) * unit
        if rounded <= max(2 * rows, (capacity or 0) // 4):
            return rounded
    return rows


def check_reopen(
    m: parts_lib.Manifest, capacity: int | None, segment_rows: int | None, fmt: str, where: str
) -> None:
    """Refuses settings a reopened writer cannot change."""
    if m.capacity != capacity:
        raise InvalidArgumentError(
            f"{where}: capacity={capacity!r} but this writer was created with "
            f"capacity={m.capacity!r}, which cannot change on reopen (nor on a resume from a "
            f"checkpoint). Fix: pass capacity={m.capacity!r}, or write under a new writer_id."
        )
    if segment_rows is not None and segment_rows != m.segment_rows:
        raise InvalidArgumentError(
            f"{where}: segment_rows={segment_rows} but this writer's segments hold "
            f"{m.segment_rows} rows. Fix: pass segment_rows={m.segment_rows} or None."
        )
    if m.format != fmt:
        raise InvalidStoreError(
            f"{where}: expected this writer's manifest to name the store's format {fmt}, "
            f"got {m.format}: the part was written into another store. Fix: use another "
            "writer_id here, or move the part back to the store it was written for."
        )


def committed(
    m: parts_lib.Manifest, rows_committed: int, rows: dict[int, int], schema: str
) -> tuple[parts_lib.Manifest, list[parts_lib.Segment]]:
    """The manifest after a commit of ``rows_committed`` rows in all, with ``rows`` (first
    row -> committed rows) of every segment written; and the retired segments it drops
    (their files go after the manifest is written). Segments whose rows are all older than
    the newest ``capacity`` are evicted: the newest ``RETAIN_SEGMENTS`` stay on disk."""
    live_start = 0 if m.capacity is None else max(0, rows_committed - m.capacity)
    segments = [parts_lib.Segment(f, r) for f, r in sorted(rows.items())]
    evicted = [s for s in segments if s.first + s.rows <= live_start]
    segments = [s for s in segments if s.first + s.rows > live_start]
    retired_all = [*m.retired, *evicted]
    keep = max(0, len(retired_all) - parts_lib.RETAIN_SEGMENTS)
    retired, dropped = retired_all[keep:], retired_all[:keep]
    new = parts_lib.Manifest(
        m.writer_id,
        m.ordinal,
        m.format,
        m.capacity,
        m.segment_rows,
        rows_committed,
        tuple(segments),
        tuple(retired),
        schema,
    )
    return new, dropped


def cut(m: parts_lib.Manifest, rows: int, where: str) -> parts_lib.Manifest:
    """The manifest of part ``m`` cut back to its first ``rows`` rows (a checkpoint's
    watermark): committed ``rows``, its live rows the newest ``capacity`` of those, the
    segments past them gone. ``m`` itself when ``rows`` is its committed count.

    Raises:
      InvalidStoreError: ``rows`` is beyond what the part committed, or the rows the cut
        part would hold live were evicted already.
    """
    if rows > m.committed:
        raise InvalidStoreError(
            f"{where}: the checkpoint to resume from covers {rows} rows of this writer, but "
            f"its part holds {m.committed} committed rows: rows the checkpoint replayed are "
            "gone, or this is another store or writer. Fix: resume from a checkpoint of this "
            "store (an older one), or pass this writer's own id."
        )
    if rows == m.committed:
        return m
    live_start = 0 if m.capacity is None else max(0, rows - m.capacity)
    on_disk = [*m.retired, *m.segments]  # back to back, oldest first
    held = on_disk[0].first if on_disk else m.committed
    if rows > live_start and live_start < held:
        raise InvalidStoreError(
            f"{where}: the checkpoint's watermark keeps rows [{live_start}, {rows}) of this "
            f"writer (capacity {m.capacity}), but its rows below {held} were evicted: it "
            f"committed {m.committed - rows} rows after the checkpoint, more than the evicted "
            f"rows it keeps on disk (at least segment_rows = {m.segment_rows}). Fix: "
            f"checkpoint the learner before each writer commits another {m.segment_rows} "
            "rows, resume from a newer checkpoint, or reopen without resume_from (the rows "
            "written after the checkpoint stay)."
        )
    kept = [parts_lib.Segment(s.first, min(s.rows, rows - s.first)) for s in on_disk]
    kept = [s for s in kept if s.rows > 0]
    retired = [s for s in kept if s.first + s.rows <= live_start]
    return dataclasses.replace(
        m,
        committed=rows,
        segments=tuple(s for s in kept if s.first + s.rows > live_start),
        retired=tuple(retired[max(0, len(retired) - parts_lib.RETAIN_SEGMENTS) :]),
    )
