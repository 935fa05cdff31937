"""A bounded LRU of whole piece objects, their rows packed into one array per leaf, for
readers of object storage: a batch of cached rows is one take per leaf.

Pieces never change once written (a piece's name carries its writer's lease epoch and
flush attempt, and a deleted name is never written again), so a cached piece is never
stale: there is nothing to invalidate, only a byte bound to keep.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection, Hashable, Mapping

import numpy as np

from grain_replay.errors import ArgumentTypeError, InvalidArgumentError
from grain_replay.store.layout import LeafSpec

__all__ = ["DEFAULT_PIECE_CACHE_BYTES", "PieceArena", "check_cache_bytes"]

# Per source per process (grain workers each hold their own copy).
DEFAULT_PIECE_CACHE_BYTES = 256 * 2**20

# A piece's hold on its slot: unique in the process (a slot reused by another piece, or
# an arena made after a fork, never shows a token handed out before), so a caller's
# remembered ``(slot, token)`` cannot read another piece's rows.
_TOKENS = itertools.count()
_EMPTY = np.iinfo(np.int64).max  # last use of an empty slot: never the least recent


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


class PieceArena:
    """Pieces (each ``{leaf: rows}``) held in one array per leaf, least recently used
    dropped beyond ``max_bytes``.

    A piece's rows lie anywhere in the leaf arrays (the rows an evicted piece frees are
    reused, nothing is moved); ``directory[base[slot] + i]`` is where row ``i`` of the
    piece in ``slot`` lies. ``nbytes`` is every array that grows with the rows: the leaf
    arrays, the free-row stack and the directory (twice the rows: room to place pieces
    between compactions), never more than ``max_bytes``; a few words a piece beside.

    Thread-safe: one lock around every read and write of the arrays (memory copies
    only: the caller does its I/O outside). One per process: its owner
    (:class:`~grain_replay.sources.parts.piece_reader.PieceReader`) is made again after a
    fork.
    """

    def __init__(self, max_bytes: int, leaves: Mapping[str, LeafSpec]) -> None:
        self.max_bytes = int(max_bytes)
        self.leaves = dict(leaves)
        self.row_bytes = sum(
            leaf.dtype.itemsize * int(np.prod(leaf.shape, dtype=np.int64))
            for leaf in self.leaves.values()
        )
        # int32 row numbers where the directory (twice the rows) stays below 2**31
        narrow = 2 * (self.max_bytes // (self.row_bytes + 12)) < 2**31
        self._int = np.dtype(np.int32 if narrow else np.int64)
        self.row_cost = self.row_bytes + 3 * self._int.itemsize
        self.max_rows = self.max_bytes // self.row_cost if self.row_bytes else 0
        self._lock = threading.Lock()
        self._tick = 0
        self._release()

    def _release(self) -> None:
        """Empty, holding nothing."""
        self._rows = 0  # allocated rows of each leaf array
        self._arrays = {k: np.empty((0, *v.shape), v.dtype) for k, v in self.leaves.items()}
        self._free = np.empty(0, self._int)  # a stack: the rows the next piece takes last
        self._nfree = 0
        self._dir = np.empty(0, self._int)
        self._top = 0  # directory entries placed (live or freed) since the last compaction
        self._slot_of: dict[Hashable, int] = {}
        self._key_of: list[Hashable | None] = []
        self._spare: list[int] = []
        self._token = np.empty(0, np.int64)
        self._used = np.empty(0, np.int64)  # tick of the last use (LRU)
        self._base = np.empty(0, np.int64)
        self._count = np.empty(0, np.int64)

    # -- sizes --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held (``rows * row_cost``), at most ``max_bytes``."""
        return sum(a.nbytes for a in self._arrays.values()) + self._free.nbytes + self._dir.nbytes

    @property
    def held_rows(self) -> int:
        """Rows of the pieces held (the rest of the allocated rows are free)."""
        return self._rows - self._nfree

    def fits(self, rows: int) -> bool:
        """Whether a piece of ``rows`` rows can be held at all."""
        return 0 < rows <= self.max_rows

    # -- reads --------------------------------------------------------------------------

    def find(self, key: Hashable) -> tuple[int, int] | None:
        """``(slot, token)`` of the piece ``key`` if held."""
        with self._lock:
            slot = self._slot_of.get(key)
            return None if slot is None else (slot, int(self._token[slot]))

    def entries(self) -> list[tuple[Hashable, int, int]]:
        """``(key, slot, token)`` of every piece held."""
        with self._lock:
            return [(k, s, int(self._token[s])) for k, s in self._slot_of.items()]

    def copy_rows(
        self,
        slot: np.ndarray,
        token: np.ndarray,
        local: np.ndarray,
        out: Mapping[str, np.ndarray],
        at: np.ndarray | None = None,
    ) -> np.ndarray:
        """Copies row ``local[i]`` of the piece held at ``slot[i]`` with ``token[i]`` into
        ``out[leaf][at[i]]`` (``at`` None: ``out[leaf][i]``), one take per leaf, for each
        ``i`` whose piece is held; returns which those are (now the most recently used)."""
        with self._lock:
            if not len(self._token) or not len(slot):
                return np.zeros(len(slot), dtype=bool)
            # a slot out of range (-1: none, or a slot of an arena before a fork) clips to
            # one whose token it does not hold: tokens are unique, an empty slot's is -2
            s = slot
            hit = self._token.take(slot, mode="clip") == token
            every = bool(hit.all())
            if not every:
                if not hit.any():
                    return hit
                s, local = s[hit], local[hit]
                at = np.flatnonzero(hit) if at is None else at[hit]
            rows = self._dir[self._base[s] + local].astype(np.intp)  # once, not per leaf
            self._tick += 1
            self._used[s] = self._tick
            for name, dst in out.items():
                src = self._arrays[name]
                if at is None:  # rows are in range: "clip" takes into ``out`` unbuffered
                    src.take(rows, axis=0, out=dst, mode="clip")
                else:
                    dst[at] = src.take(rows, axis=0, mode="clip")
            return hit

    # -- writes -------------------------------------------------------------------------

    def reserve(self, rows: int) -> None:
        """Allocates room for ``rows`` more rows now (up to the bound), so that the pieces
        of one batch grow the arrays once, to the size they need."""
        with self._lock:
            want = min(self.max_rows, self.held_rows + rows)
            if want > self._rows:
                self._grow(max(want, min(self.max_rows, self._rows * 3 // 2)))

    def put(
        self, key: Hashable, leaves: Mapping[str, np.ndarray], count: int
    ) -> tuple[int, int] | None:
        """Holds the piece ``key`` of ``count`` rows (``leaves[name]``: its rows of each
        leaf of the arena), dropping the least recently used pieces to make room;
        returns its ``(slot, token)`` (None: larger than the bound, not held)."""
        if not self.fits(count):
            return None
        with self._lock:
            slot = self._slot_of.get(key)
            if slot is None:
                rows = self._take_rows(count)
                for name, arr in self._arrays.items():
                    arr[rows] = leaves[name]
                slot = self._place(key, rows)
            self._tick += 1
            self._used[slot] = self._tick
            return slot, int(self._token[slot])

    def keep_only(self, keys: Collection[Hashable]) -> None:
        """Drops every piece not in ``keys`` (those a new snapshot no longer names); an
        arena left empty releases its arrays."""
        with self._lock:
            for key in [k for k in self._slot_of if k not in keys]:
                self._evict(self._slot_of[key])
            if not self._slot_of:
                self._release()

    # -- under the lock -----------------------------------------------------------------

    def _grow(self, rows: int) -> None:
        old = self._rows
        for name, arr in self._arrays.items():
            new = np.empty((rows, *arr.shape[1:]), arr.dtype)
            new[:old] = arr
            self._arrays[name] = new
        free = np.empty(rows, self._int)
        free[: self._nfree] = self._free[: self._nfree]
        # pushed from the last row down: the next piece takes the lowest rows, in order
        free[self._nfree : self._nfree + rows - old] = np.arange(rows - 1, old - 1, -1)
        self._free, self._nfree, self._rows = free, self._nfree + rows - old, rows
        directory = np.empty(2 * rows, self._int)
        directory[: self._top] = self._dir[: self._top]
        self._dir = directory

    def _take_rows(self, count: int) -> np.ndarray:
        """``count`` free rows (growing the arrays, or evicting the least recently used)."""
        while self._nfree < count:
            if self._rows < self.max_rows:
                want = min(self.max_rows, self._rows + count - self._nfree)
                self._grow(max(want, min(self.max_rows, self._rows * 3 // 2)))
            else:
                self._evict(int(np.argmin(self._used)))
        rows = self._free[self._nfree - count : self._nfree][::-1].copy()
        self._nfree -= count
        return rows

    def _place(self, key: Hashable, rows: np.ndarray) -> int:
        """Writes ``rows`` into the directory (compacting it when full) under a new slot."""
        n = len(rows)
        if self._top + n > len(self._dir):
            self._compact()
        base = self._top
        self._dir[base : base + n] = rows
        self._top += n
        if self._spare:
            slot = self._spare.pop()
        else:
            slot = len(self._key_of)
            self._key_of.append(None)
            grow = max(8, 2 * slot)
            for name in ("_token", "_used", "_base", "_count"):
                arr = getattr(self, name)
                if len(arr) <= slot:
                    fresh = np.full(grow, {"_used": _EMPTY, "_token": -2}.get(name, -1), np.int64)
                    fresh[: len(arr)] = arr
                    setattr(self, name, fresh)
        self._key_of[slot] = key
        self._slot_of[key] = slot
        self._token[slot] = next(_TOKENS)
        self._base[slot], self._count[slot] = base, n
        return slot

    def _compact(self) -> None:
        """The directory's live entries moved to its front (pieces keep their rows)."""
        live = sorted(self._slot_of.values(), key=lambda s: int(self._base[s]))
        at = 0
        for s in live:  # in base order: each moves down, never over one not yet moved
            b, n = int(self._base[s]), int(self._count[s])
            self._dir[at : at + n] = self._dir[b : b + n]
            self._base[s] = at
            at += n
        self._top = at

    def _evict(self, slot: int) -> None:
        b, n = int(self._base[slot]), int(self._count[slot])
        self._free[self._nfree : self._nfree + n] = self._dir[b : b + n][::-1]
        self._nfree += n
        key = self._key_of[slot]
        del self._slot_of[key]
        self._key_of[slot] = None
        self._spare.append(slot)
        self._token[slot], self._used[slot] = -2, _EMPTY
