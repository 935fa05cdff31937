"""Per-record baseline sources and transforms that grain's spawned workers import by name."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import grain
import h5py
import numpy as np

__all__ = [
    "DecodeRecord",
    "H5OpenPerItemSource",
    "H5PerRecordSource",
    "decode_records",
    "record_dtype",
]


def record_dtype(spec: Sequence[tuple[str, str, tuple[int, ...]]]) -> np.dtype:
    """Packed structured dtype of one record: the leaves' raw bytes, concatenated in order."""
    return np.dtype([(key, np.dtype(dtype), tuple(shape)) for key, dtype, shape in spec])


def decode_record(data: bytes, dtype: np.dtype) -> dict[str, np.ndarray]:
    """One ArrayRecord record to ``{leaf: array}`` with one ``np.frombuffer`` per leaf."""
    assert dtype.names is not None
    out = {}
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]  # type: ignore[index]
        base = sub.base
        count = int(np.prod(sub.shape, dtype=np.int64)) if sub.shape else 1
        out[name] = np.frombuffer(data, dtype=base, count=count, offset=offset).reshape(sub.shape)
    return out


def decode_records(records: Sequence[bytes], dtype: np.dtype) -> dict[str, np.ndarray]:
    """A batch of ArrayRecord records to ``{leaf: batch array}`` via one ``np.frombuffer``."""
    table = np.frombuffer(b"".join(records), dtype=dtype)
    assert dtype.names is not None
    return {name: np.ascontiguousarray(table[name]) for name in dtype.names}


class DecodeRecord(grain.transforms.Map):
    """grain transform: raw record bytes to a dict of numpy arrays (per record)."""

    def __init__(self, dtype: np.dtype):
        self._dtype = dtype

    def map(self, element: bytes) -> dict[str, np.ndarray]:
        return decode_record(element, self._dtype)


class H5OpenPerItemSource:
    """The naive HDF5 source: opens the file on every ``__getitem__`` and reads ``f[k][i]``."""

    def __init__(self, path: str, keys: Sequence[str]):
        self._path = os.path.abspath(path)
        self._keys = list(keys)
        with h5py.File(self._path, "r") as f:
            self._n = int(f[self._keys[0]].shape[0])

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict[str, Any]:
        with h5py.File(self._path, "r") as f:
            return {k: f[k][index] for k in self._keys}

    def __repr__(self) -> str:
        return f"H5OpenPerItemSource({self._path!r})"


class H5PerRecordSource:
    """A persistent-handle HDF5 source that still reads record by record (``dset[i]`` per leaf).

    One handle per process, opened lazily and reopened after fork or unpickling,
    as array_record's source does.
    """

    def __init__(self, path: str, keys: Sequence[str]):
        self._path = os.path.abspath(path)
        self._keys = list(keys)
        self._lock = threading.Lock()
        self._file: Any = None
        self._dsets: dict[str, Any] = {}
        self._pid: int | None = None
        with h5py.File(self._path, "r") as f:
            self._n = int(f[self._keys[0]].shape[0])

    def _datasets(self) -> dict[str, Any]:
        if self._file is None or self._pid != os.getpid():
            with self._lock:
                if self._file is None or self._pid != os.getpid():
                    self._file = h5py.File(self._path, "r")
                    self._dsets = {k: self._file[k] for k in self._keys}
                    self._pid = os.getpid()
        return self._dsets

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {k: d[index] for k, d in self._datasets().items()}

    def read_sorted(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """h5py's own batched read: ``dset[sorted unique indices]`` per leaf, then reordered."""
        unique, inverse = np.unique(indices, return_inverse=True)
        return {k: d[unique][inverse] for k, d in self._datasets().items()}

    def close(self) -> None:
        with self._lock:
            if self._file is not None and self._pid == os.getpid():
                self._file.close()
            self._file = None
            self._dsets = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_file=None, _dsets={}, _pid=None)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"H5PerRecordSource({self._path!r})"
