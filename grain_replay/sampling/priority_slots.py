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

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import parts as parts_lib
from grain_replay.errors import InvalidSamplingError, PriorityIndexError, ReplayCheckpointError
from grain_replay.sampling.priority import PrioritizedReplay, PrioritySampler
from grain_replay.sampling.replay import IdTask
from grain_replay.sampling.sumtree import SumTree, compiled

__all__ = ["IdPriorityReader", "SlotPrioritySampler"]

CHUNK = 4096  # slots added to a writer's ring at a time
_UNBOUNDED = 1 << 62  # the ring of a writer without capacity: never wraps
_STATE_VERSION = 2  # a plain store's PrioritySampler state is version 1


def owned_seqs(lo: int, hi: int, residue: int, count: int) -> np.ndarray:
    """The sequence numbers ``s`` in ``[lo, hi)`` with ``s % count == residue``."""
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    first = lo + (residue - lo) % count
    return np.arange(first, hi, count, dtype=np.int64)


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
    """:meth:`SlotPrioritySampler._slots`, one id after the other (compiled)."""
    good = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        o = x >> 40
        seq = x & 0xFFFFFFFFFF
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


@functools.cache
def _compiled() -> Any:
    """The compiled :func:`_slot_walk`, or None without numba (as the sum tree's walks)."""
    if compiled() is None:
        return None
    import numba

    return numba.njit(cache=True, nogil=True)(_slot_walk)


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
        # updates not applied yet: (stamp, ids, priorities, the slots found at the
        # update, the sync they were found at if they all held their rows then, else -1)
        self._queued: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]] = []
        self._syncs = 0  # looks that moved rows in or out
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
        self._writer_ids: list[str] = []
        self._tables: tuple[np.ndarray, ...] | None = None
        self._looked = -1  # the StoreLength look the slots follow

    # -- the slot table ---------------------------------------------------------

    def _writer(self, ordinal: int, capacity: int | None, writer_id: str) -> int:
        w = self._index_of.get(ordinal)
        if w is not None:
            self._writer_ids[w] = writer_id
            return w
        ring = _UNBOUNDED if capacity is None else -(-int(capacity) // self._count)
        self._index_of[ordinal] = w = len(self._ordinal)
        self._ordinal.append(ordinal)
        self._writer_ids.append(writer_id)
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

    def _slots(self, ids: np.ndarray) -> tuple[np.ndarray, bool]:
        """Each id's slot (-1: none), and whether every slot holds its row now and that
        row was handed out (compiled when numba is installed: one pass instead of ~20
        numpy calls on the batch)."""
        kernel = _compiled()
        if kernel is None:
            _, _, slot, holds, *_ = self._locate(ids)
            return slot, bool(holds.all() and self._seen[slot].all())
        of, ring, chunk, starts, lens, flat, _, _ = self._table()
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        slot = np.empty(len(ids), dtype=np.int64)
        good = kernel(ids, of, ring, chunk, starts, lens, flat, self._ids, self._seen,
                      self._count, self._p, slot)  # fmt: skip
        return slot, good == len(ids)

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, ...]:
        """For each id: its writer (-1: unknown), whether this process owns it, its slot
        (-1: none) and whether that slot holds it now; then its sequence number and
        every writer's live rows ``lo``, ``hi``."""
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
            w = self._writer(int(m.ordinal), m.capacity, m.writer_id)
            listed.add(w)
            gone.append(self._move(w, int(m.live_start), int(m.committed), new, new_ids))
        for w in range(len(self._ordinal)):
            if w not in listed:  # the writer's folder went: its rows with it
                gone.append(self._move(w, 0, 0, new, new_ids))
        out = np.concatenate([np.zeros(0, dtype=np.int64), *gone])
        add = np.concatenate([np.zeros(0, dtype=np.int64), *new])
        if not len(out) and not len(add):
            return
        self._syncs += 1
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
            leaves[out] = 0.0
            leaves[add] = top  # after: a slot both left and taken holds the new row
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
        for stamp, ids, priorities, slot, synced in self._queued:
            if stamp + self.lag <= step:
                if synced == self._syncs:  # no row moved since the update found its slot
                    self._tree.set(slot, self._leaf(priorities))
                    self._max = max(self._max, float(priorities.max(initial=0.0)))
                    continue
                # the slots found at the update, if they still hold the rows
                holds = (slot >= 0) & (self._ids[np.maximum(slot, 0)] == ids)
                if holds.all():
                    self._tree.set(slot, self._leaf(priorities))
                elif holds.any():  # rows evicted since the update leave it
                    self._tree.set(slot[holds], self._leaf(priorities[holds]))
                self._max = max(self._max, float(priorities.max(initial=0.0)))
            else:
                keep.append((stamp, ids, priorities, slot, synced))
        self._queued = keep

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
            slot, handed_out = self._slots(index)
            synced = self._syncs
            if not handed_out:  # not all live rows handed out
                self._check_index(index)
                synced = -1
            self._queued.append((int(stamp), index, priorities, slot, synced))

    # -- watermark and checkpointing -------------------------------------------------

    def commit_watermark(self) -> dict[str, int]:
        """Each writer's committed sequence number in the snapshot the draws come from."""
        with self._lock:
            return dict(zip(self._writer_ids, self._hi))

    def state(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        """Arrays that restore the slots and priorities exactly (by slot, with each
        writer's live rows ``[lo, hi)`` as the draws saw them; the rows' ids follow).

        Args:
          copy: False returns a read-only view of the tree's values, valid until the
            next draw.
        """
        with self._lock:
            counts = [len(x) for _, x, *_ in self._queued]
            return {
                "version": np.array(_STATE_VERSION, dtype=np.int64),
                "shard": np.array([self._p, self._count], dtype=np.int64),
                "options": np.array(
                    [self.options.alpha, self.options.eps, self.lag], dtype=np.float64
                ),
                "n": np.array(self._length.n, dtype=np.int64),
                "writer_ordinal": np.array(self._ordinal, dtype=np.int64),
                "writer_ring": np.array(self._ring, dtype=np.int64),
                "writer_live": np.array([self._lo, self._hi], dtype=np.int64).reshape(2, -1),
                "writer_chunks": np.array([len(b) for b in self._bases], dtype=np.int64),
                "chunk_base": np.array([x for b in self._bases for x in b], dtype=np.int64),
                "values": self._tree.values.copy() if copy else self._tree.values,
                "max_priority": np.array(self._max, dtype=np.float64),
                "seen": np.packbits(self._seen),
                "pending_stamp": np.array([t for t, *_ in self._queued], dtype=np.int64),
                "pending_count": np.array(counts, dtype=np.int64),
                "pending_index": np.concatenate(
                    [np.zeros(0, np.int64)] + [x for _, x, *_ in self._queued]
                ),
                "pending_priority": np.concatenate(
                    [np.zeros(0)] + [q for _, _, q, *_ in self._queued]
                ),
            }

    def _parse_slots(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`state`'s arrays, checked against this sampler (nothing changes)."""
        fix = "Fix: pass the state unchanged, to a loader made with the same arguments."
        try:
            version = int(state["version"])
            shard = np.asarray(state["shard"]).tolist()
            options = np.asarray(state["options"]).tolist()
            out: dict[str, Any] = {
                "n": int(state["n"]),
                "ordinal": np.asarray(state["writer_ordinal"], dtype=np.int64).reshape(-1),
                "ring": np.asarray(state["writer_ring"], dtype=np.int64).reshape(-1),
                "live": np.asarray(state["writer_live"], dtype=np.int64).reshape(2, -1),
                "chunks": np.asarray(state["writer_chunks"], dtype=np.int64).reshape(-1),
                "bases": np.asarray(state["chunk_base"], dtype=np.int64).reshape(-1),
                "values": np.asarray(state["values"], dtype=np.float64).reshape(-1),
                "max": float(state["max_priority"]),
                "seen": np.asarray(state["seen"], dtype=np.uint8),
                "stamps": np.asarray(state["pending_stamp"], dtype=np.int64),
                "counts": np.asarray(state["pending_count"], dtype=np.int64),
                "index": np.asarray(state["pending_index"], dtype=np.int64),
                "prio": np.asarray(state["pending_priority"], dtype=np.float64),
            }
        except (KeyError, TypeError, ValueError) as e:
            kind = "a state of prioritized replay over a plain store" if "seen" in state else ""
            raise ReplayCheckpointError(
                f"{self._source!r}: not a state of prioritized replay over a bounded or "
                f"many-writer store ({type(e).__name__}: {e}{'; ' + kind if kind else ''}). " + fix
            ) from e
        want = [self.options.alpha, self.options.eps, self.lag]
        if version != _STATE_VERSION or shard != [self._p, self._count] or options != want:
            raise ReplayCheckpointError(
                f"The priority state was saved by process {shard[0]} of {shard[1]} with "
                f"(alpha, eps, lag)={tuple(options)}; this is process {self._p} of "
                f"{self._count} with {tuple(want)}. Fix: restore each process's own state "
                "with the same PrioritizedReplay, worker_count and worker_buffer_size."
            )
        k = len(out["ordinal"])
        slots = len(out["values"])
        chunk = np.minimum(out["ring"], CHUNK)
        bases = out["bases"]
        problems = []
        if len(out["ring"]) != k or out["live"].shape[1] != k or len(out["chunks"]) != k:
            problems.append(f"{k} writers but tables of other lengths")
            sizes = ends = bases
        elif (out["chunks"] < 0).any() or len(bases) != int(out["chunks"].sum()):
            problems.append(f"{len(bases)} chunks but {int(out['chunks'].sum())} counted")
            sizes = ends = bases
        else:
            sizes = np.repeat(chunk, out["chunks"])
            ends = bases + sizes
        if problems:
            pass
        elif int(sizes.sum()) != slots:
            problems.append(f"{slots} slots but chunks covering {int(sizes.sum())}")
        elif len(bases) and (
            int(bases.min()) < 0 or int(ends.max()) > slots or len(np.unique(bases)) != len(bases)
        ):
            problems.append("chunks outside the slots")
        elif (out["ring"] <= 0).any() or (out["live"][0] > out["live"][1]).any():
            problems.append("a writer's ring or live rows out of range")
        elif len(np.unique(out["ordinal"])) != k or (out["ordinal"] < 0).any():
            problems.append("repeated writers")
        elif (
            len(np.unpackbits(out["seen"])) < slots
            or not np.isfinite(out["values"]).all()
            or (out["values"] < 0).any()
        ):
            problems.append("bad priorities or handed-out bits")
        c = out["counts"]
        if int(c.sum()) != len(out["index"]) or len(out["index"]) != len(out["prio"]):
            problems.append("inconsistent pending updates")
        elif len(out["stamps"]) != len(c):
            problems.append("inconsistent pending updates")
        if not problems:
            out["ids"] = self._held(out, chunk, problems)
        if problems:
            raise ReplayCheckpointError(
                f"{self._source!r}: the priority state is damaged ({problems[0]}). " + fix
            )
        return out

    def _held(self, out: dict[str, Any], chunk: np.ndarray, problems: list[str]) -> np.ndarray:
        """The id each slot of a parsed state holds: each writer's owned live rows."""
        ids = np.full(len(out["values"]), -1, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(out["chunks"])]).astype(np.int64)
        for w, o in enumerate(out["ordinal"].tolist()):
            lo, hi = (int(x) for x in out["live"][:, w])
            seqs = owned_seqs(lo, hi, (self._p - o) % self._count, self._count)
            r = (seqs // self._count) % int(out["ring"][w])
            c = r // int(chunk[w])
            if len(seqs) > int(out["ring"][w]) or (len(c) and int(c.max()) >= out["chunks"][w]):
                problems.append(f"writer ordinal {o}: live rows outside its slots")
                return ids
            slot = out["bases"][starts[w] + c] + r % int(chunk[w])
            if (ids[slot] != -1).any():
                problems.append(f"writer ordinal {o}: two rows in one slot")
                return ids
            ids[slot] = (o << parts_lib.ID_SHIFT) + seqs
        if (out["values"][ids < 0] != 0).any():
            problems.append("a priority on an empty slot")
        return ids

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raises what :meth:`set_state` would raise, changing nothing."""
        self._parse_slots(state)

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state`; the slots' ids follow from each writer's live rows."""
        out = self._parse_slots(state)
        k = len(out["ordinal"])
        chunks = np.concatenate([[0], np.cumsum(out["chunks"])]).astype(np.int64)
        slots = len(out["values"])
        pending = []
        for stamp, end, count in zip(out["stamps"], np.cumsum(out["counts"]), out["counts"]):
            pending.append(
                (int(stamp), out["index"][end - count : end], out["prio"][end - count : end])
            )
        with self._lock:
            self._ordinal = [int(o) for o in out["ordinal"]]
            self._ring = [int(r) for r in out["ring"]]
            self._chunk = [min(r, CHUNK) for r in self._ring]
            self._bases = [out["bases"][chunks[w] : chunks[w + 1]].tolist() for w in range(k)]
            self._lo = [int(x) for x in out["live"][0]]
            self._hi = [int(x) for x in out["live"][1]]
            self._index_of = {o: w for w, o in enumerate(self._ordinal)}
            names = {int(m.ordinal): m.writer_id for m in self._length.writers}
            self._writer_ids = [names.get(o, f"ordinal-{o}") for o in self._ordinal]
            self._tables = None
            self._ids = out["ids"]
            self._seen = np.unpackbits(out["seen"])[:slots].astype(bool)
            self._tree = SumTree.from_values(out["values"], skip_zeros=True)
            self._max = out["max"]
            self._queued = [(t, x, q, self._slots(x)[0], -1) for t, x, q in pending]
            self._length.n = out["n"]
            self._looked = self._length.looks  # the next look follows the store again


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
