"""Prioritized replay (Schaul et al. 2016): proportional sampling from a sum tree in numpy."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from grain_replay.errors import (
    InvalidPriorityError,
    InvalidSamplingError,
    ReplayCheckpointError,
)
from grain_replay.sampling.draws import Draws
from grain_replay.sampling.priority_options import PrioritizedReplay, Sampled
from grain_replay.sampling.priority_state import KINDS, parse_common, pending_updates
from grain_replay.sampling.slots import RecentDraws, RowSlots, SlotMap
from grain_replay.sampling.store_length import StoreLength
from grain_replay.sampling.sumtree import SumTree

__all__ = ["PrioritizedReplay", "Sampled", "PrioritySampler"]  # the first two: re-exported


class _Undo(NamedTuple):
    """What the draw of one step changed, so that the state before it can be rebuilt:
    the queue and the largest priority before it, the leaves its updates overwrote
    (``(slots, old leaves)`` in the order written), the slots it handed out first, and
    whether it looked at the store (a look's outcome depends on when it ran)."""

    queued: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]]
    max: float
    leaves: list[tuple[np.ndarray, np.ndarray]]
    fresh: np.ndarray
    looked: bool


class PrioritySampler:
    """Consumer side of :class:`PrioritizedReplay`, over this process's share of the rows.

    Process ``p`` of ``P`` owns the rows ``i`` with ``i % P == p`` (a growing store
    spreads its new rows over every process). Updates are checked at once and
    applied just before the first draw allowed to see them: an update stamped
    ``s`` (the loader position it follows) reaches draws of steps ``>= s + lag``.
    That keeps the draws a function of the seed and the sequence of updates, even
    when the draws run ahead of the learner on another thread.

    Each row has a leaf of the sum tree, a *slot*; ``slots`` says which (default
    :class:`~grain_replay.sampling.slots.RowSlots`: slot ``j`` is the process's
    ``j``-th row), which rows each look at the store moved in or out, and what a
    batch names a drawn slot. New rows enter at the largest priority given so far,
    rows that left go to 0, and an update whose row left its slot meanwhile is dropped.
    """

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
        slots: SlotMap | None = None,
    ) -> None:
        self.options = options
        self._source = source
        self._length = StoreLength(source, options.refresh_every)
        self._batch_size = batch_size
        self._draws = Draws(seed, shard_index, batch_size)
        self.lag = lag
        self._workers = (int(workers[0]), int(workers[1]))  # what the lag comes from
        self._p = shard_index
        self._count = shard_count
        self._slots: SlotMap = RowSlots(shard_index, shard_count) if slots is None else slots
        self._tree = SumTree(skip_zeros=self._slots.skip_zeros)
        self._max = 1.0  # largest priority given so far (raw, before eps and alpha)
        self._seen = np.zeros(0, dtype=bool)  # slots whose row this process handed out
        # updates not applied yet: (stamp, index, priorities, their slots, the moves
        # count they were found at if they all held their rows then, else -1)
        self._queued: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]] = []
        self._recent = RecentDraws()
        # step -> what its draw changed (see state_at), for the draws not yet forgotten
        self._undo: dict[int, _Undo] = {}
        self._lock = threading.Lock()

    @property
    def source(self) -> Any:
        """The store the rows are drawn from."""
        return self._source

    def _leaf(self, priorities: Any) -> Any:
        return (priorities + self.options.eps) ** self.options.alpha

    def refresh(self) -> None:
        self._length.request()

    def _grow(self, step: int) -> bool:
        """Follows the store to its length at ``step``: rows that left go to 0, new rows
        enter at the largest priority given so far (only the moved slots are touched).
        Returns whether any slot moved."""
        moves = self._slots.follow(self._length, step)
        if moves is None:
            return False
        size, out, add, appended = moves
        old = len(self._tree)
        top = float(self._leaf(np.float64(self._max)))
        if len(self._seen) < size:
            seen = np.zeros(size, dtype=bool)
            seen[: len(self._seen)] = self._seen
            self._seen = seen
        self._seen[out] = False
        self._seen[add] = False
        if appended:
            self._tree.extend(size, top)  # new rows at the end, in order: O(new rows)
        elif len(out) + len(add) > size // 4:  # many: rebuild in O(N), not O(B log N)
            leaves = np.zeros(size)
            leaves[:old] = self._tree.values
            leaves[out] = 0.0
            leaves[add] = top  # after: a slot both left and taken holds the new row
            self._tree = SumTree.from_values(leaves, skip_zeros=self._slots.skip_zeros)
        else:
            self._tree.extend(size, 0.0)
            self._tree.set(np.concatenate([out, add]), np.repeat([0.0, top], [len(out), len(add)]))
        return True

    @property
    def max_priority(self) -> float:
        """The largest priority given so far (1.0 before any update): new rows' priority."""
        return self._max

    @property
    def bound(self) -> int:
        """The length the last draw drew below (its rows are < it)."""
        return self._length.n

    def draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Step ``step``'s batch indices (int64; rows, or row ids) and importance weights
        (float32)."""
        with self._lock:
            queued, top = list(self._queued), self._max
            leaves: list[tuple[np.ndarray, np.ndarray]] = []
            looks = self._length.looks
            self._apply(step, leaves)
            grew = self._grow(step)
            looked = grew or self._length.looks != looks
            units = self._draws.units(step)
            if self._tree.total > 0:
                slot, p = self._tree.find_stratified(units)
                weight = (self._tree.min / p) ** self.options.beta_at(step)
            else:  # every live row at priority 0 (eps=0): uniform, as Reverb draws
                slot, weight = self._uniform(units), np.ones(len(units))
            fresh = slot[~self._seen[slot]]
            self._seen[slot] = True
            self._undo[step] = _Undo(queued, top, leaves, fresh, looked)
            index = self._slots.index(slot)
            self._recent.remember(index, slot, self._slots.moves)
            return index, weight.astype(np.float32)

    def _uniform(self, units: np.ndarray) -> np.ndarray:
        """A stratified uniform draw of the live slots (their priorities are all 0)."""
        live = self._slots.live(len(self._tree))
        if not len(live):
            raise InvalidSamplingError(
                f"{self._source!r} has no {self._slots.empty} rows for process {self._p} "
                f"of {self._count} to replay. Fix: append and flush rows with a "
                "ReplayWriter before the first batch."
            )
        count = len(units)
        at = ((units + np.arange(count)) * (len(live) / count)).astype(np.int64)
        return live[np.minimum(at, len(live) - 1)]

    def apply_updates(self, step: int) -> None:
        """Writes the queued updates that the draw of ``step`` may see into the tree."""
        with self._lock:
            self._apply(step)
            self._undo.clear()  # the tree changed outside a draw: no state before a draw

    def _apply(self, step: int, leaves: list[tuple[np.ndarray, np.ndarray]] | None = None) -> None:
        """Applies the updates due at ``step``; ``leaves`` collects ``(slots, old leaves)``."""
        if not self._queued:
            return
        keep = []
        for entry in self._queued:
            stamp, index, priorities, slot, found_at = entry
            if stamp + self.lag > step:
                keep.append(entry)
                continue
            given = priorities
            if found_at != self._slots.moves:  # rows moved since: keep those still held
                holds = self._slots.holding(slot, index)
                if not holds.all():  # rows evicted since the update leave it
                    slot, given = slot[holds], priorities[holds]
            if leaves is not None:
                leaves.append((slot, self._tree.get(slot)))
            self._tree.set(slot, self._leaf(given))
            self._max = max(self._max, float(priorities.max(initial=0.0)))
        self._queued = keep

    def update(self, index: Any, priorities: Any, stamp: int) -> None:
        """Checks an update at once and queues it for the draws from ``stamp + lag`` on
        (rows of a bounded store evicted meanwhile are ignored).

        Raises:
          InvalidPriorityError: wrong length, or a priority negative, NaN or infinite.
          PriorityIndexError: a row that this process never handed out.
        """
        index, priorities = self._checked(index, priorities)
        with self._lock:
            # A drawn batch: its rows were handed out and held their slots at the draw.
            found = self._recent.recall(index, self._slots.moves)
            slot, found_at = self._slots.lookup(index, self._seen) if found is None else found
            self._queued.append((int(stamp), index, priorities, slot, found_at))

    @staticmethod
    def _checked(index: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(index, priorities)`` as flat int64 and float64, checked (nothing changes)."""
        index = np.asarray(index)
        priorities = np.asarray(priorities)
        if index.size != priorities.size:
            raise InvalidPriorityError(
                f"update_priorities got {index.size} indices but {priorities.size} priorities. "
                "Fix: pass one priority per index (e.g. the batch's index and its TD errors)."
            )
        if index.size and not np.issubdtype(index.dtype, np.integer):
            raise InvalidPriorityError(
                f"update_priorities: index must hold integers (a batch's .index), got "
                f"dtype {index.dtype}."
            )
        index = index.reshape(-1).astype(np.int64)
        priorities = priorities.reshape(-1).astype(np.float64)
        bad = ~np.isfinite(priorities) | (priorities < 0)
        if bad.any():
            where = np.flatnonzero(bad)[:5]
            raise InvalidPriorityError(
                f"update_priorities: priorities must be finite and >= 0; got "
                f"{priorities[where].tolist()} at positions {where.tolist()} (rows "
                f"{index[where].tolist()}). Nothing was updated. Fix: pass abs(td_error), "
                "with NaNs removed."
            )
        return index, priorities

    # -- checkpointing -------------------------------------------------------

    def state(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        """Arrays that restore the priorities exactly: tree values, pending updates, ...

        Args:
          copy: False returns a read-only view of the tree's values, valid until the
            next draw (for a caller that encodes them at once, holding off draws).
        """
        with self._lock:
            values = self._tree.values.copy() if copy else self._tree.values
            return self._arrays(values, self._seen, self._max, self._queued)

    def state_at(self, step: int, drawn: int, *, copy: bool = True) -> dict[str, np.ndarray] | None:
        """:meth:`state` as it was before the draw of ``step``, the draws of ``step`` to
        ``drawn - 1`` undone: their updates back in the queue (in the order given), their
        leaves and handed-out bits as before. The same arrays, whatever ran ahead.

        None when one of those draws looked at the store (or is no longer remembered,
        or the tree changed outside a draw): what that look saw depends on when it ran,
        so only the draws made after it repeat the run; the caller saves them then.

        Args:
          copy: as for :meth:`state` (a copy is made anyway when a leaf is undone).
        """
        with self._lock:
            undo = [self._undo.get(s) for s in range(step, drawn)]
            if not all(u is not None and not u.looked for u in undo):
                return None
            done = [u for u in undo if u is not None]
            if not done:
                values = self._tree.values.copy() if copy else self._tree.values
                return self._arrays(values, self._seen, self._max, self._queued)
            values = self._tree.values.copy()
            seen = self._seen.copy()
            for u in reversed(done):
                for slot, old in reversed(u.leaves):
                    values[slot] = old
                seen[u.fresh] = False
            # The queue before ``step``, then what was queued since, in the order given.
            queued: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]] = []
            known: set[int] = set()
            for entries in [*(u.queued for u in done), self._queued]:
                for entry in entries:
                    if id(entry) not in known:
                        known.add(id(entry))
                        queued.append(entry)
            return self._arrays(values, seen, done[0].max, queued)

    def forget(self, before: int) -> None:
        """Drops what the draws of steps before ``before`` changed (no state before them)."""
        with self._lock:
            for step in [s for s in self._undo if s < before]:
                del self._undo[step]

    def _arrays(
        self,
        values: np.ndarray,
        seen: np.ndarray,
        top: float,
        queued: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, int]],
    ) -> dict[str, np.ndarray]:
        saved = [self._slots.saved_index(x, slot) for _, x, _, slot, _ in queued]
        return {
            "version": np.array(self._slots.version, dtype=np.int64),
            "shard": np.array([self._p, self._count], dtype=np.int64),
            "options": np.array([self.options.alpha, self.options.eps, self.lag], dtype=np.float64),
            "workers": np.array(self._workers, dtype=np.int64),
            "n": np.array(self._length.n, dtype=np.int64),
            **self._slots.state(),
            "values": values,
            "max_priority": np.array(top, dtype=np.float64),
            "seen": np.packbits(seen),
            "pending_stamp": np.array([e[0] for e in queued], dtype=np.int64),
            "pending_count": np.array([len(x) for x in saved], dtype=np.int64),
            "pending_index": np.concatenate([np.zeros(0, np.int64), *saved]),
            "pending_priority": np.concatenate([np.zeros(0)] + [e[2] for e in queued]),
        }

    def _parse(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
        """:meth:`state`'s arrays, checked against this sampler (nothing changes): the
        common ones, and what the slot map parsed of its own."""
        common = parse_common(state, self._slots.not_a_state)
        want = [self.options.alpha, self.options.eps, self.lag]
        version, shard, options = common["version"], common["shard"], common["options"]
        if version != self._slots.version:
            raise ReplayCheckpointError(
                f"{self._source!r}: the priority state is one of prioritized replay over "
                f"{KINDS.get(version, f'an unknown kind (version {version})')}; this loader "
                f"replays {self._slots.kind}. Fix: restore into a loader over the store the "
                "state was saved with."
            )
        if shard != [self._p, self._count]:
            raise ReplayCheckpointError(
                f"The priority state was saved by process {shard[0]} of {shard[1]}; this is "
                f"process {self._p} of {self._count}. Fix: restore each process's own state "
                "(saved by the process with the same index, in a run of as many processes)."
            )
        if options[:2] != want[:2]:
            raise ReplayCheckpointError(
                f"The priority state was saved with PrioritizedReplay(alpha={options[0]:g}, "
                f"eps={options[1]:g}); this loader has alpha={self.options.alpha:g}, "
                f"eps={self.options.eps:g}. Fix: resume with PrioritizedReplay(alpha="
                f"{options[0]:g}, eps={options[1]:g}), as saved."
            )
        if options[2:] != want[2:]:
            raise ReplayCheckpointError(self._lag_message(int(options[2]), state))
        return common, self._slots.parse(state, common)

    def _lag_message(self, lag: int, state: Mapping[str, Any]) -> str:
        """Why a state saved with another worker_count (or worker_buffer_size) is refused."""
        count, buffer = self._workers
        saved: list[int] | None = None
        if "workers" in state:  # older states name only the lag
            saved = np.asarray(state["workers"]).reshape(-1).tolist()
        if saved is not None and len(saved) == 2:
            then = f"worker_count={saved[0]} (worker_buffer_size={saved[1]})"
            fix = f"worker_count={saved[0]} and worker_buffer_size={saved[1]}"
        else:
            then = f"worker_count * worker_buffer_size = {lag + 1}"
            fix = f"worker_count * worker_buffer_size = {lag + 1} (e.g. worker_count={lag + 1}"
            fix += " and worker_buffer_size=1)" if lag else " or worker_count=0)"
        return (
            f"The priority state was saved by a loader with {then}, whose workers read "
            f"{lag} batches ahead; this loader has worker_count={count} (worker_buffer_size="
            f"{buffer}), {self.lag} batches ahead. update_priorities reaches the draws that "
            "many batches late, so the restored draws would not continue the saved run. Fix: "
            f"resume with {fix}, as it was saved."
        )

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raises what :meth:`set_state` would raise, changing nothing."""
        self._parse(state)

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state` (checked against this sampler's settings first)."""
        common, parsed = self._parse(state)
        values = common["values"]
        with self._lock:
            self._slots.restore(parsed, self._length)
            self._tree = SumTree.from_values(values, skip_zeros=self._slots.skip_zeros)
            self._seen = np.unpackbits(common["seen"])[: len(values)].astype(bool)
            self._max = common["max"]
            queued = []
            for stamp, saved, prio in pending_updates(common):
                index, slot, found_at = self._slots.restored(saved)
                queued.append((stamp, index, prio, slot, found_at))
            self._queued = queued
            self._recent.clear()
            self._undo.clear()
            self._length.n = common["n"]
