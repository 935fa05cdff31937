"""Chunk-aware batch reads: decode each needed chunk once per batch, keep it in the cache."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_replay.sources.reading import readahead
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.readers import ArrayReader, LeafReader, advise_random
from grain_replay.sources.reading.runs import group_runs, runs
from grain_replay.sources.reading.stitch import Stitched, stitch

__all__ = ["ChunkedLeafReader", "SegmentedReader", "mapped_reader"]


# A batch's missing blocks are decoded in groups of at most this many bytes, or
# the cache bound if larger (the blocks of a group decode in parallel).
_MIN_GROUP_BYTES = 64 * 2**20


class ChunkedLeafReader(LeafReader):
    """Reads rows of a chunked leaf by decoding whole row-chunks.

    Args:
      name: cache key prefix (the leaf key).
      num_records: N.
      chunk_rows: rows per chunk along the leading axis.
      row_shape, dtype: per-record shape and dtype.
      read_blocks: decodes rows ``[c * chunk_rows, (c + 1) * chunk_rows)`` for
        each chunk id ``c`` given; may fetch them concurrently.
      cache: decoded-chunk cache shared by the leaves of a handle.
      read_rows: optional; ``read_rows(chunk_ids, offsets)`` returns only the
        rows at ``offsets[j]`` of block ``chunk_ids[j]``. Used instead of
        ``read_blocks`` when a batch's missing blocks exceed half the cache
        (they could not stay cached until the next batch anyway), so that a
        batch never assembles or holds whole giant blocks.
    """

    def __init__(
        self,
        name: str,
        num_records: int,
        chunk_rows: int,
        row_shape: tuple[int, ...],
        dtype: np.dtype,
        read_blocks: Callable[[Sequence[int]], Sequence[np.ndarray]],
        cache: ChunkCache,
        read_rows: Callable[[Sequence[int], Sequence[np.ndarray]], Sequence[np.ndarray]]
        | None = None,
    ):
        self._name = name
        self._n = num_records
        self._chunk_rows = max(1, int(chunk_rows))
        self._row_shape = row_shape
        self._dtype = dtype
        self._read_blocks = read_blocks
        self._cache = cache
        self._read_rows = read_rows
        row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        self._block_bytes = max(1, self._chunk_rows * row_bytes)
        self._row_bytes = row_bytes
        self._num_chunks = -(-num_records // self._chunk_rows)
        cache.register(name, num_records * row_bytes)

    def take(self, indices: np.ndarray) -> np.ndarray:
        if len(indices) == 0:
            return np.empty((0, *self._row_shape), dtype=self._dtype)
        dense = self._cache.dense(
            self._name, (self._n, *self._row_shape), self._dtype, self._num_chunks
        )
        if dense is not None:
            return self._take_dense(indices, *dense)
        out = np.empty((len(indices), *self._row_shape), dtype=self._dtype)
        chunk_ids, order, bounds = group_runs(indices // self._chunk_rows)
        rows = self._chunk_rows
        missing = []
        for j, c in enumerate(chunk_ids):
            block = self._cache.get((self._name, int(c)))
            if block is None:
                missing.append(j)
                continue
            pos = order[bounds[j] : bounds[j + 1]]
            out[pos] = block[indices[pos] - int(c) * rows]
        missing_bytes = len(missing) * self._block_bytes
        if self._read_rows is not None and missing and missing_bytes > self._cache.max_bytes // 2:
            # These blocks would push each other (and the other leaves' blocks)
            # out of the cache before the next batch: decode them for the rows
            # asked only, without assembling or keeping whole blocks.
            positions = [order[bounds[j] : bounds[j + 1]] for j in missing]
            offsets = [indices[p] - int(chunk_ids[j]) * rows for p, j in zip(positions, missing)]
            got = self._read_rows([int(chunk_ids[j]) for j in missing], offsets)
            for p, rows_got in zip(positions, got):
                out[p] = rows_got
            return out
        at = {int(chunk_ids[j]): j for j in missing}
        for c, block in self._decode_in_groups(list(at)):
            self._cache.put((self._name, c), block)
            pos = order[bounds[at[c]] : bounds[at[c] + 1]]
            out[pos] = block[indices[pos] - c * rows]
        return out

    def _decode_in_groups(self, chunk_ids: list[int]) -> Any:
        """``(chunk id, block)`` for each of ``chunk_ids``, decoded group by group.

        A group holds at most ~the cache bound of decoded bytes, so a batch that
        touches many big blocks never holds all of them at once.
        """
        budget = max(self._cache.max_bytes, _MIN_GROUP_BYTES)
        per_group = max(1, budget // self._block_bytes)
        for g in range(0, len(chunk_ids), per_group):
            group = chunk_ids[g : g + per_group]
            yield from zip(group, self._read_blocks(group))

    def _take_dense(self, indices: np.ndarray, rows: np.ndarray, decoded: np.ndarray) -> np.ndarray:
        """The batch from the leaf's dense array, decoding the chunks it lacks first."""
        chunk_ids = np.unique(indices // self._chunk_rows)
        need = chunk_ids[~decoded[chunk_ids]]
        filled = 0
        for c, block in self._decode_in_groups([int(c) for c in need]):
            start = c * self._chunk_rows
            m = min(len(block), self._n - start)
            rows[start : start + m] = block[:m]
            decoded[c] = True  # after the rows: a racing reader sees them or decodes again
            filled += m * self._row_bytes
        self._cache.count(len(chunk_ids) - len(need), len(need), filled)
        return np.take(rows, indices, axis=0)


class SegmentedReader(LeafReader):
    """Rows spread over a few memory-mapped runs of rows (no decoding, no copies but the gather).

    Args:
      starts: first row of each segment, increasing, ``starts[0] == 0``.
      segments: row arrays (typically ``np.memmap`` views), segment ``j``
        holding rows ``[starts[j], starts[j] + len(segments[j]))``.
    """

    def __init__(self, starts: Sequence[int], segments: Sequence[np.ndarray]):
        for s in segments:
            advise_random(s)
        self._starts = np.asarray(starts, dtype=np.int64)
        self._segments = [s.view(np.ndarray) for s in segments]
        self._single = ArrayReader(segments[0]) if len(segments) == 1 else None
        # Per segment: reads rows ahead while they are not page-cached (readahead.py).
        self._aheads = [readahead.for_array(s) for s in segments]

    def take(self, indices: np.ndarray) -> np.ndarray:
        if self._single is not None:
            return self._single.take(indices)
        if len(indices) == 0:
            return self._segments[0][:0].copy()
        seg = np.searchsorted(self._starts, indices, side="right") - 1
        first = self._segments[0]
        out = np.empty((len(indices), *first.shape[1:]), dtype=first.dtype)
        groups = []
        timed = True
        for j, pos in runs(seg):
            groups.append((j, pos, indices[pos] - self._starts[j]))
            # Every segment's cold rows are asked for before any is gathered.
            ahead = self._aheads[j]
            if ahead is not None and ahead.cold and not ahead.start(groups[-1][2]):
                timed = False
        t0 = time.perf_counter()
        for j, pos, rows in groups:
            out[pos] = self._segments[j][rows]
        if timed:
            seconds = time.perf_counter() - t0
            for j, _, _ in groups:
                ahead = self._aheads[j]
                if ahead is not None:
                    ahead.finish(len(indices), seconds)
        return out

    def row(self, index: int) -> np.ndarray:
        j = int(np.searchsorted(self._starts, index, side="right") - 1)
        r = self._segments[j][index - int(self._starts[j])]
        return r.copy() if isinstance(r, np.ndarray) else r


def stitched_map(reader: LeafReader | None) -> Stitched | None:
    """The growable map under a :func:`mapped_reader`'s reader, None if it has none."""
    mapping = getattr(reader, "mapping", None)
    return mapping if isinstance(reader, ArrayReader) and isinstance(mapping, Stitched) else None


def grow_stitched(
    reader: LeafReader | None,
    parts: Sequence[tuple[str, int]],
    first: int,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    num_records: int,
) -> bool:
    """Maps ``parts[first:]`` into ``reader``'s :class:`Stitched` and reads ``num_records``.

    False if they cannot be mapped in place (the caller reopens the store).
    """
    stitched = stitched_map(reader)
    if stitched is None or not isinstance(reader, ArrayReader):
        return False
    row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    if not stitched.map(parts, first, num_records * row_bytes):
        return False
    reader.grow(stitched.array(dtype, row_shape, num_records))
    return True


def mapped_reader(
    parts: Sequence[tuple[str, int]],
    chunk_rows: int,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    num_records: int,
    whole_file: Callable[[], Any] | None = None,
    headroom: int = 0,
) -> LeafReader:
    """Reader over unfiltered row-chunks at ``(file, offset)``, in row order.

    Stitched into one contiguous mapping when the layout allows (one gather per
    batch; the reader's ``mapping`` is the :class:`Stitched`, with ``headroom``
    bytes of address space reserved for chunks to come); else one memory map per
    run of back-to-back chunks, or views of ``whole_file()`` (a map of the one
    file all parts are in, shared by the leaves: a map per run would hold a
    descriptor per run).
    """
    row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    stitched = stitch(
        parts, chunk_rows * row_bytes, dtype, row_shape, num_records, headroom=headroom
    )
    if stitched is not None:
        array, mapping = stitched
        return ArrayReader(array, mapping=mapping)
    # Fallback: one memory map per run of chunks stored back to back.
    chunk_bytes = chunk_rows * row_bytes
    runs: list[list[Any]] = []  # [first_row, file, offset, num_chunks]
    for c, (path, offset) in enumerate(parts):
        last = runs[-1] if runs else None
        if last and last[1] == path and last[2] + last[3] * chunk_bytes == offset:
            last[3] += 1
        else:
            runs.append([c * chunk_rows, path, offset, 1])

    def segment(first: int, path: str, offset: int, k: int) -> np.ndarray:
        shape = (min(k * chunk_rows, num_records - first), *row_shape)
        if whole_file is None:
            return np.memmap(path, dtype, "r", offset, shape)
        return np.ndarray(shape, dtype, buffer=whole_file(), offset=offset)

    return SegmentedReader([r[0] for r in runs], [segment(*r) for r in runs])
