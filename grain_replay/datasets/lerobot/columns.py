"""Numeric parquet columns of a LeRobot dataset, decoded once per process into numpy blocks."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.datasets.lerobot.meta import DataFile, pyarrow_parquet
from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.readers import LeafReader
from grain_replay.sources.reading.runs import runs

__all__ = ["ParquetFiles", "Segments", "ColumnReader", "column_to_numpy"]


def column_to_numpy(column: Any, shape: tuple[int, ...], dtype: np.dtype, where: str) -> np.ndarray:
    """A pyarrow (chunked) column of fixed-shape rows as one ``(n, *shape)`` numpy array.

    Nested list columns (``datasets``' ``Sequence``/``Array2D`` features) are
    flattened level by level; every row must hold ``prod(shape)`` values.

    Raises:
      InvalidStoreError: nulls, ragged rows, or a nesting depth that does not
        match ``shape``; ``where`` names the file and column.
    """
    import pyarrow as pa

    arr = column
    if isinstance(arr, pa.ChunkedArray):
        arr = pa.concat_arrays(arr.chunks) if arr.num_chunks != 1 else arr.chunk(0)
    n = len(arr)
    if isinstance(arr.type, pa.ExtensionType):
        arr = arr.storage
    values = arr
    depth = 0
    while (
        pa.types.is_list(values.type)
        or pa.types.is_large_list(values.type)
        or (pa.types.is_fixed_size_list(values.type))
    ):
        if values.null_count:
            break
        values = values.flatten()
        if isinstance(values.type, pa.ExtensionType):
            values = values.storage
        depth += 1
    size = int(np.prod(shape, dtype=np.int64))
    if values.null_count or depth > max(len(shape), 1) or len(values) != n * size:
        raise InvalidStoreError(
            f"{where}: expected {n} rows of shape {shape} ({dtype}), got a column of type "
            f"{column.type} with {len(values)} values"
            f"{' and nulls' if values.null_count else ''}. Fix: re-create the dataset with "
            "LeRobot's writer, or leave this feature out with keys=[...]."
        )
    out = values.to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(out.reshape((n, *shape)).astype(dtype, copy=False))


class ParquetFiles:
    """The process's open parquet files: one memory-mapped handle per file, opened on first use."""

    def __init__(self, root: str, files: Sequence[DataFile]):
        self._root = root
        self._files = list(files)
        self._open: dict[int, Any] = {}
        self._locks = [threading.Lock() for _ in self._files]
        self._lock = threading.Lock()

    def path(self, f: int) -> str:
        return os.path.join(self._root, self._files[f].path)

    def lock(self, f: int) -> threading.Lock:
        return self._locks[f]

    def read(self, f: int, row_groups: tuple[int, ...] | None, column: str) -> Any:
        """Column ``column`` of file ``f`` (all row groups, or ``row_groups``); hold ``lock(f)``."""
        pf = self._open.get(f)
        if pf is None:
            import pyarrow as pa

            pq = pyarrow_parquet()
            try:
                pf = pq.ParquetFile(pa.memory_map(self.path(f), "r"))
            except (OSError, ValueError) as e:
                raise InvalidStoreError(
                    f"{self.path(f)}: cannot open it as parquet ({e}). Fix: download or "
                    "re-create the dataset's data/ folder."
                ) from e
            with self._lock:
                self._open[f] = pf
        try:
            if row_groups is None:
                return pf.read(columns=[column]).column(0)
            return pf.read_row_groups(list(row_groups), columns=[column]).column(0)
        except (OSError, ValueError, KeyError) as e:
            raise InvalidStoreError(
                f"{self.path(f)}: column {column!r} cannot be read ({type(e).__name__}: {e}). "
                "The file is truncated, corrupt or lacks the feature info.json declares. Fix: "
                "download or re-create it."
            ) from e

    def close(self) -> None:
        with self._lock:
            for pf in self._open.values():
                reader = getattr(pf, "reader", None)
                close = getattr(reader, "close", None)
                if close is not None:
                    close()
            self._open.clear()


class Segments:
    """Runs of frames decoded as one block: whole files, or row groups of large files.

    Args:
      files: the data files, in frame order.
      row_bytes: decoded bytes of one frame over every leaf read.
      block_bytes: a file whose frames decode to more than this is cut into
        its row groups.
    """

    def __init__(self, files: Sequence[DataFile], row_bytes: int, block_bytes: int):
        starts: list[int] = []
        parts: list[tuple[int, tuple[int, ...] | None]] = []
        first = 0
        for f, df in enumerate(files):
            if df.num_rows * row_bytes <= block_bytes or len(df.row_group_rows) <= 1:
                starts.append(first)
                parts.append((f, None))
                first += df.num_rows
                continue
            for g, rows in enumerate(df.row_group_rows):
                if rows:
                    starts.append(first)
                    parts.append((f, (g,)))
                    first += rows
        self.starts = np.asarray(starts, dtype=np.int64)
        self.parts = parts

    def of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, indices, side="right") - 1


class ColumnReader(LeafReader):
    """Rows of one numeric feature: a gather from decoded blocks, one block per segment.

    A batch is grouped by segment; each block is decoded from parquet once per
    process (under the file's lock, so threads never decode it twice) and kept
    in the shared byte-bounded cache.
    """

    def __init__(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: np.dtype,
        files: ParquetFiles,
        segments: Segments,
        cache: ChunkCache,
    ):
        self._key = key
        self._shape = shape
        self._dtype = dtype
        self._files = files
        self._segments = segments
        self._cache = cache

    def _block(self, s: int) -> np.ndarray:
        name = (self._key, s)
        block = self._cache.get(name)
        if block is not None:
            return block
        f, groups = self._segments.parts[s]
        with self._files.lock(f):
            block = self._cache.get(name)
            if block is None:
                col = self._files.read(f, groups, self._key)
                where = f"{self._files.path(f)}: feature {self._key!r}"
                block = column_to_numpy(col, self._shape, self._dtype, where)
                block.flags.writeable = False
                self._cache.put(name, block)
        return block

    def take(self, indices: np.ndarray) -> np.ndarray:
        if len(indices) == 0:
            return np.empty((0, *self._shape), dtype=self._dtype)
        seg = self._segments.of(indices)
        starts = self._segments.starts
        lo, hi = int(seg.min()), int(seg.max())
        if lo == hi:
            return np.take(self._block(lo), indices - starts[lo], axis=0)
        out = np.empty((len(indices), *self._shape), dtype=self._dtype)
        for s, pos in runs(seg):
            out[pos] = np.take(self._block(s), indices[pos] - starts[s], axis=0)
        return out
