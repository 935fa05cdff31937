"""Slot maps: where :class:`~grain_replay.sampling.priority.PrioritySampler` keeps each row.

A prioritized sampler holds one sum-tree leaf (a *slot*) per row of its process.
The slot map says which slot a row has, which rows a look at the store moved in
or out, and what a batch names a drawn slot: :class:`RowSlots` for a store that
only grows (slot ``j`` is the process's ``j``-th row, for ever), the
``SlotTable`` of :mod:`grain_replay.sampling.slot_table` for a bounded or
many-writer store (a ring per writer, rows named by id).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np

from grain_replay.errors import PriorityIndexError, ReplayCheckpointError

__all__ = ["Moves", "RecentDraws", "RowSlots", "SlotMap", "never_handed_out", "owned_seqs"]

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def owned_seqs(lo: int, hi: int, residue: int, count: int) -> np.ndarray:
    """The sequence numbers ``s`` in ``[lo, hi)`` with ``s % count == residue``."""
    if hi <= lo:
        return _EMPTY
    first = lo + (residue - lo) % count
    return np.arange(first, hi, count, dtype=np.int64)


def never_handed_out(index: np.ndarray, bad: np.ndarray, rule: str, shard: tuple[int, int]) -> None:
    """Raises for the rows of ``index`` where ``bad``: this process never handed them out.

    Raises:
      PriorityIndexError: naming the first few rows and the rows process ``p`` of ``P``
        (``shard``) draws (``rule``).
    """
    if bad.any():
        rows = index[bad][:5].tolist()
        raise PriorityIndexError(
            f"update_priorities: rows {rows} were never handed out by this iterator "
            f"(process {shard[0]} of {shard[1]} draws {rule}). Nothing was "
            "updated. Fix: pass the .index of batches from this iterator."
        )


class RecentDraws:
    """The last draws' rows and slots: an update of exactly a drawn batch (the usual
    ``update_priorities(batch.index, td)``) needs no lookup: its rows were handed out
    and held their slots when drawn."""

    def __init__(self, keep: int = 16) -> None:
        self._keep = keep
        # (batch size, first, last index) -> (index, slots, moves count at the draw)
        self._draws: OrderedDict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, int]]
        self._draws = OrderedDict()

    def remember(self, index: np.ndarray, slot: np.ndarray, moves: int) -> None:
        if not len(index):
            return
        key = (len(index), int(index[0]), int(index[-1]))
        self._draws[key] = (index.copy(), slot, moves)  # a copy: the batch's may be edited
        self._draws.move_to_end(key)
        if len(self._draws) > self._keep:
            self._draws.popitem(last=False)

    def recall(self, index: np.ndarray, moves: int) -> tuple[np.ndarray, int] | None:
        """The slots of a recent draw of exactly the rows ``index`` and the moves count
        they hold their rows at (-1: rows moved since the draw: checked when applied);
        None: no such draw."""
        if not len(index):
            return None
        hit = self._draws.get((len(index), int(index[0]), int(index[-1])))
        if hit is None or not np.array_equal(hit[0], index):
            return None
        return hit[1], hit[2] if hit[2] == moves else -1

    def clear(self) -> None:
        self._draws.clear()


class Moves(NamedTuple):
    """What a look at the store changed: the slots now, those emptied, those filled."""

    size: int
    out: np.ndarray  # slots whose rows left (their leaves go to 0)
    add: np.ndarray  # slots of new rows (their leaves go to the largest priority)
    appended: bool = False  # add is exactly the slots past the old size, in order


class SlotMap(Protocol):
    """What a :class:`~grain_replay.sampling.priority.PrioritySampler` asks of its slots."""

    version: int  # the state version of a sampler over such slots
    skip_zeros: bool  # the weights' minimum skips zero leaves (never drawn)
    kind: str  # the store, as a state mismatch names it
    empty: str  # the rows a draw needs ("committed", "live")
    moves: int  # looks that moved rows out of (or into) slots that held others

    def follow(self, length: Any, step: int) -> Moves | None: ...
    def index(self, slot: np.ndarray) -> np.ndarray: ...
    def live(self, size: int) -> np.ndarray: ...
    def holding(self, slot: np.ndarray, index: np.ndarray) -> np.ndarray: ...
    def lookup(self, index: np.ndarray, seen: np.ndarray) -> tuple[np.ndarray, int]: ...
    def saved_index(self, index: np.ndarray, slot: np.ndarray) -> np.ndarray: ...
    def restored(self, saved: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]: ...
    def not_a_state(self, e: Exception, state: Mapping[str, Any]) -> str: ...
    def state(self) -> dict[str, np.ndarray]: ...
    def parse(self, state: Mapping[str, Any], common: Mapping[str, Any]) -> Any: ...
    def restore(self, parsed: Any, length: Any) -> None: ...


class RowSlots:
    """The slots of a store that only grows: process ``p`` of ``P`` owns the rows ``i``
    with ``i % P == p``, and its ``j``-th row (row ``j * P + p``) has slot ``j``."""

    version = 1
    # A row at priority 0 (eps=0) is never drawn: the weights' minimum is over the
    # others (with zeros counted, every weight would be 0).
    skip_zeros = True
    kind = "a plain store"
    empty = "committed"
    moves = 0  # rows never leave their slots

    def __init__(self, shard_index: int, shard_count: int) -> None:
        self._p = shard_index
        self._count = shard_count
        self.shard = (shard_index, shard_count)
        self.size = 0

    def local_count(self, n: int) -> int:
        """This process's rows among the first ``n``."""
        return max(0, -(-(n - self._p) // self._count))

    def follow(self, length: Any, step: int) -> Moves | None:
        local = self.local_count(length.at(step))
        if local <= self.size:
            return None
        add = np.arange(self.size, local, dtype=np.int64)
        self.size = local
        return Moves(local, _EMPTY, add, appended=True)

    def index(self, slot: np.ndarray) -> np.ndarray:
        return slot * self._count + self._p  # a new array: the batch's, never the slots

    def live(self, size: int) -> np.ndarray:
        """The slots that hold a row, of a tree of ``size``: every one."""
        return np.arange(size, dtype=np.int64)

    def holding(self, slot: np.ndarray, index: np.ndarray) -> np.ndarray:
        return np.ones(len(slot), dtype=bool)

    def lookup(self, index: np.ndarray, seen: np.ndarray) -> tuple[np.ndarray, int]:
        """Each row's slot; raises for a row this process never handed out.

        Raises:
          PriorityIndexError: a row of another process, not yet drawn, or negative.
        """
        n_local = len(seen)
        if self._count == 1:
            local = index
            unknown = (index < 0) | (index >= n_local)
        else:
            local, rest = np.divmod(index, self._count)
            unknown = (index < 0) | (rest != self._p) | (local >= n_local)
        if unknown.any():
            unknown[~unknown] = ~seen[local[~unknown]]
        else:  # the usual case: all in range, one gather
            unknown = ~seen[local]
        never_handed_out(index, unknown, f"rows i with i % {self._count} == {self._p}", self.shard)
        return local, self.moves

    def saved_index(self, index: np.ndarray, slot: np.ndarray) -> np.ndarray:
        return slot  # version 1 keeps the local rows

    def restored(self, saved: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        return self.index(saved), saved, self.moves

    def not_a_state(self, e: Exception, state: Mapping[str, Any]) -> str:
        return (
            f"Not a prioritized-replay state ({type(e).__name__}: {e}). Fix: pass what "
            "priority_state() returned."
        )

    def state(self) -> dict[str, np.ndarray]:
        return {}

    def parse(self, state: Mapping[str, Any], common: Mapping[str, Any]) -> int:
        n, values = common["n"], common["values"]
        if len(values) != self.local_count(n) or common["seen_bits"] < len(values):
            raise ReplayCheckpointError(
                f"The priority state holds {len(values)} rows, but {n} committed rows give "
                f"process {self._p} {self.local_count(n)}. Fix: pass it unchanged."
            )
        return len(values)

    def restore(self, parsed: int, length: Any) -> None:
        self.size = parsed
