"""A writer part's segments: the one appended to, made new or reopened after its last commit.

Each segment is a plain single-writer store of the part's format (``.npy``
segments by :class:`~grain_replay.writers.backends.NpySegmentBackend`) holding
``segment_rows`` rows at most, with the checksums of what it holds;
:class:`~grain_replay.writers.parts_writer.PartWriter` fills, commits and evicts them.
"""

from __future__ import annotations

import errno
import os

from grain_replay.errors import StoreExistsError
from grain_replay.store import layout as layout_lib
from grain_replay.store import parts as parts_lib
from grain_replay.store.integrity import Checksummer
from grain_replay.writers.atomic import remove_path
from grain_replay.writers.backends import BACKENDS, Backend, NpySegmentBackend

__all__ = [
    "Segment",
    "create_segment",
    "remove_segment",
    "reopen_segment",
    "segment_backend",
    "segment_path",
]


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
    """A new, empty segment at ``path``. A leftover there (of a crash before this
    segment's first commit: the part's reopen removes those, so rarely) is removed and
    the segment made again: no look before (a ``stat`` and an ``unlink`` a segment)."""
    cls = segment_backend(fmt)
    # Chunks no larger than the segment, nothing allocated past it.
    try:
        backend = cls.create_open(
            path, meta, chunk_rows, compression, sync=False, max_rows=segment_rows
        )
    except StoreExistsError:
        remove_path(path)
        backend = cls.create_open(
            path, meta, chunk_rows, compression, sync=False, max_rows=segment_rows
        )
    return Segment(first, 0, backend, Checksummer(meta.leaves))


def remove_segment(path: str, fmt: str, meta: layout_lib.StoreMetadata | None) -> None:
    """Removes the segment at ``path`` (nothing if it is gone). A ``.npy`` segment's
    files are known by name (``meta``'s leaves and the metadata): unlinked, then the
    folder removed, without the listing and checks of a tree's removal; anything else
    there (or another format) is removed as a tree."""
    if fmt == "npy" and meta is not None:
        names = [layout_lib.disk_name(k) + ".npy" for k in meta.leaves]
        try:
            for name in [*names, layout_lib.METADATA_FILE]:
                try:
                    os.unlink(os.path.join(path, name))
                except FileNotFoundError:
                    pass
            os.rmdir(path)
            return
        except FileNotFoundError:
            return  # no folder: removed already
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
    remove_path(path)
