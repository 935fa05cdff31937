"""The state of a :class:`~grain_replay.DeviceReplay` (a pytree of arrays) and its ring's
bookkeeping on the host (which slot takes which new row at a refresh)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grain_replay.device.replay_tree import level_lines
from grain_replay.errors import ArgumentTypeError, InvalidArgumentError, InvalidStoreError
from grain_replay.store import parts as parts_lib

__all__ = [
    "DeviceReplayState",
    "Ring",
    "StateLayout",
    "StateView",
    "check_state",
    "join_ids",
    "news",
    "split_ids32",
]

LANES = 128  # a line of the state's arrays
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
    """Everything a :class:`~grain_replay.DeviceReplay` holds on the device; one pytree of
    few arrays: a jitted step that takes and returns it pays the host a fixed cost for
    each (~8-12 us on a TPU v5e host, where the MLP step's whole dispatch is ~0.25 ms).

    ``C`` is the ring's capacity (slots), ``L = ceil(C / 128)`` its lines, ``W`` the
    writers it keeps a watermark for. Saved and restored as one Orbax item
    (``ocp.args.StandardSave(state)``). Read its parts by name with
    ``DeviceReplay.view(state)`` (a :class:`StateView`; where each lies:
    :class:`StateLayout`).

    Attributes:
      rows: the row buffers: the leaves' 32-bit words in 128-lane lines, one buffer per
        layout and width (see ``device/lines.py``).
      book: int32 lines: the ring's bookkeeping (each slot's row id, the refresh that
        filled it, whether it is live; the live slots' table; each writer's watermark;
        the counters), written by the host at each refresh.
      mass: float32 lines: the priorities, the largest priority given so far, and (for a
        prioritized replay) every level of the sum and min trees, written inside jit by
        ``update_priorities``.
    """

    rows: tuple[jax.Array, ...]
    book: jax.Array
    mass: jax.Array


class StateView(NamedTuple):
    """A :class:`DeviceReplayState`'s parts by name (slices of its arrays; on the host, or
    traced inside jit).

    Attributes:
      slot_hi: int32[C]: the row id held by each slot, high bits (``id >> 31``); -1: empty.
      slot_lo: int32[C]: its low 31 bits. A row id is the store position for a plain or
        growing store, ``ordinal << 40 | seq`` for a bounded many-writer store.
      order: int32[C]: the refresh that filled (or emptied) each slot; -1: never used.
      live: bool[C]: the slot holds a live row (the only slots a draw can return).
      live_slots: int32[L, 128]: the live slots, first ``n_live`` entries (uniform draws).
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

    slot_hi: Any
    slot_lo: Any
    order: Any
    live: Any
    live_slots: Any
    n_live: Any
    priority: Any
    max_priority: Any
    sums: tuple[Any, ...]
    mins: tuple[Any, ...]
    mark_hi: Any
    mark_lo: Any
    refreshes: Any


_PER_SLOT = ("slot_hi", "slot_lo", "order", "live", "live_slots")  # book: L lines each
_PER_WRITER = ("mark_hi", "mark_lo")  # book: ceil(W / 128) lines each
_COUNTERS = ("n_live", "refreshes")  # book's last line, lanes 0 and 1


class StateLayout:
    """Where each part of a :class:`DeviceReplayState` lies in its ``book`` and ``mass``
    lines (static: from the capacity, the writers and whether the replay is prioritized).

    ``book`` (int32): ``slot_hi``, ``slot_lo``, ``order``, ``live`` (0/1) and
    ``live_slots``, ``L`` lines each; ``mark_hi`` and ``mark_lo``, ``ceil(W / 128)`` lines
    each; one line of counters (``n_live``, ``refreshes``). ``mass`` (float32):
    ``priority`` (``L`` lines), one line whose lane 0 is ``max_priority``, then the sum
    tree's levels (level 0 first) and the min tree's (level 1 first). Per-slot parts are
    padded to whole lines (empty slots, priority 0) and read back cut to ``C``.
    """

    def __init__(self, capacity: int, writers: int, prioritized: bool) -> None:
        self.capacity, self.writers = capacity, writers
        self.lines = -(-capacity // LANES)
        self.writer_lines = -(-writers // LANES)
        at = 0
        self.book_at: dict[str, int] = {}
        for name in _PER_SLOT:
            self.book_at[name], at = at, at + self.lines
        for name in _PER_WRITER:
            self.book_at[name], at = at, at + self.writer_lines
        self.counters_at = at
        levels = level_lines(capacity) if prioritized else []
        at = self.lines + 1  # priority, then the max_priority line
        self.sums_at: list[tuple[int, int]] = []
        for n in levels:
            self.sums_at.append((at, n))
            at += n
        self.mins_at: list[tuple[int, int]] = []
        for n in levels[1:]:
            self.mins_at.append((at, n))
            at += n

    # -- reading -----------------------------------------------------------------------

    def view(self, state: DeviceReplayState) -> StateView:
        """``state``'s parts by name (slices; jax arrays, traced inside jit)."""
        m = state.mass
        return StateView(
            **self.book_parts(state.book),
            live_slots=self._slot_part(state.book, "live_slots"),
            priority=self.priority(m),
            max_priority=m[self.lines, 0],
            sums=self.sums(m),
            mins=self.mins(m),
        )

    def _slot_part(self, book: Any, name: str) -> Any:
        at = self.book_at[name]
        lines = book[at : at + self.lines]
        if name == "live_slots":
            return lines
        flat = lines.reshape(-1)[: self.capacity]
        return flat != 0 if name == "live" else flat

    def _writer_part(self, book: Any, name: str) -> Any:
        at = self.book_at[name]
        return book[at : at + self.writer_lines].reshape(-1)[: self.writers]

    def book_parts(self, book: Any) -> dict[str, Any]:
        """``book``'s bookkeeping by name (numpy on the host, jax traced), but the
        ``live_slots`` table."""
        parts = {k: self._slot_part(book, k) for k in _PER_SLOT if k != "live_slots"}
        parts.update({k: self._writer_part(book, k) for k in _PER_WRITER})
        parts.update({k: book[self.counters_at, i] for i, k in enumerate(_COUNTERS)})
        return parts

    def priority(self, mass: Any) -> Any:
        return mass[: self.lines].reshape(-1)[: self.capacity]

    def sums(self, mass: Any) -> tuple[Any, ...]:
        return tuple(mass[a : a + n] for a, n in self.sums_at)

    def mins(self, mass: Any) -> tuple[Any, ...]:
        return tuple(mass[a : a + n] for a, n in self.mins_at)

    # -- writing -----------------------------------------------------------------------

    def book(self, xp: Any, parts: dict[str, Any]) -> Any:
        """The ``book`` lines of ``parts`` (every name of ``_PER_SLOT``, ``_PER_WRITER``
        and ``_COUNTERS``; per-slot and per-writer ones flat, ``live_slots`` as lines);
        ``xp``: numpy on the host, ``jax.numpy`` traced."""

        def lines(x: Any, n: int, fill: int) -> Any:
            x = xp.asarray(x).astype(xp.int32).reshape(-1)
            pad = xp.full(n * LANES - x.shape[0], fill, xp.int32)
            return xp.concatenate([x, pad]).reshape(n, LANES)

        fills = {"slot_hi": -1, "order": -1}
        out = [lines(parts[k], self.lines, fills.get(k, 0)) for k in _PER_SLOT]
        out += [lines(parts[k], self.writer_lines, 0) for k in _PER_WRITER]
        out.append(lines(xp.stack([xp.asarray(parts[k]) for k in _COUNTERS]), 1, 0))
        return xp.concatenate(out)

    def mass(self, priority: Any, max_priority: Any, sums: Any, mins: Any) -> jax.Array:
        """Traced: the ``mass`` lines of these parts (``priority`` float32[C])."""
        pad = self.lines * LANES - self.capacity
        parts = [
            jnp.pad(priority.astype(jnp.float32), (0, pad)).reshape(self.lines, LANES),
            jnp.zeros((1, LANES), jnp.float32).at[0, 0].set(max_priority),
            *sums,
            *mins,
        ]
        return jnp.concatenate(parts)


def check_state(state: Any, expected: Any, call: str, what: str) -> None:
    """Refuses what is not a state like ``expected`` (the arrays' shapes and dtypes, so
    it works on tracers); ``call`` and ``what`` (the replay) name it in the error.

    Raises:
      ArgumentTypeError: not a :class:`DeviceReplayState`.
      InvalidArgumentError: its arrays differ from ``expected``'s.
    """
    if not isinstance(state, DeviceReplayState):
        raise ArgumentTypeError(
            f"{call}: expected the state DeviceReplay.init() returned, got "
            f"{type(state).__name__}. Fix: pass replay.init()'s state (or its restore)."
        )
    got = [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(state)]
    want = [(tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(expected)]
    if got != want:
        raise InvalidArgumentError(
            f"{call}: the state is not one of this replay ({what}): its arrays are {got}, "
            f"this replay's are {want}. Fix: pass the state this DeviceReplay's init() made, "
            "or build the DeviceReplay with the store and capacity the state was made with."
        )


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
    def of(cls, state: DeviceReplayState, at: StateLayout) -> Ring:
        """The bookkeeping of ``state`` (laid out as ``at`` says), fetched from the device
        (one transfer)."""
        p = at.book_parts(np.asarray(jax.device_get(state.book)))
        return cls(
            join_ids(p["slot_hi"], p["slot_lo"]),
            np.array(p["order"], np.int32),
            np.array(p["live"], bool),
            join_ids(p["mark_hi"], p["mark_lo"]),
            int(p["refreshes"]),
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

    def book(self, at: StateLayout) -> np.ndarray:
        """The bookkeeping as the state's ``book`` lines (after a refresh: ``refreshes + 1``)."""
        hi, lo = split_ids32(self.ids)
        mhi, mlo = split_ids32(self.marks)
        held = np.flatnonzero(self.live).astype(np.int32)
        parts = {
            "slot_hi": hi,
            "slot_lo": lo,
            "order": self.order,
            "live": self.live,
            "live_slots": held,
            "n_live": np.int32(len(held)),
            "mark_hi": mhi,
            "mark_lo": mlo,
            "refreshes": np.int32(self.refreshes + 1),
        }
        return at.book(np, parts)


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
