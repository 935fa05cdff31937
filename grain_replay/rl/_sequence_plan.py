"""Where a batch of sequences reads: offset groups, anchors, fix-up codes, row plans."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from grain_replay.rl._derived import Spans
from grain_replay.rl.episodes import EpisodeIndex
from grain_replay.store.layout import LeafSpec

__all__ = [
    "FIX_TABLE_ENTRIES",
    "MAX_WINDOW",
    "NEAR_TABLE_STEPS",
    "WINDOW_ROW_BYTES",
    "Anchors",
    "FixTables",
    "OffsetGroup",
    "fix_entries",
    "offset_groups",
    "row_bytes",
    "rows_plan",
    "tables_fit",
]

# Longest run of offsets read as windows (a window is one item of K rows).
MAX_WINDOW = 256
# Largest row of a leaf read as windows.
WINDOW_ROW_BYTES = 1024


def row_bytes(leaf: LeafSpec) -> int:
    return int(np.dtype(leaf.dtype).itemsize * np.prod(leaf.shape, dtype=np.int64))


class OffsetGroup:
    """One distinct offset list and the leaves that read at it."""

    def __init__(self, offsets: np.ndarray, keys: tuple[str, ...]):
        self.offsets = offsets
        self.keys = keys
        self.first = int(offsets[0])
        self.before = bool(offsets.min() < 0)  # clip to the episode's first step
        self.after = bool(offsets.max() > 0)  # clip to its last step
        self._tiled = offsets[:0]
        # Consecutive ascending offsets: each anchor's steps are one window of rows.
        self.run = bool(np.all(np.diff(offsets) == 1)) and len(offsets) <= MAX_WINDOW
        self.windowed = False  # set by the view: read as windows (see SequenceDataSource)

    def tiled(self, b: int) -> np.ndarray:
        """The offsets repeated for ``b`` anchors, ``(b * K,)`` (read-only, kept per size)."""
        tiled = self._tiled
        if len(tiled) != b * len(self.offsets):
            tiled = np.tile(self.offsets, b)
            tiled.flags.writeable = False
            self._tiled = tiled  # a race only recomputes it
        return tiled


# Largest store whose steps' fix-up codes are kept in a table (1-4 bytes a step).
NEAR_TABLE_STEPS = 1 << 23
# Most entries of the fix-up tables of a view (codes x offsets of its windowed groups); a view
# that would need more reads its offsets as rows instead of windows.
FIX_TABLE_ENTRIES = 1 << 20


def offset_groups(
    offsets: Mapping[str, np.ndarray], spec: Mapping[str, LeafSpec], per_leaf: bool, pad: str
) -> list[OffsetGroup]:
    """The distinct offset lists of a view's leaves (``offsets``, in the output's order), each
    with the leaves that read it (they share one ``(B, K)`` plan per batch), and whether each
    is read as windows (``per_leaf``: a grain_replay step source, read one leaf at a time)."""
    by_list: dict[bytes, tuple[np.ndarray, list[str]]] = {}
    for key, off in offsets.items():
        by_list.setdefault(off.tobytes(), (off, []))[1].append(key)
    groups = [OffsetGroup(off, tuple(keys)) for off, keys in by_list.values()]
    # A run of offsets that holds the anchor (any run when nothing pads) is read as one
    # window of rows per anchor: every step it clips to lies inside that window.
    # Only for rows small enough that copying a window whole beats taking its rows one by
    # one (per-row cost dominates); 7 KiB frames measured no faster as windows.
    for group in groups:
        off = group.offsets
        small = all(row_bytes(spec[key]) <= WINDOW_ROW_BYTES for key in group.keys)
        group.windowed = (
            per_leaf and small and group.run and (pad == "drop" or off[0] <= 0 <= off[-1])
        )
    if pad != "drop" and not tables_fit(groups):
        # Windows reaching far back and ahead: their fix-up tables would be too large.
        for group in groups:
            group.windowed = False
    return groups


def _reach(groups: Sequence[OffsetGroup]) -> tuple[int, int]:
    """``(L, H)``: how far the windowed groups reach back and ahead of the anchor (>= 0)."""
    offsets = np.concatenate([g.offsets for g in groups if g.windowed] or [np.zeros(1, np.int64)])
    return max(-int(offsets.min()), 0), max(int(offsets.max()), 0)


def fix_entries(groups: Sequence[OffsetGroup]) -> int:
    """Entries of the fix-up tables the windowed ``groups`` need (see :class:`FixTables`)."""
    back, ahead = _reach(groups)
    codes = (back + 1) * (ahead + 1) + back + ahead
    return codes * sum(len(g.offsets) for g in groups if g.windowed)


def tables_fit(groups: Sequence[OffsetGroup]) -> bool:
    """Whether the fix-up tables of the windowed ``groups`` are small enough to keep."""
    return fix_entries(groups) <= FIX_TABLE_ENTRIES


class FixTables:
    """Where each windowed group's window needs fixing up, per anchor step, as small codes.

    The windowed groups reach ``L`` steps back and ``H`` ahead of an anchor
    ``t``. With ``back = min(t - first, L)`` and ``ahead = min(last - t, H)``
    (``first``, ``last``: its episode's first and last step), the anchor's
    *code* is ``(L - back) * (H + 1) + (H - ahead)``: 0 when nothing of it
    leaves its episode, and the same for every anchor whose windows clip
    alike. The ``L + H`` steps nearest the store's ends, whose windows may
    also have to start inside the store, get a code each after those. Per
    windowed group and code, ``at`` ``(K,)`` is the row of the window read
    that each offset takes and ``pad`` its mask, so a batch's fix-up is a
    lookup of its anchors' codes: in a table of a code per step (stores up to
    ``NEAR_TABLE_STEPS`` steps), else computed for the anchors one binary
    search over per-episode safe intervals finds.
    """

    def __init__(self, groups: Sequence[OffsetGroup], index: EpisodeIndex):
        back_max, ahead_max = _reach(groups)
        self._back, self._ahead = back_max, ahead_max
        n = self.num_steps = index.num_steps
        width = self._width = ahead_max + 1
        classes = self.first_edge = (back_max + 1) * width
        self.edges = np.union1d(
            np.arange(min(back_max, n)), np.arange(max(n - ahead_max, 0), n)
        ).astype(np.int64)
        total = classes + len(self.edges)
        self.dtype = np.dtype(
            np.uint8 if total <= 1 << 8 else np.uint16 if total <= 1 << 16 else np.uint32
        )
        self._starts, self._ends = index.starts, index.ends
        self._lasts = index.ends - 1
        # How far each code reaches back and ahead: the classes, then the store's end steps.
        code = np.arange(classes)
        episode = index.ends.searchsorted(self.edges, side="right")
        back = np.r_[back_max - code // width, self.edges - index.starts[episode]]
        ahead = np.r_[ahead_max - code % width, self._lasts[episode] - self.edges]
        # Per group: (at, pad, whether a window at the store's ends starts inside it, the
        # smallest code that needs a fix-up). Codes order by reach back first: a group that
        # only reaches back ``b`` steps needs none below code ``(L - b + 1) * (H + 1)``.
        self.tables: list[tuple[np.ndarray, np.ndarray, bool, int] | None] = []
        for group in groups:
            k = len(group.offsets)
            if not group.windowed or n < k:
                self.tables.append(None)
                continue
            off, off0 = group.offsets, group.first
            rel = np.clip(off, -back[:, None], ahead[:, None])
            shift = np.zeros(total, np.int64)
            shift[classes:] = np.clip(self.edges + off0, 0, n - k) - (self.edges + off0)
            at = (rel - off0 - shift[:, None]).astype(np.intp)
            pad = rel != off
            at.flags.writeable = pad.flags.writeable = False
            if group.after:
                need = 1
            elif group.before:
                need = (back_max + off0 + 1) * width
            else:
                need = total  # no code: nothing of it is ever clipped
            self.tables.append((at, pad, bool(shift.any()), need))
        # The anchors that need no fix-up, [starts + L, max(ends - H, that)) per episode, as
        # one sorted list of bounds behind a first one below every step: an anchor is inside
        # one such interval exactly when an even number of bounds lies at or below it.
        safe_from = index.starts + back_max
        safe_to = np.maximum(index.ends - ahead_max, safe_from)
        bounds = np.empty(2 * len(safe_from) + 1, np.int64)
        bounds[0] = np.iinfo(np.int64).min
        bounds[1::2] = safe_from
        bounds[2::2] = safe_to
        self._bounds = bounds
        self.step_codes = self._step_codes() if 0 < n <= NEAR_TABLE_STEPS else None

    def _step_codes(self) -> np.ndarray:
        """Every step's code: per distance from its episode's bounds, one pass over episodes."""
        codes = np.zeros(self.num_steps, self.dtype)
        starts, lasts = self._starts, self._lasts
        for d in range(self._back):  # steps d after their episode's first step
            at = starts + d
            at = at[at <= lasts]
            codes[at] += (self._back - d) * self._width
        for d in range(self._ahead):  # steps d before their episode's last step
            at = lasts - d
            at = at[at >= starts]
            codes[at] += self._ahead - d
        codes[self.edges] = self.first_edge + np.arange(len(self.edges))
        codes.flags.writeable = False
        return codes

    def codes(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(codes, near)``: the code of each anchor step in ``t`` and the positions of the
        nonzero ones (the anchors whose windows need fixing up)."""
        table = self.step_codes
        if table is not None:
            codes = table.take(t)
            return codes, codes.nonzero()[0]
        near = (self._bounds.searchsorted(t, side="right") & 1).nonzero()[0]
        codes = np.zeros(len(t), self.dtype)
        if near.size:
            tn = t[near]
            episode = self._ends.searchsorted(tn, side="right")
            back = np.minimum(tn - self._starts[episode], self._back)
            ahead = np.minimum(self._lasts[episode] - tn, self._ahead)
            c = (self._back - back) * self._width + (self._ahead - ahead)
            edge = (tn < self._back) | (tn >= self.num_steps - self._ahead)
            if edge.any():
                c[edge] = self.first_edge + self.edges.searchsorted(tn[edge])
            codes[near] = c
        return codes, near


class Anchors(Spans):
    """The records (anchor steps) per episode, with the episode bounds a batch clips to.

    ``fix``: the view's fix-up tables of its windowed reads, None when it reads no
    windows or pads nothing.
    """

    def __init__(
        self,
        first: np.ndarray,
        count: np.ndarray,
        index: EpisodeIndex,
        fix: FixTables | None = None,
    ):
        super().__init__(first, count)
        self.ends = index.ends
        self.starts = index.starts
        self.lasts = index.ends - 1
        # Every step anchors one record, in order: a record id is its step id.
        self.every_step = self.total == index.num_steps
        self.num_steps = index.num_steps
        self.fix = fix

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(episode, anchor step)`` of each record id (ids in range)."""
        # Unsorted needles: sorting a batch of 256 first (so that each search narrows from
        # the last) cost more than it saved, from 73 to 730,000 episodes (numpy 2.4).
        bounds = self.ends if self.every_step else self.cum_end
        episode = bounds.searchsorted(ids, side="right")
        if self.every_step:
            return episode, ids
        k = ids - (self.cum_end[episode] - self.count[episode])
        return episode, self.first[episode] + k


def rows_plan(
    group: OffsetGroup, t: np.ndarray, episode: np.ndarray, spans: Anchors, pad: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, is_pad)`` of one group at anchor steps ``t`` (of episodes ``episode``),
    both ``(B, K)``; ``SequenceDataSource._group_plans`` says how they are built."""
    b, k = len(t), len(group.offsets)
    pos = np.repeat(t, k)
    pos += group.tiled(b)
    if pad == "drop":
        return pos.reshape(b, k), np.zeros((b, k), bool)
    rows = pos
    if group.before:
        rows = np.maximum(pos, np.repeat(spans.starts[episode], k))
    if group.after:
        rows = np.minimum(
            rows, np.repeat(spans.lasts[episode], k), out=None if rows is pos else rows
        )
    return rows.reshape(b, k), (rows != pos).reshape(b, k)
