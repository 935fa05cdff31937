"""A ReplayWriter's set-up on a POSIX file system: its plain store or writer part, its gate.

The counterpart of :mod:`grain_replay.writers.object_setup` (an ``s3://`` URL's): the
checks and the opening :class:`~grain_replay.writers.replay_writer.ReplayWriter` makes
before its first append on a path (docs/replay_store.md, docs/writing.md).
"""

from __future__ import annotations

import dataclasses

from grain_replay.errors import InvalidStoreError
from grain_replay.store.parts import is_parts_store
from grain_replay.store.rate_limit import RateLimit
from grain_replay.store.watermark import Watermark
from grain_replay.writers.device import background
from grain_replay.writers.parts_writer import PartWriter
from grain_replay.writers.rate_wait import WriterGate, check_rate_limit_timeout, check_writer_limit
from grain_replay.writers.resume import resume_rows
from grain_replay.writers.store_writer import StoreWriter

__all__ = ["FileSetup", "open_file_store"]


@dataclasses.dataclass(frozen=True)
class FileSetup:
    """What a ReplayWriter on a path holds: its store, its gate and their names."""

    store: PartWriter | StoreWriter
    gate: WriterGate
    who: str
    max_inflight: int


def open_file_store(
    path: str,
    format: str | None,
    *,
    parts: bool,
    writer_id: str | None,
    capacity: int | None,
    segment_rows: int | None,
    chunk_rows: int | None,
    compression: str | None,
    resume_from: int | Watermark | None,
    rate_limit: RateLimit | None,
    rate_limit_timeout: float | None,
    max_inflight_bytes: int,
) -> FileSetup:
    """A plain store (``parts`` false) or a writer part at the absolute ``path``, its rate
    limit declared."""
    timeout = check_rate_limit_timeout(rate_limit_timeout, path)
    limit, timeout = check_writer_limit(rate_limit, timeout, path)
    who = path if writer_id is None else f"{path} (writer {writer_id!r})"
    gate = WriterGate(path, parts=parts, timeout=timeout, who=who)
    max_inflight = background.check_max_inflight_bytes(max_inflight_bytes, who)
    if not parts and is_parts_store(path):
        raise InvalidStoreError(
            f"{path} is a many-writer store (made with capacity= or writer_id=). "
            "Fix: pass writer_id=... (and the capacity it was made with)."
        )
    resume = None if resume_from is None else resume_rows(resume_from, path, writer_id)
    store: PartWriter | StoreWriter
    if parts:
        assert writer_id is not None
        store = PartWriter(
            path,
            format,
            writer_id=writer_id,
            capacity=capacity,
            segment_rows=segment_rows,
            chunk_rows=chunk_rows,
            compression=compression,
            resume=resume,
        )
    else:
        store = StoreWriter(
            path, format, chunk_rows=chunk_rows, compression=compression, resume=resume
        )
    if limit is not None:
        try:
            gate.declare(limit)  # before the first row: writers hold from it on
        except BaseException:
            store.abandon()  # nothing appended: releases the writer id
            raise
    return FileSetup(store, gate, who, max_inflight)
