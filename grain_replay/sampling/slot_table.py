"""The slots of prioritized replay over a bounded or many-writer store: a ring per writer.

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
store, only the rows that each writer evicted or committed since the last look
move: their slots leave the tree or enter it (:meth:`SlotTable.follow`). An
update whose id no longer matches its slot (the row was evicted meanwhile) is
dropped, never written onto the row that took the slot.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.errors import ReplayCheckpointError
from grain_replay.sampling.slot_state import STATE_VERSION, held_ids, parse_tables, table_problem
from grain_replay.sampling.slots import Moves, never_handed_out, owned_seqs
from grain_replay.sampling.sumtree import compiled
from grain_replay.store import parts as parts_lib

__all__ = ["CHUNK", "SlotTable", "owned_seqs"]

CHUNK = 4096  # slots added to a writer's ring at a time
_UNBOUNDED = 1 << 62  # the ring of a writer without capacity: never wraps
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False


def _slot_walk(
    ids: np.ndarray,
    of: np.ndarray,
    ring: np.ndarray,
    chunk: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    flat: np.ndarray,
    held: np.ndarray,
    seen: np.ndarray,
    count: int,
    p: int,
    slot_out: np.ndarray,
) -> int:
    """:meth:`SlotTable.lookup`'s slots, one id after the other (compiled)."""
    good = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        o, seq = _split_ids(x)
        slot_out[i] = -1
        if x < 0 or o >= of.shape[0] or of[o] < 0 or (seq + o) % count != p:
            continue
        w = of[o]
        r = (seq // count) % ring[w]
        c = r // chunk[w]
        if c >= lens[w]:
            continue
        slot = flat[starts[w] + c] + r % chunk[w]
        slot_out[i] = slot
        if held[slot] == x and seen[slot]:
            good += 1
    return good


# What _slot_walk splits ids with: compiled by _compiled() (numba calls only compiled
# functions), so that the ids' bits stay parts_lib's alone.
_split_ids: Any = parts_lib.split_ids


@functools.cache
def _compiled() -> Any:
    """The compiled :func:`_slot_walk`, or None without numba (as the sum tree's walks)."""
    global _split_ids
    if compiled() is None:
        return None
    import numba

    _split_ids = numba.njit(cache=True, nogil=True)(parts_lib.split_ids)
    return numba.njit(cache=True, nogil=True)(_slot_walk)


class SlotTable:
    """The slot map of a by-id store: batch indices are row ids, slots follow rows.

    Args:
      where: the store, as errors name it.
      shard_index, shard_count: this process and the processes sharing the rows.
    """

    version = STATE_VERSION
    skip_zeros = True  # an empty slot is a zero, never drawn, not the minimum
    kind = "a bounded or many-writer store"
    empty = "live"

    def __init__(self, where: str, shard_index: int, shard_count: int) -> None:
        self._where = where
        self._p = shard_index
        self._count = shard_count
        self.shard = (shard_index, shard_count)
        self.moves = 0  # looks that moved rows in or out
        self.ids = np.zeros(0, dtype=np.int64)  # the row id each slot holds, -1: empty
        # per writer (in the order they were first seen)
        self._ordinal: list[int] = []
        self._ring: list[int] = []  # slots in the writer's ring
        self._chunk: list[int] = []  # slots per chunk
        self._bases: list[list[int]] = []  # first slot of each chunk
        self._lo: list[int] = []  # the live rows [lo, hi) as last looked at
        self._hi: list[int] = []
        self._index_of: dict[int, int] = {}  # ordinal -> writer index
        self.writer_ids: list[str] = []
        self._tables: tuple[np.ndarray, ...] | None = None
        self._looked = -1  # the StoreLength look the slots follow

    @property
    def size(self) -> int:
        """Slots: live rows plus unfilled chunk tails."""
        return len(self.ids)

    def watermark(self) -> dict[str, int]:
        """Each writer's committed sequence number as last looked at."""
        return dict(zip(self.writer_ids, self._hi))

    # -- the writers' rings -------------------------------------------------------

    def _writer(self, ordinal: int, capacity: int | None, writer_id: str) -> int:
        w = self._index_of.get(ordinal)
        if w is not None:
            self.writer_ids[w] = writer_id
            return w
        ring = _UNBOUNDED if capacity is None else -(-int(capacity) // self._count)
        self._index_of[ordinal] = w = len(self._ordinal)
        self._ordinal.append(ordinal)
        self.writer_ids.append(writer_id)
        self._ring.append(ring)
        self._chunk.append(min(ring, CHUNK))
        self._bases.append([])
        self._lo.append(0)
        self._hi.append(0)
        self._tables = None
        return w

    def _table(self) -> tuple[np.ndarray, ...]:
        """Vectorized lookups: writer of ordinal, ring, chunk, table start/length, bases,
        live rows."""
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
                bases.extend(range(len(self.ids), len(self.ids) + more * k, k))
                self.ids = np.concatenate([self.ids, np.full(more * k, -1, dtype=np.int64)])
                self._tables = None
        if len(bases) == 1:  # a ring of one chunk (capacity <= CHUNK per process)
            return r + bases[0]
        return np.asarray(bases, dtype=np.int64)[chunk] + r % k

    # -- following the store ------------------------------------------------------

    def follow(self, length: Any, step: int) -> Moves | None:
        """The slots whose rows left or came since the last look (None: nothing moved).

        Only the rows between each writer's old and new live ranges are touched:
        a look costs O(rows moved + writers), not O(live rows).
        """
        length.at(step)
        if length.looks == self._looked:
            return None
        self._looked = length.looks
        listed = set()
        gone: list[np.ndarray] = []
        new: list[np.ndarray] = []
        new_ids: list[np.ndarray] = []
        for m in length.writers:
            w = self._writer(int(m.ordinal), m.capacity, m.writer_id)
            listed.add(w)
            lo, hi = int(m.live_start), int(m.committed)
            if (lo, hi) != (self._lo[w], self._hi[w]):
                gone.append(self._move(w, lo, hi, new, new_ids))
        for w in range(len(self._ordinal)):
            if w not in listed and (self._lo[w], self._hi[w]) != (0, 0):  # its folder went
                gone.append(self._move(w, 0, 0, new, new_ids))
        if not any(len(g) for g in gone) and not new:
            return None
        self.moves += 1
        self._tables = None
        out = np.concatenate([_EMPTY, *gone]) if len(gone) != 1 else gone[0]
        add = np.concatenate([_EMPTY, *new]) if len(new) != 1 else new[0]
        self.ids[out] = -1
        self.ids[add] = np.concatenate(new_ids) if len(new_ids) != 1 else new_ids[0]
        return Moves(len(self.ids), out, add)

    def _move(
        self, w: int, lo: int, hi: int, new: list[np.ndarray], new_ids: list[np.ndarray]
    ) -> np.ndarray:
        """Writer ``w``'s live rows become ``[lo, hi)``: the slots of the rows that left
        (returned) and, appended to ``new``/``new_ids``, those of the rows that came."""
        old_lo, old_hi = self._lo[w], self._hi[w]
        o = self._ordinal[w]
        residue = (self._p - o) % self._count
        c = self._count
        left = [owned_seqs(old_lo, min(old_hi, lo), residue, c)]
        left.append(owned_seqs(max(old_lo, hi), old_hi, residue, c))
        came = [owned_seqs(lo, min(hi, old_lo), residue, c)]
        came.append(owned_seqs(max(lo, old_hi), hi, residue, c))
        self._lo[w], self._hi[w] = lo, hi
        gone = np.concatenate(left) if len(left[1]) else left[0]
        out = self._slots_of(w, gone, allocate=False) if len(gone) else gone
        if len(out):
            out = out[self.ids[out] == parts_lib.make_ids(o, gone)]
        rows = np.concatenate(came) if len(came[0]) else came[1]
        if len(rows):
            new.append(self._slots_of(w, rows, allocate=True))
            new_ids.append(parts_lib.make_ids(o, rows))
        return out

    # -- ids and slots ------------------------------------------------------------

    def index(self, slot: np.ndarray) -> np.ndarray:
        """The row ids the drawn slots hold."""
        return self.ids[slot]

    def live(self, size: int) -> np.ndarray:
        """The slots that hold a live row (of the tree's ``size``, the table's)."""
        return np.flatnonzero(self.ids[:size] >= 0)

    def holding(self, slot: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Whether each slot still holds the row of ``index``."""
        return (slot >= 0) & (self.ids[np.maximum(slot, 0)] == index)

    def lookup(self, index: np.ndarray, seen: np.ndarray) -> tuple[np.ndarray, int]:
        """Each id's slot (-1: none) and the look they were found at when every one is
        live and was handed out (else -1: each is checked again when applied).

        Raises:
          PriorityIndexError: an id this process never handed out (evicted rows pass).
        """
        kernel = _compiled()
        if kernel is None:
            _, _, slot, holds, *_ = self._locate(index)
            good = bool(holds.all() and seen[slot].all())
        else:
            of, ring, chunk, starts, lens, flat, _, _ = self._table()
            index = np.ascontiguousarray(index, dtype=np.int64)
            slot = np.empty(len(index), dtype=np.int64)
            found = kernel(index, of, ring, chunk, starts, lens, flat, self.ids, seen,
                           self._count, self._p, slot)  # fmt: skip
            good = found == len(index)
        if good:
            return slot, self.moves
        self._check(index, seen)
        return slot, -1

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """For each id: its writer (-1: unknown), whether this process owns it, its slot
        (-1: none) and whether that slot holds it now; then its sequence number and
        every writer's live rows ``lo``, ``hi``."""
        of, ring, chunk, starts, lens, flat, lo, hi = self._table()
        ordinal, seq = parts_lib.split_ids(ids)
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
        holds = has & (self.ids[np.maximum(slot, 0)] == ids) if len(self.ids) else has & False
        return w, owned, slot, holds, seq, lo, hi

    def slots(self, ids: np.ndarray) -> np.ndarray:
        """Each id's slot if it holds that row now, else -1."""
        _, _, slot, holds, *_ = self._locate(np.asarray(ids, dtype=np.int64))
        return np.where(holds, slot, -1)

    def _check(self, index: np.ndarray, seen: np.ndarray) -> None:
        """Raises for rows this process never handed out; evicted rows pass (dropped later)."""
        w, owned, slot, holds, seq, _, hi = self._locate(index)
        valid = index >= 0  # -1: a row that could not be read (see IdPriorityReader)
        wc = np.maximum(w, 0)
        ahead = (w < 0) | (seq >= hi[wc]) if len(hi) else np.ones(index.shape, bool)
        bad = valid & (~owned | ahead)
        live = valid & ~bad & holds
        if live.any():
            bad[live] = ~seen[slot[live]]
        rule = f"the rows whose id ordinal << 40 | seq has (seq + ordinal) % {self._count} == "
        never_handed_out(index, bad, rule + str(self._p), self.shard)

    # -- checkpointing ------------------------------------------------------------

    def saved_index(self, index: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """What a checkpoint keeps of a queued update's rows: their ids."""
        return index

    def restored(self, saved: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """A restored queued update: its ids, their slots now, checked again when applied."""
        _, _, slot, *_ = self._locate(saved)
        return saved, slot, -1

    def not_a_state(self, e: Exception, state: Mapping[str, Any]) -> str:
        kind = "a state of prioritized replay over a plain store" if "seen" in state else ""
        return (
            f"{self._where}: not a state of prioritized replay over a bounded or "
            f"many-writer store ({type(e).__name__}: {e}{'; ' + kind if kind else ''}). "
            "Fix: pass the state unchanged, to a loader made with the same arguments."
        )

    def state(self) -> dict[str, np.ndarray]:
        """Each writer's ring, chunks and live rows ``[lo, hi)`` as the draws saw them
        (the slots' ids follow from them)."""
        return {
            "writer_ordinal": np.array(self._ordinal, dtype=np.int64),
            "writer_ring": np.array(self._ring, dtype=np.int64),
            "writer_live": np.array([self._lo, self._hi], dtype=np.int64).reshape(2, -1),
            "writer_chunks": np.array([len(b) for b in self._bases], dtype=np.int64),
            "chunk_base": np.array([x for b in self._bases for x in b], dtype=np.int64),
        }

    def parse(self, state: Mapping[str, Any], common: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`state`'s tables, checked against the tree of ``common`` (nothing changes)."""
        fix = "Fix: pass the state unchanged, to a loader made with the same arguments."
        try:
            out = parse_tables(state)
        except (KeyError, TypeError, ValueError) as e:
            raise ReplayCheckpointError(self.not_a_state(e, state)) from e
        problems: list[str] = []
        chunk = np.minimum(out["ring"], CHUNK)
        problem = table_problem(out, chunk, common["values"], common["seen_bits"])
        if problem is None:
            out["ids"] = held_ids(out, chunk, common["values"], self._p, self._count, problems)
        else:
            problems.append(problem)
        if problems:
            raise ReplayCheckpointError(
                f"{self._where}: the priority state is damaged ({problems[0]}). " + fix
            )
        return out

    def restore(self, out: Mapping[str, Any], length: Any) -> None:
        """Takes the tables :meth:`parse` returned; the next look follows the store again."""
        k = len(out["ordinal"])
        chunks = np.concatenate([[0], np.cumsum(out["chunks"])]).astype(np.int64)
        self._ordinal = [int(o) for o in out["ordinal"]]
        self._ring = [int(r) for r in out["ring"]]
        self._chunk = [min(r, CHUNK) for r in self._ring]
        self._bases = [out["bases"][chunks[w] : chunks[w + 1]].tolist() for w in range(k)]
        self._lo = [int(x) for x in out["live"][0]]
        self._hi = [int(x) for x in out["live"][1]]
        self._index_of = {o: w for w, o in enumerate(self._ordinal)}
        names = {int(m.ordinal): m.writer_id for m in length.writers}
        self.writer_ids = [names.get(o, f"ordinal-{o}") for o in self._ordinal]
        self._tables = None
        self.ids = out["ids"]
        self._looked = length.looks
