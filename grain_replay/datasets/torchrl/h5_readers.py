"""Rows of a ``checkpoint.h5``'s trajectory groups: one gather per leaf over a map of the file."""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import threading
from typing import Any

import numpy as np

from grain_replay.datasets.torchrl.h5 import H5Checkpoint, H5Leaf, TrajIndex, open_h5, scan
from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.files import MappedFile
from grain_replay.sources.reading.readers import Handle, LeafReader
from grain_replay.sources.reading.runs import runs

__all__ = ["H5Handle"]

logger = logging.getLogger(__name__)
_warned: set[str] = set()


class _ByteRows(LeafReader):
    """A leaf whose groups' datasets are contiguous: record ``i`` of group ``t`` starts at byte
    ``base[t] + i * row_bytes`` of the file, gathered as ``row_bytes``-byte items of one view.

    HDF5 places datasets at any byte (no alignment), so the view's items are one byte
    apart: a batch is one ``take`` of whole rows, wherever each group's rows are.
    """

    def __init__(self, mapping: mmap.mmap, index: TrajIndex, offsets: np.ndarray, leaf: H5Leaf):
        self._dtype, self._shape = leaf.dtype, leaf.shape
        row_bytes = leaf.dtype.itemsize * math.prod(leaf.shape)
        self._row_bytes = row_bytes
        self._starts = index.starts
        # byte of record i (in group t) = base[t] + i * row_bytes
        self._base = offsets + (leaf.first - index.starts[:-1]) * row_bytes
        size = len(mapping)
        self._items = np.ndarray(
            (size - row_bytes + 1,), np.dtype((np.void, row_bytes)), buffer=mapping, strides=(1,)
        )

    def take(self, indices: np.ndarray) -> np.ndarray:
        group = np.searchsorted(self._starts, indices, side="right")
        group -= 1
        at = self._base[group]
        at += indices * self._row_bytes
        got = self._items.take(at)
        return got.view(self._dtype).reshape(len(indices), *self._shape)


class _GroupRows(LeafReader):
    """A leaf with chunked or compressed datasets: read through h5py, one read per group."""

    def __init__(self, handle: H5Handle, index: TrajIndex, leaf: H5Leaf):
        self._handle, self._index, self._leaf = handle, index, leaf

    def take(self, indices: np.ndarray) -> np.ndarray:
        leaf, starts = self._leaf, self._index.starts
        out = np.empty((len(indices), *leaf.shape), leaf.dtype)
        group = np.searchsorted(starts, indices, side="right") - 1
        with self._handle.lock:
            f = self._handle.h5file()
            for t, pos in runs(group):
                rows = indices[pos] - starts[t] + leaf.first
                lo, hi = int(rows.min()), int(rows.max()) + 1
                block = f[f"{self._index.groups[t]}/{leaf.dataset}"][lo:hi]
                out[pos] = block[rows - lo]
        return out


class _Zeros(LeafReader):
    """The root done flags, which torchrl restores as False."""

    def __init__(self, leaf: H5Leaf):
        self._dtype, self._shape = leaf.dtype, leaf.shape

    def take(self, indices: np.ndarray) -> np.ndarray:
        return np.zeros((len(indices), *self._shape), self._dtype)


class H5Handle(Handle):
    """The file mapped once (shared by the leaves) and the trajectory index, per process."""

    def __init__(self, checkpoint: H5Checkpoint, keys: list[str]):
        self.lock = threading.Lock()
        self._file: Any = None
        self._path = checkpoint.file
        with open_h5(checkpoint.file) as f:
            index = scan(f, checkpoint, only={checkpoint.leaves[k].dataset for k in keys})
        self.readers = {}
        self.mapped_files = {}
        mapping = None
        for key in keys:
            leaf = checkpoint.leaves[key]
            offsets = index.offsets.get(leaf.dataset)
            if not leaf.dataset or leaf.dtype.itemsize * math.prod(leaf.shape) == 0:
                self.readers[key] = _Zeros(leaf)
            elif offsets is None:
                _warn_slow(checkpoint.file, key)
                self.readers[key] = _GroupRows(self, index, leaf)
            else:
                if mapping is None:
                    mapping = _map(checkpoint.file)
                row_bytes = leaf.dtype.itemsize * math.prod(leaf.shape)
                rows = np.diff(index.starts) + leaf.first
                needed = int((offsets + rows * row_bytes).max()) if len(offsets) else 0
                if needed > len(mapping):
                    raise InvalidStoreError(
                        f"{checkpoint.file}: leaf {key!r} needs {needed:,} bytes but the file "
                        f"holds {len(mapping):,}: it is truncated. Fix: dump the buffer again."
                    )
                self.readers[key] = _ByteRows(mapping, index, offsets, leaf)
                self.mapped_files[key] = [MappedFile(checkpoint.file, needed, mapping=mapping)]

    def h5file(self) -> Any:
        if self._file is None:
            self._file = open_h5(self._path)
        return self._file

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _map(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_RANDOM)
    return mapping


def _warn_slow(file: str, key: str) -> None:
    if file not in _warned:
        _warned.add(file)
        logger.warning(
            "%s: leaf %r is chunked or compressed (H5StorageCheckpointer(h5_kwargs=...)), so a "
            "batch reads one block per trajectory it touches. Fix: dump with the default "
            "h5_kwargs, or convert once: grain-replay convert %s out.h5",
            file,
            key,
            os.path.dirname(os.path.dirname(file)),
        )
