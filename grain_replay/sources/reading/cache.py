"""The decoded-chunk cache: an LRU bounded by bytes, or dense per-leaf arrays when all fits."""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

import numpy as np

from grain_replay.errors import InvalidArgumentError

__all__ = ["ChunkCache", "DEFAULT_CACHE_BYTES", "fit_cap_bytes", "share_cache_budget"]


class _FitCacheBytes(int):
    """The default ``cache_bytes``: an int (128 MiB) that also means "fit the store".

    A cache created with it grows to the decoded size of the store's chunked
    leaves when that is at most :func:`fit_cap_bytes`, and stays at 128 MiB
    otherwise. With uniformly random batches the hit rate is about
    ``cache / decoded store``, so a cache pays off when the whole store fits
    (every batch becomes a gather from decoded chunks, 30-200x h5py's sorted
    read on the benchmark's 525 MB transitions) and is memory spent for little
    gain when it does not (256 MiB: 2.0x; 384 MiB: 3.0x; 128 MiB: 1.7-6.6x).
    """

    def __reduce__(self) -> Any:
        return (_FitCacheBytes, (int(self),))


# Per process (grain workers each have one), shared by every leaf of a source.
DEFAULT_CACHE_BYTES = _FitCacheBytes(128 * 2**20)


_cache_share = 1  # processes splitting the budget: a loader's workers (share_cache_budget)

_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def share_cache_budget(processes: int) -> None:
    """Splits :func:`fit_cap_bytes` between ``processes`` reading the same job's stores.

    ``make_data_loader``'s workers call it with the worker count, so that N
    workers decoding the same store hold at most 1/32 of the memory together,
    not each.
    """
    global _cache_share
    _cache_share = max(1, int(processes))


def fit_cap_bytes() -> int:
    """Largest cache the default grows to: 1/32 of the memory (cgroup v1 or v2 limit
    included), at most 1 GiB, split between the processes of :func:`share_cache_budget`;
    never below the 128 MiB default."""
    total = 0
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        pass
    for path in _MEMORY_LIMITS:
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit)) if total else int(limit)
    return max(int(DEFAULT_CACHE_BYTES), min(2**30, total // 32) // _cache_share)


class ChunkCache:
    """Thread-safe LRU of decoded chunks, bounded by bytes."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        if max_bytes < 0:
            raise InvalidArgumentError(f"cache_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._fit = isinstance(max_bytes, _FitCacheBytes)
        self._leaves: dict[str, int] = {}
        self._data: collections.OrderedDict[tuple[str, int], np.ndarray] = collections.OrderedDict()
        self._bytes = 0
        # When every registered leaf fits the bound, each leaf decodes into one
        # dense array instead (``dense``): a batch is then one np.take, not a
        # Python loop over the chunks it touches.
        self._dense: dict[str, tuple[tuple[Any, ...], np.ndarray, np.ndarray]] = {}
        self._dense_bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def register(self, name: str, nbytes: int) -> None:
        """Declares leaf ``name``'s decoded size; a default-sized cache grows to fit them all."""
        with self._lock:
            self._leaves[name] = nbytes
            if not self._fit:
                return
            need = sum(self._leaves.values())
            base = int(DEFAULT_CACHE_BYTES)
            self.max_bytes = max(base, need) if need <= fit_cap_bytes() else base

    def dense(
        self, name: str, shape: tuple[int, ...], dtype: np.dtype, num_chunks: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """``(rows, decoded)`` for leaf ``name`` when all registered leaves fit, else None.

        ``rows`` is the whole leaf, filled chunk by chunk (untouched pages cost no
        memory); ``decoded[c]`` says whether chunk ``c`` is in it.
        """
        if sum(self._leaves.values()) > self.max_bytes:
            return None
        key = (shape, np.dtype(dtype).str, num_chunks)
        with self._lock:
            entry = self._dense.get(name)
            if entry is None or entry[0] != key:  # new, or the store grew (refresh)
                entry = (key, np.empty(shape, dtype), np.zeros(num_chunks, bool))
                self._dense[name] = entry
            return entry[1], entry[2]

    def count(self, hits: int, misses: int, filled_bytes: int = 0) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses
            self._dense_bytes += filled_bytes

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        with self._lock:
            block = self._data.get(key)
            if block is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return block

    def put(self, key: tuple[str, int], block: np.ndarray) -> None:
        if block.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._data[key] = block
            self._bytes += block.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._data.popitem(last=False)
                self._bytes -= evicted.nbytes

    def clear(self) -> None:
        """Forgets every decoded chunk (the hit and miss counters stay).

        Dense leaves keep their memory (it is reused when chunks are decoded again).
        """
        with self._lock:
            self._data.clear()
            self._bytes = 0
            for _, _, decoded in self._dense.values():
                decoded[:] = False  # decoded again on demand, into the same memory
            self._dense_bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes + self._dense_bytes
