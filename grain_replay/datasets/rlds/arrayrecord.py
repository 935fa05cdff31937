"""TFDS's ArrayRecord shards: one record per episode, read through the array_record package.

An ArrayRecord record is compressed as a whole, so a value is addressed as
``record << RECORD_SHIFT | offset inside the record``; the records a batch needs
are read once each and kept in a byte-bounded cache shared by the leaves.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

from grain_replay.errors import InvalidStoreError, MissingDependencyError

__all__ = ["RECORD_SHIFT", "RecordCache", "iter_array_records", "open_reader"]

RECORD_SHIFT = 32  # an episode record is far below 4 GiB
_BLOCK = 16


def open_reader(path: str) -> Any:
    """An ``ArrayRecordReader`` of ``path``, or an install hint."""
    try:
        from array_record.python import array_record_module
    except ImportError as e:
        raise MissingDependencyError(
            f"{path} is an ArrayRecord shard: reading it needs the array_record package. Fix: "
            "pip install array_record (or rebuild the dataset with file_format='tfrecord')."
        ) from e
    try:
        return array_record_module.ArrayRecordReader(path)
    except Exception as e:  # the C++ reader raises RuntimeError/ValueError on damage
        raise InvalidStoreError(
            f"{path}: not a readable ArrayRecord file ({e}). Fix: copy the shard again."
        ) from e


def iter_array_records(path: str) -> Iterator[tuple[int, bytes]]:
    """``(address of the record's first byte, record)`` of every record of ``path``."""
    reader = open_reader(path)
    try:
        n = reader.num_records()
        for a in range(0, n, _BLOCK):
            try:
                block = reader.read(a, min(a + _BLOCK, n))
            except Exception as e:
                raise InvalidStoreError(
                    f"{path}: records {a}..{min(a + _BLOCK, n) - 1} do not read ({e}). Fix: "
                    "the shard is corrupt; copy it again."
                ) from e
            for k, data in enumerate(block):
                yield (a + k) << RECORD_SHIFT, data
    finally:
        reader.close()


class RecordCache:
    """Whole records of the ArrayRecord shards, kept up to ``max_bytes`` (least recent out)."""

    def __init__(self, paths: list[str], max_bytes: int):
        self.paths = paths
        self.max_bytes = max_bytes
        self._readers: dict[int, Any] = {}
        self._cache: collections.OrderedDict[tuple[int, int], bytes] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def record(self, shard: int, rec: int) -> bytes:
        key = (shard, rec)
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
            reader = self._readers.get(shard)
            if reader is None:
                reader = self._readers[shard] = open_reader(self.paths[shard])
        (data,) = reader.read([rec])
        with self._lock:
            if key not in self._cache:
                self._cache[key] = data
                self._bytes += len(data)
                while self._bytes > self.max_bytes and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._bytes -= len(old)
        return data

    def read(self, shard: int, address: int, n: int) -> bytes:
        rec, off = address >> RECORD_SHIFT, address & ((1 << RECORD_SHIFT) - 1)
        data = self.record(shard, rec)
        if off + n > len(data):
            raise InvalidStoreError(
                f"{self.paths[shard]}: record {rec} is shorter than indexed: it changed since. "
                "Fix: create the source again."
            )
        return data[off : off + n]

    def close(self) -> None:
        with self._lock:
            readers, self._readers = self._readers, {}
            self._cache.clear()
            self._bytes = 0
        for r in readers.values():
            r.close()
