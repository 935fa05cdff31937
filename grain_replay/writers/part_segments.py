"""A writer part's segments: the one appended to, made new or reopened after its last commit.

Each segment is a plain single-writer store of the part's format (``.npy``
segments by :class:`~grain_replay.writers.backends.NpySegmentBackend`) holding
``segment_rows`` rows at most, with the checksums of what it holds;
:class:`~grain_replay.writers.parts_writer.PartWriter` fills, commits and evicts them.
"""

from __future__ import annotations

import os

from grain_replay.store import layout as layout_lib
from grain_replay.store import parts as parts_lib
from grain_replay.store.integrity import Checksummer
from grain_replay.writers.backends import BACKENDS, Backend, NpySegmentBackend

__all__ = ["Segment", "create_segment", "reopen_segment", "segment_backend", "segment_path"]


def segment_backend(fmt: str) -> type[Backend]:
    return NpySegmentBackend if fmt == "npy" else BACKENDS[fmt]


def segment_path(directory: str, first: int, fmt: str) -> str:
    """The file of the segment whose first row is ``first`` in a writer's directory."""
    return os.path.join(directory, parts_lib.segment_name(first, fmt))


class Segment:
    """A segment being appended to (or filled, not committed yet)."""

    def __init__(self, first: int, rows: int, backend: Backend, summer: Checksummer | None):
        self.first, self.rows, self.backend, self.summer = first, rows, backend, summer
        self.dirty = False


def reopen_segment(
    path: str, fmt: str, meta: layout_lib.StoreMetadata, first: int, segment_rows: int
) -> tuple[Segment, bool]:
    """The tail segment at ``path``, continued after the ``meta.num_records`` rows the
    manifest commits (its checksums resumed), and whether it holds rows past them
    (then the caller commits it cut back to them)."""
    rows = meta.num_records
    cls = segment_backend(fmt)
    backend = cls(path, meta)
    backend.max_rows = segment_rows
    on_disk = cls.read_metadata(path)
    summer = None
    cut = False
    if on_disk is not None and on_disk.num_records == rows:
        try:
            summer = Checksummer.resume(meta.leaves, on_disk.checksums, rows)
        except ValueError:
            summer = None
    else:
        # Committed past the manifest (a crash between the two commits, or a part cut
        # back to a checkpoint): the checksums of its last block are recomputed.
        try:
            checks = None if on_disk is None else on_disk.checksums
            summer = Checksummer.truncated(meta.leaves, checks, rows, backend.read)
        except ValueError:
            summer = None
        cut = True
    return Segment(first, rows, backend, summer), cut


def create_segment(
    path: str,
    fmt: str,
    meta: layout_lib.StoreMetadata,
    first: int,
    segment_rows: int,
    chunk_rows: int | None,
    compression: str | None,
) -> Segment:
    """A new, empty segment at ``path`` (no leftover there: the caller removed it)."""
    cls = segment_backend(fmt)
    # Chunks no larger than the segment, nothing allocated past it.
    backend = cls.create_open(
        path, meta, chunk_rows, compression, sync=False, max_rows=segment_rows
    )
    return Segment(first, 0, backend, Checksummer(meta.leaves))
