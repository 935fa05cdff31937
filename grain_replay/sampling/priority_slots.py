"""Prioritized replay over a bounded or many-writer store: a sum-tree slot per live row.

The sampler is :class:`~grain_replay.sampling.priority.PrioritySampler` over a
:class:`~grain_replay.sampling.slot_table.SlotTable` (a ring of slots per writer;
see that module for how ids, slots and processes relate). This module adds what
differs for the user: batches name rows by id, each writer's commit watermark,
and the worker-side reader that marks rows gone before they could be read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.sampling.priority import PrioritizedReplay, PrioritySampler
from grain_replay.sampling.replay import IdTask
from grain_replay.sampling.slot_table import CHUNK, SlotTable
from grain_replay.sampling.slots import owned_seqs

__all__ = ["CHUNK", "IdPriorityReader", "SlotPrioritySampler", "owned_seqs"]


class SlotPrioritySampler(PrioritySampler):
    """:class:`PrioritySampler` over a by-id store: indices are row ids, slots follow rows.

    At each look at the store (``refresh_every`` draws, or ``refresh()``), rows
    evicted since the last look leave the tree (their slots go to 0) and new rows
    enter at the largest priority given so far; ``update_priorities`` of a row
    evicted meanwhile is ignored, never written onto the row that took its slot.
    """

    _slots: SlotTable

    def __init__(
        self,
        source: Any,
        options: PrioritizedReplay,
        batch_size: int,
        *,
        seed: int,
        lag: int,
        workers: tuple[int, int] = (0, 1),
        shard_index: int = 0,
        shard_count: int = 1,
    ) -> None:
        super().__init__(
            source,
            options,
            batch_size,
            seed=seed,
            lag=lag,
            workers=workers,
            shard_index=shard_index,
            shard_count=shard_count,
            slots=SlotTable(repr(source), shard_index, shard_count),
        )

    @property
    def live_slots(self) -> int:
        """Slots of this process's tree that hold a live row."""
        return int((self._slots.ids >= 0).sum())

    @property
    def slot_count(self) -> int:
        """The size of this process's tree (live rows plus unfilled chunk tails)."""
        return self._slots.size

    def slots_of(self, ids: Any) -> np.ndarray:
        """The slot of each row id while it holds that row, else -1."""
        return self._slots.slots(np.asarray(ids, dtype=np.int64))

    def held_ids(self) -> np.ndarray:
        """The row id each slot holds (-1: empty), a copy."""
        return self._slots.ids.copy()

    def leaves(self) -> np.ndarray:
        """The tree's leaf of each slot (``(priority + eps) ** alpha``; 0: empty), a copy."""
        with self._lock:
            return self._tree.values.copy()

    def commit_watermark(self) -> dict[str, int]:
        """Each writer's committed sequence number in the snapshot the draws come from."""
        with self._lock:
            return self._slots.watermark()


class IdPriorityReader:
    """Worker side of prioritized replay over a by-id store: ``(data, ok)`` of a step's ids.

    ``ok`` is False where a drawn row could not be read any more (its writer evicted
    more than a segment between the draw and the read, before this process opened
    it): another live row stands in for its data, and the batch names it -1 with
    weight 0, so it is never taken for the drawn row. The loader's maps run here, on
    the data alone.
    """

    def __init__(self, source: Any, maps: Sequence[Any] = ()) -> None:
        self.source = source
        self.maps = tuple(maps)

    def __call__(self, task: Any) -> tuple[Any, np.ndarray]:
        ids = task.ids if isinstance(task, IdTask) else np.asarray(task, dtype=np.int64)
        data, ok = self.source.read_ids_checked(ids)
        for op in self.maps:
            data = op.map(data)
        return data, ok

    def __repr__(self) -> str:
        return f"IdPriorityReader({self.source!r})"
