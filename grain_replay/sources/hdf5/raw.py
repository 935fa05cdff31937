"""Reading HDF5 files without h5py on the read path: raw chunk reads, retried opens."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from grain_replay.errors import InvalidStoreError, ReferenceRefusedError
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.chunked import ChunkedLeafReader, mapped_reader
from grain_replay.sources.reading.files import Descriptor, MappedFile
from grain_replay.sources.reading.readers import LeafReader
from grain_replay.sources.reading.rereads import RereadPolicy, doubling, read_while_written
from grain_replay.sources.reading.stitch import headroom_for
from grain_replay.store.layout import LeafSpec

__all__ = [
    "MAX_RUNS",
    "OPEN_REREADS",
    "chunk_table",
    "count_runs",
    "memmap_offset",
    "raw_chunk_reader",
    "retry_while_written",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A reader opening a file that a ReplayWriter in another process is growing can
# see metadata mid-flush (HDF5 without SWMR): read again while the file is seen
# being written (a flush takes milliseconds: pauses doubling from 5 ms, 6 reads);
# a broken file nobody writes fails at once. See sources/reading/rereads.py.
OPEN_REREADS = RereadPolicy(
    pauses_s=doubling(0.005, reads=6),
    retried=(OSError, ValueError, RuntimeError, KeyError),
    never_retried=(FileNotFoundError, ReferenceRefusedError),
    while_written_s=0.2,
)


def retry_while_written(path: str, attempt: Callable[[], T]) -> T:
    """``attempt()``, retried after a failure while ``path`` is being written."""
    return read_while_written(attempt, OPEN_REREADS, path=path)


def memmap_offset(dset: Any) -> int | None:
    """File offset of a contiguous, unfiltered, allocated dataset, else None."""
    if dset.chunks is not None or dset.compression is not None or dset.external:
        return None
    try:
        if dset.is_virtual:
            return None
    except AttributeError:
        pass
    if dset.dtype.hasobject or dset.dtype.kind == "V":
        return None
    offset = dset.id.get_offset()
    return None if offset is None else int(offset)


# Beyond this many separate runs of chunks, reading them with pread is cheaper
# than one memory map per run (and stays under the kernel's limit of maps).
MAX_RUNS = 4096


def chunk_table(dset: Any, n: int) -> dict[int, int] | None:
    """File offset of each allocated row-chunk below row ``n`` of an unfiltered dataset.

    None if the dataset cannot be read raw (filters, partial-row chunks, exotic
    dtypes), or if its chunk index cannot be listed cheaply.
    """
    if dset.chunks is None or dset.dtype.hasobject or dset.dtype.kind == "V":
        return None
    if tuple(dset.chunks[1:]) != tuple(dset.shape[1:]) or 0 in dset.chunks:
        return None
    if dset.id.get_create_plist().get_nfilters() or dset.external or dset.is_virtual:
        return None
    rows = dset.chunks[0]
    needed = -(-n // rows)
    table: dict[int, int] = {}
    unfiltered = [True]

    def add(info: Any) -> None:
        c = info.chunk_offset[0] // rows
        if info.filter_mask:
            unfiltered[0] = False
        elif c < needed and info.byte_offset is not None:
            table[c] = int(info.byte_offset)

    if hasattr(dset.id, "chunk_iter"):  # HDF5 >= 1.14: one pass over the chunk index
        dset.id.chunk_iter(add)
    else:
        count = dset.id.get_num_chunks()
        if count > MAX_RUNS:
            return None
        for i in range(count):
            add(dset.id.get_chunk_info(i))
    return table if unfiltered[0] else None


def chunk_parts(dset: Any, path: str, n: int, row_bytes: int) -> list[tuple[str, int]] | None:
    """``(path, offset)`` of every row-chunk below row ``n``, if all can be mapped back to back."""
    chunks = chunk_table(dset, n)
    if chunks is None:
        return None
    rows = dset.chunks[0]
    needed = -(-n // rows)
    if len(chunks) != needed or count_runs(chunks, needed, rows * row_bytes) > MAX_RUNS:
        return None
    return [(path, chunks[c]) for c in range(needed)]


def chunk_reach(offsets: Iterable[tuple[int, int]], chunk_bytes: int, used: int) -> int:
    """How far into the file chunks ``(index, offset)`` reach, holding ``used`` bytes of rows."""
    return max((off + min(chunk_bytes, used - c * chunk_bytes) for c, off in offsets), default=0)


def count_runs(chunks: dict[int, int], count: int, chunk_bytes: int) -> int:
    """Number of runs of chunks ``0 .. count-1`` stored back to back."""
    runs = 0
    for c in range(count):
        if c == 0 or chunks[c] != chunks[c - 1] + chunk_bytes:
            runs += 1
            if runs > MAX_RUNS:
                break
    return runs


def raw_chunk_reader(
    path: str,
    key: str,
    spec: LeafSpec,
    dset: Any,
    chunks: dict[int, int],
    n: int,
    cache: ChunkCache,
    descriptor: Descriptor | None = None,
    whole_file: Callable[[], Any] | None = None,
) -> tuple[LeafReader, MappedFile, bool]:
    """Unfiltered row-chunks of ``dset`` read straight from the file at ``path``, without h5py.

    Mapped when every chunk is allocated and they form few runs; otherwise
    read with ``os.pread`` (unallocated chunks read as the fill value).

    Returns:
      ``(reader, file, mapped)``: ``file`` keeps the descriptor the reads use
      (or that checks the mapped file for truncation when ``mapped``).
    """
    rows = dset.chunks[0]
    row_bytes = spec.dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64))
    chunk_bytes = rows * row_bytes
    needed = -(-n // rows)
    reach = chunk_reach(chunks.items(), chunk_bytes, n * row_bytes)
    guard = MappedFile(path, reach, descriptor)
    if len(chunks) == needed and count_runs(chunks, needed, chunk_bytes) <= MAX_RUNS:
        parts = [(path, chunks[c]) for c in range(needed)]
        headroom = headroom_for(n * row_bytes)
        reader = mapped_reader(parts, rows, spec.dtype, spec.shape, n, whole_file, headroom)
        return reader, guard, True
    fill = dset.fillvalue

    def read(c: int, first: int, count: int) -> np.ndarray:
        off = chunks.get(c)
        if off is None:  # never written: HDF5 reads the fill value
            return np.full((count, *spec.shape), fill, spec.dtype)
        # Through ``guard``: this reader keeps its descriptor open while it runs,
        # even if its handle was closed meanwhile (refresh() in another thread).
        data = os.pread(guard.fd, count * row_bytes, off + first * row_bytes)
        if len(data) != count * row_bytes:
            raise InvalidStoreError(
                f"{path}: leaf {key!r} chunk {c} (rows from {c * rows}) at byte "
                f"{off:,} is cut short: the file is truncated. Fix: re-create it."
            )
        return np.frombuffer(data, spec.dtype).reshape((count, *spec.shape))

    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        return [read(c, 0, min(rows, n - c * rows)) for c in chunk_ids]

    def read_rows(chunk_ids: Sequence[int], offsets: Sequence[np.ndarray]) -> list[np.ndarray]:
        # Chunks too big to cache: only the rows asked for, one pread each.
        return [
            np.concatenate([read(c, int(r), 1) for r in rs]) if len(rs) else read(c, 0, 0)
            for c, rs in zip(chunk_ids, offsets)
        ]

    reader = ChunkedLeafReader(key, n, rows, spec.shape, spec.dtype, read_blocks, cache, read_rows)
    return reader, guard, False
