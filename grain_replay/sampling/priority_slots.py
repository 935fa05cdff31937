"""Prioritized replay over a bounded or many-writer store: a sum-tree slot per live row.

The rows of such a store (:class:`grain_replay.sources.PartsDataSource`) move as
writers evict, so priorities are kept by row id, not by position. Process ``p``
of ``P`` owns the rows whose id ``ordinal << 40 | seq`` has ``(seq + ordinal) %
P == p``: a function of the row alone, whatever each process's refreshes saw.
Writer ``w``'s owned row ``seq`` is its ``j = seq // P``-th; its slot is
``j mod R_w`` in a ring of ``R_w = ceil(capacity / P)`` slots (no two live owned
rows share one), laid out in chunks of ``min(R_w, 4096)`` slots that are added
as the writer's rows arrive (an unbounded writer's ring never wraps: it grows a
chunk at a time). The tree thus never holds more than the live rows plus a
chunk per writer, however many rows were ever inserted.

Each slot keeps the id of the row it holds (-1 when empty). At each look at the
store (``refresh_every`` draws, or ``refresh()``), rows evicted since the last
look leave the tree (their slots go to 0) and new rows enter at the largest
priority given so far. An update whose id no longer matches its slot (the row
was evicted meanwhile) is dropped, never written onto the row that took the slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import parts as parts_lib
from grain_replay.errors import InvalidSamplingError, PriorityIndexError, ReplayCheckpointError
from grain_replay.sampling.priority import PrioritizedReplay, PrioritySampler
from grain_replay.sampling.replay import IdTask
from grain_replay.sampling.sumtree import SumTree

__all__ = ["IdPriorityReader", "SlotPrioritySampler"]

CHUNK = 4096  # slots added to a writer's ring at a time
_UNBOUNDED = 1 << 62  # the ring of a writer without capacity: never wraps
_STATE_KIND = "slots"


def owned_seqs(lo: int, hi: int, residue: int, count: int) -> np.ndarray:
    """The sequence numbers ``s`` in ``[lo, hi)`` with ``s % count == residue``."""
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    first = lo + (residue - lo) % count
    return np.arange(first, hi, count, dtype=np.int64)


class SlotPrioritySampler(PrioritySampler):
    """:class:`PrioritySampler` over a by-id store: indices are row ids, slots follow rows."""

    def __init__(
        self,
        source: Any,
        options: PrioritizedReplay,
        batch_size: int,
        *,
        seed: int,
        lag: int,
        shard_index: int = 0,
        shard_count: int = 1,
    ) -> None:
        super().__init__(
            source,
            options,
            batch_size,
            seed=seed,
            lag=lag,
            shard_index=shard_index,
            shard_count=shard_count,
        )
        self._tree = SumTree(skip_zeros=True)
        self._ids = np.zeros(0, dtype=np.int64)  # the row id each slot holds, -1: empty
        self._seen = np.zeros(0, dtype=bool)  # slots whose row this process handed out
        # per writer (in the order they were first seen)
        self._ordinal: list[int] = []
        self._ring: list[int] = []  # slots in the writer's ring
        self._chunk: list[int] = []  # slots per chunk
        self._bases: list[list[int]] = []  # first slot of each chunk
        self._lo: list[int] = []  # the live rows [lo, hi) as last looked at
        self._hi: list[int] = []
        self._index_of: dict[int, int] = {}  # ordinal -> writer index
        self._tables: tuple[np.ndarray, ...] | None = None
        self._looked = -1  # the StoreLength look the slots follow

    # -- the slot table ---------------------------------------------------------

    def _writer(self, ordinal: int, capacity: int | None) -> int:
        w = self._index_of.get(ordinal)
        if w is not None:
            return w
        ring = _UNBOUNDED if capacity is None else -(-int(capacity) // self._count)
        self._index_of[ordinal] = w = len(self._ordinal)
        self._ordinal.append(ordinal)
        self._ring.append(ring)
        self._chunk.append(min(ring, CHUNK))
        self._bases.append([])
        self._lo.append(0)
        self._hi.append(0)
        self._tables = None
        return w

    def _table(self) -> tuple[np.ndarray, ...]:
        """Vectorized lookups: writer of ordinal, ring, chunk, table start/length, bases."""
        if self._tables is None:
            size = max(self._ordinal, default=-1) + 1
            of = np.full(size, -1, dtype=np.int64)
            of[self._ordinal] = np.arange(len(self._ordinal))
            lens = np.array([len(b) for b in self._bases], dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
            flat = np.array([x for b in self._bases for x in b], dtype=np.int64)
            self._tables = (
                of,
                np.array(self._ring, dtype=np.int64),
                np.array(self._chunk, dtype=np.int64),
                starts,
                lens,
                flat,
                np.array(self._lo, dtype=np.int64),
                np.array(self._hi, dtype=np.int64),
            )
        return self._tables

    def _slots_of(self, w: int, seqs: np.ndarray, allocate: bool) -> np.ndarray:
        """The slots of writer ``w``'s owned rows ``seqs`` (chunks added if ``allocate``)."""
        r = (seqs // self._count) % self._ring[w]
        k = self._chunk[w]
        chunk = r // k
        bases = self._bases[w]
        if allocate and len(seqs):
            more = int(chunk.max()) + 1 - len(bases)
            if more > 0:
                bases.extend(range(len(self._ids), len(self._ids) + more * k, k))
                self._ids = np.concatenate([self._ids, np.full(more * k, -1, dtype=np.int64)])
                self._seen = np.concatenate([self._seen, np.zeros(more * k, dtype=bool)])
                self._tables = None
        return np.asarray(bases, dtype=np.int64)[chunk] + r % k

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """For each id: its writer (-1: unknown), whether this process owns it, its slot
        (-1: none) and whether that slot holds it now."""
        of, ring, chunk, starts, lens, flat, lo, hi = self._table()
        ordinal, seq = ids >> parts_lib.ID_SHIFT, ids & parts_lib.SEQ_MASK
        known = (ordinal >= 0) & (ordinal < len(of))
        w = np.where(known, of[np.where(known, ordinal, 0)], -1)
        wc = np.maximum(w, 0)
        owned = (seq + ordinal) % self._count == self._p
        if not len(ring):
            slot = np.full(ids.shape, -1, dtype=np.int64)
            return w, owned, slot, np.zeros(ids.shape, dtype=bool), seq, lo, hi
        r = (seq // self._count) % ring[wc]
        c = r // chunk[wc]
        has = (w >= 0) & owned & (c < lens[wc])
        at = np.where(has, starts[wc] + c, 0)
        slot = np.where(has, flat[at] + r % chunk[wc] if len(flat) else 0, -1)
        holds = has & (self._ids[np.maximum(slot, 0)] == ids) if len(self._ids) else has & False
        return w, owned, slot, holds, seq, lo, hi

    def _sync(self) -> None:
        """Follows the store to the snapshot of the last look: evicted rows leave the
        tree, new rows enter it at the largest priority given so far."""
        self._looked = self._length.looks
        manifests = self._length.writers
        listed = set()
        gone: list[np.ndarray] = []
        new: list[np.ndarray] = []
        new_ids: list[np.ndarray] = []
        for m in manifests:
            w = self._writer(int(m.ordinal), m.capacity)
            listed.add(w)
            gone.append(self._move(w, int(m.live_start), int(m.committed), new, new_ids))
        for w in range(len(self._ordinal)):
            if w not in listed:  # the writer's folder went: its rows with it
                gone.append(self._move(w, 0, 0, new, new_ids))
        out = np.concatenate([np.zeros(0, dtype=np.int64), *gone])
        add = np.concatenate([np.zeros(0, dtype=np.int64), *new])
        if not len(out) and not len(add):
            return
        self._tables = None
        if len(self._tree) < len(self._ids):
            self._tree.extend(len(self._ids), 0.0)
        self._ids[out] = -1
        self._seen[out] = False
        self._ids[add] = np.concatenate(new_ids)
        self._seen[add] = False
        top = float(self._leaf(np.float64(self._max)))
        slots = np.concatenate([out, add])
        values = np.concatenate([np.zeros(len(out)), np.full(len(add), top)])
        if len(slots) > len(self._tree) // 4:  # many: rebuild in O(N), not O(B log N)
            leaves = np.array(self._tree.values)
            leaves[slots] = values
            self._tree = SumTree.from_values(leaves, skip_zeros=True)
        else:
            self._tree.set(slots, values)

    def _move(
        self, w: int, lo: int, hi: int, new: list[np.ndarray], new_ids: list[np.ndarray]
    ) -> np.ndarray:
        """Writer ``w``'s live rows become ``[lo, hi)``: the slots of the rows that left
        (returned) and, appended to ``new``/``new_ids``, those of the rows that came."""
        old_lo, old_hi = self._lo[w], self._hi[w]
        o = self._ordinal[w]
        residue = (self._p - o) % self._count
        left = np.concatenate(
            [
                owned_seqs(old_lo, min(old_hi, lo), residue, self._count),
                owned_seqs(max(old_lo, hi), old_hi, residue, self._count),
            ]
        )
        came = np.concatenate(
            [
                owned_seqs(lo, min(hi, old_lo), residue, self._count),
                owned_seqs(max(lo, old_hi), hi, residue, self._count),
            ]
        )
        self._lo[w], self._hi[w] = lo, hi
        out = self._slots_of(w, left, allocate=False) if len(left) else left
        if len(out):
            out = out[self._ids[out] == (o << parts_lib.ID_SHIFT) + left]
        if len(came):
            new.append(self._slots_of(w, came, allocate=True))
            new_ids.append((o << parts_lib.ID_SHIFT) + came)
        return out

    # -- PrioritySampler ----------------------------------------------------------

    def _grow(self, step: int) -> None:
        self._length.at(step)
        if self._length.looks != self._looked:
            self._sync()

    @property
    def live_slots(self) -> int:
        """Slots of this process's tree that hold a live row."""
        return int((self._ids >= 0).sum())

    @property
    def slot_count(self) -> int:
        """The size of this process's tree (live rows plus unfilled chunk tails)."""
        return len(self._ids)

    def draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Step ``step``'s row ids (int64) and importance weights (float32)."""
        with self._lock:
            self._apply(step)
            self._grow(step)
            total = self._tree.total
            if len(self._tree) == 0 or total <= 0:
                raise InvalidSamplingError(
                    f"{self._source!r} has no live rows for process {self._p} of "
                    f"{self._count} to replay. Fix: append and flush rows with a ReplayWriter "
                    "before the first batch."
                )
            u = self._draws.uniforms(step)
            u += self._offsets
            u *= total / self._batch_size
            slot = self._tree.find(u)
            p = self._tree.get(slot)
            weight = (self._tree.min / p) ** self.options.beta_at(step)
            self._seen[slot] = True
            return self._ids[slot], weight.astype(np.float32)

    def _apply(self, step: int) -> None:
        keep = []
        for stamp, ids, priorities in self._pending:
            if stamp + self.lag <= step:
                _, _, slot, holds, *_ = self._locate(ids)
                if holds.any():  # rows evicted since the update leave it
                    self._tree.set(slot[holds], self._leaf(priorities[holds]))
                self._max = max(self._max, float(priorities.max(initial=0.0)))
            else:
                keep.append((stamp, ids, priorities))
        self._pending = keep

    def _check_index(self, index: np.ndarray) -> None:
        """Raises for rows this process never handed out; evicted rows pass (dropped later)."""
        w, owned, slot, holds, seq, _, hi = self._locate(index)
        valid = index >= 0  # -1: a row that could not be read (see IdPriorityReader)
        wc = np.maximum(w, 0)
        ahead = (w < 0) | (seq >= hi[wc]) if len(hi) else np.ones(index.shape, bool)
        bad = valid & (~owned | ahead)
        live = valid & ~bad & holds
        if live.any():
            bad[live] = ~self._seen[slot[live]]
        if bad.any():
            rows = index[bad][:5].tolist()
            raise PriorityIndexError(
                f"update_priorities: rows {rows} were never handed out by this iterator "
                f"(process {self._p} of {self._count} draws the rows whose id "
                f"ordinal << 40 | seq has (seq + ordinal) % {self._count} == {self._p}). "
                "Nothing was updated. Fix: pass the .index of batches from this iterator."
            )

    def update(self, index: Any, priorities: Any, stamp: int) -> None:
        """Checks an update at once and queues it; rows evicted meanwhile are ignored."""
        index, priorities = self._checked(index, priorities)
        with self._lock:
            self._check_index(index)
            self._pending.append((int(stamp), index, priorities))

    def state(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        raise ReplayCheckpointError(
            f"{self._source!r}: the priorities of prioritized replay over a bounded or "
            "many-writer store are not checkpointed yet. Fix: checkpoint with "
            "gr.UniformReplay(), or restart the replay's priorities fresh."
        )

    def check_state(self, state: Mapping[str, Any]) -> None:
        self.state()

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.state()


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
