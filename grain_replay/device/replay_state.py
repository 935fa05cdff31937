"""The state of a :class:`~grain_replay.DeviceReplay` (a pytree of arrays) and its ring's
bookkeeping on the host (which slot takes which new row at a refresh)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from grain_replay.errors import InvalidArgumentError, InvalidStoreError
from grain_replay.store import parts as parts_lib

__all__ = [
    "FIELDS",
    "DeviceReplayState",
    "Ring",
    "join_ids",
    "news",
    "replaced",
    "split_ids32",
]

LANES = 128  # the live-slot table's lines
_LO_BITS = 31
_LO_MASK = (1 << _LO_BITS) - 1


def split_ids32(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 row ids as two int32 arrays ``(ids >> 31, ids & (2**31 - 1))`` (-1: no row ->
    ``(-1, 0)``): jax keeps 32 bits without x64."""
    ids = np.asarray(ids, dtype=np.int64)
    hi = np.where(ids < 0, -1, ids >> _LO_BITS).astype(np.int32)
    lo = np.where(ids < 0, 0, ids & _LO_MASK).astype(np.int32)
    return hi, lo


def join_ids(hi: Any, lo: Any) -> np.ndarray:
    """:func:`split_ids32` undone: int64 ids, -1 where ``hi < 0``."""
    hi = np.asarray(hi, dtype=np.int64)
    lo = np.asarray(lo, dtype=np.int64)
    return np.where(hi < 0, -1, hi << _LO_BITS | lo)


class DeviceReplayState(NamedTuple):
    """Everything a :class:`~grain_replay.DeviceReplay` holds on the device; one pytree.

    ``C`` is the ring's capacity (slots), ``W`` the writers it keeps a watermark for.
    Saved and restored as one Orbax item (``ocp.args.StandardSave(state)``).

    Attributes:
      rows: the row buffers: the leaves' 32-bit words in 128-lane lines, one buffer per
        layout and width (see ``device/lines.py``).
      slot_hi: int32[C]: the row id held by each slot, high bits (``id >> 31``); -1: empty.
      slot_lo: int32[C]: its low 31 bits. A row id is the store position for a plain or
        growing store, ``ordinal << 40 | seq`` for a bounded many-writer store.
      order: int32[C]: the refresh that filled (or emptied) each slot; -1: never used.
      live: bool[C]: the slot holds a live row (the only slots a draw can return).
      live_slots: int32[L, 128] (``L = ceil(C / 128)`` lines): the live slots, first
        ``n_live`` entries (uniform draws).
      n_live: int32[]: how many slots are live.
      priority: float32[C]: each slot's priority (0 where not live).
      max_priority: float32[]: the largest priority given so far (1.0 at first): new rows'.
      sums: the sum tree (prioritized; ``()`` for uniform): ``sums[0]`` float32[L, 128]
        each slot's mass ``(priority + eps) ** alpha`` (-0.0 where empty), ``sums[l]`` the
        sums of level ``l - 1``'s lines, as lines; the top one line
        (``device/replay_tree.py``).
      mins: the min tree over the live slots' masses, levels 1 up (+inf where none).
      mark_hi: int32[W]: per writer ordinal (0 for a plain store), the next row sequence
        number not yet looked at (the watermark), high bits.
      mark_lo: int32[W]: its low 31 bits.
      refreshes: int32[]: refreshes so far.
    """

    rows: tuple[jax.Array, ...]
    slot_hi: jax.Array
    slot_lo: jax.Array
    order: jax.Array
    live: jax.Array
    live_slots: jax.Array
    n_live: jax.Array
    priority: jax.Array
    max_priority: jax.Array
    sums: tuple[jax.Array, ...]
    mins: tuple[jax.Array, ...]
    mark_hi: jax.Array
    mark_lo: jax.Array
    refreshes: jax.Array


FIELDS: tuple[str, ...] = DeviceReplayState._fields


def replaced(state: DeviceReplayState, **changes: Any) -> DeviceReplayState:
    """``state`` with the fields ``changes`` names set (a new state; ``state`` is kept)."""
    return state._replace(**changes)


class Ring:
    """The host copy of a state's bookkeeping, planned into at a refresh.

    Args:
      ids: int64[C] row id per slot, -1 where empty.
      order: int32[C] see :class:`DeviceReplayState`.
      live: bool[C].
      marks: int64[W] per-writer watermark.
      refreshes: refreshes so far.
    """

    def __init__(
        self,
        ids: np.ndarray,
        order: np.ndarray,
        live: np.ndarray,
        marks: np.ndarray,
        refreshes: int,
    ) -> None:
        self.ids = ids
        self.order = order
        self.live = live
        self.marks = marks
        self.refreshes = refreshes

    @classmethod
    def empty(cls, capacity: int, writers: int) -> Ring:
        return cls(
            np.full(capacity, -1, np.int64),
            np.full(capacity, -1, np.int32),
            np.zeros(capacity, bool),
            np.zeros(writers, np.int64),
            0,
        )

    @classmethod
    def of(cls, state: DeviceReplayState) -> Ring:
        """The bookkeeping of ``state``, fetched from the device (one transfer per array)."""
        hi, lo, order, live, mhi, mlo, refreshes = jax.device_get(
            (
                state.slot_hi,
                state.slot_lo,
                state.order,
                state.live,
                state.mark_hi,
                state.mark_lo,
                state.refreshes,
            )
        )
        return cls(
            join_ids(hi, lo),
            np.array(order, np.int32),
            np.array(live, bool),
            join_ids(mhi, mlo),
            int(refreshes),
        )

    def evict(self, gone: np.ndarray) -> int:
        """Empties the slots of ``gone`` (bool[C]: their rows left the store); returns how
        many live slots it emptied."""
        gone = gone & self.live
        self.live[gone] = False
        self.ids[gone] = -1
        self.order[gone] = self.refreshes + 1
        return int(gone.sum())

    def place(self, new_ids: np.ndarray) -> np.ndarray:
        """Slots for ``new_ids`` (oldest first; at most C): empty slots first, the one
        emptied longest ago first (never used before any), then the oldest live rows
        (their rows leave the ring). Returns int32 slots, one per new id."""
        k = len(new_ids)
        if k == 0:
            return np.zeros(0, np.int32)
        empty = np.flatnonzero(~self.live)
        empty = empty[np.argsort(self.order[empty], kind="stable")]
        targets = empty[:k]
        if len(targets) < k:
            full = np.flatnonzero(self.live)
            oldest = full[np.lexsort((self.ids[full], self.order[full]))]
            targets = np.concatenate([targets, oldest[: k - len(targets)]])
        self.ids[targets] = new_ids
        self.live[targets] = True
        self.order[targets] = self.refreshes + 1
        return targets.astype(np.int32)

    def arrays(self) -> dict[str, np.ndarray]:
        """The bookkeeping as the state's host arrays (after a refresh: ``refreshes + 1``)."""
        hi, lo = split_ids32(self.ids)
        mhi, mlo = split_ids32(self.marks)
        c = len(self.live)
        table = np.zeros(-(-c // LANES) * LANES, np.int32)
        held = np.flatnonzero(self.live).astype(np.int32)
        table[: len(held)] = held
        return {
            "slot_hi": hi,
            "slot_lo": lo,
            "order": self.order.astype(np.int32),
            "live": self.live.copy(),
            "live_slots": table.reshape(-1, LANES),
            "n_live": np.array(len(held), np.int32),
            "mark_hi": mhi,
            "mark_lo": mlo,
            "refreshes": np.array(self.refreshes + 1, np.int32),
        }


def news(
    source: Any, ring: Ring, bounded: bool, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(positions, ids)`` of ``source``'s rows to bring into ``ring`` (oldest first, at
    most its capacity) and the bool[C] mask of slots whose rows left the store (None: none
    can); advances the ring's watermarks. ``bounded``: a many-writer store (ids are
    ``ordinal << 40 | seq``), else a plain one (ids are positions); ``where`` names it."""
    c = ring.ids.shape[0]
    n = len(source)
    if not bounded:
        mark = int(ring.marks[0])
        if n < mark:
            raise InvalidStoreError(
                f"DeviceReplay: {where} has {n} rows, but the ring already loaded "
                f"{mark}: the store was replaced or truncated. Fix: init() a new state."
            )
        ring.marks[0] = n
        positions = np.arange(max(mark, n - c), n, dtype=np.int64)
        return positions, positions, None
    positions = np.arange(n, dtype=np.int64)
    ids = source.ids(positions, check=False)
    ordinal, seq = parts_lib.split_ids(ids)
    if n and int(ordinal.max()) >= len(ring.marks):
        raise InvalidArgumentError(
            f"DeviceReplay: {where} has a writer of ordinal {int(ordinal.max())}, "
            f"beyond max_writers={len(ring.marks)}. Fix: DeviceReplay(..., "
            f"max_writers={2 * int(ordinal.max()) + 2}) and init() again."
        )
    gone = ring.live & ~np.isin(ring.ids, ids)
    new = seq >= ring.marks[ordinal]
    positions, ordinal, seq = positions[new], ordinal[new], seq[new]
    np.maximum.at(ring.marks, ordinal, seq + 1)
    if len(positions) > c:  # the newest rows of each writer, round robin
        by = np.lexsort((-seq, ordinal))
        first = np.searchsorted(ordinal[by], ordinal[by], side="left")
        rank = np.empty(len(by), np.int64)
        rank[by] = np.arange(len(by)) - first
        keep = np.sort(np.argsort(rank, kind="stable")[:c])
        positions = positions[keep]
    return positions, source.ids(positions, check=False), gone
