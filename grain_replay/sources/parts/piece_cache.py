"""A bounded LRU of whole piece objects (their leaves, as arrays over the bytes fetched),
for readers of object storage.

Pieces never change once written (a piece's name carries its writer's lease epoch and
flush attempt, and a deleted name is never written again), so a cached piece is never
stale: there is nothing to invalidate, only a byte bound to keep.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Collection, Hashable
from typing import Any

from grain_replay.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["DEFAULT_PIECE_CACHE_BYTES", "PieceCache", "check_cache_bytes"]

# Per source per process (grain workers each hold their own copy).
DEFAULT_PIECE_CACHE_BYTES = 256 * 2**20


def check_cache_bytes(value: object, where: str) -> int:
    """``value`` as a byte bound (an int >= 0), or a named error with a fix."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(
            f"{where}: cache_bytes must be an int (bytes of whole pieces held in memory), "
            f"got {value!r} ({type(value).__name__}). Fix: pass e.g. cache_bytes=256 * 2**20, "
            "or cache_bytes=0 to read with ranged GETs only."
        )
    if value < 0:
        raise InvalidArgumentError(
            f"{where}: cache_bytes must be >= 0, got {value}. Fix: pass a byte count such "
            "as cache_bytes=256 * 2**20, or cache_bytes=0 to disable the piece cache."
        )
    return int(value)


class PieceCache:
    """Piece -> its leaves (``{name: array}``), least recently used dropped beyond
    ``max_bytes`` (the bytes of the objects).

    Thread-safe; the lock is held only around dict operations, never during I/O. Made in
    the process that uses it (``pid``): a copy inherited across a fork is not used.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.pid = os.getpid()
        self._data: collections.OrderedDict[Hashable, tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._data)

    def fits(self, size: int) -> bool:
        return 0 < size <= self.max_bytes

    def get(self, key: Hashable) -> Any:
        """The value put under ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._data.get(key)
            if found is None:
                return None
            self._data.move_to_end(key)
            return found[0]

    def put(self, key: Hashable, value: Any, nbytes: int) -> None:
        """Holds ``value`` (``nbytes`` of memory) unless larger than the bound, dropping
        the least recently used beyond it."""
        if not self.fits(nbytes):
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._data[key] = (value, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                _, (_, dropped) = self._data.popitem(last=False)
                self.nbytes -= dropped

    def keep_only(self, keys: Collection[Hashable]) -> None:
        """Drops every piece not in ``keys`` (those a new snapshot no longer names)."""
        with self._lock:
            for key in [k for k in self._data if k not in keys]:
                self.nbytes -= self._data.pop(key)[1]
