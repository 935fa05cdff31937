"""Windowed reads of a batch of sequences: per-step fix-up codes, their tables, the read."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from grain_replay.rl._access import LeafAccess
from grain_replay.rl._sequence_plan import Anchors, OffsetGroup, rows_plan
from grain_replay.rl.episodes import EpisodeIndex

__all__ = [
    "FIX_TABLE_ENTRIES",
    "NEAR_TABLE_STEPS",
    "FixTables",
    "fix_entries",
    "read_windowed",
    "tables_fit",
]

# Largest store whose steps' fix-up codes are kept in a table (1-4 bytes a step).
NEAR_TABLE_STEPS = 1 << 23
# Most entries of the fix-up tables of a view (codes x offsets of its windowed groups); a view
# that would need more reads its offsets as rows instead of windows.
FIX_TABLE_ENTRIES = 1 << 20


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


def read_windowed(
    groups: Sequence[OffsetGroup],
    access: LeafAccess,
    spans: Anchors,
    ids: np.ndarray,
    pad: str,
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The leaves and the groups' masks of a batch of a grain_replay source with a
    windowed group (see ``SequenceDataSource._group_plans``).

    A windowed group's anchors read the window of its offsets' steps, from
    ``t + offsets[0]``, ``K`` rows: every windowed leaf of the batch in one
    ``read_windows_flat`` (one copy per window on a memory-mapped leaf). The
    anchors' codes (:class:`FixTables`, one lookup) give each group's mask,
    and the few anchors whose offsets reach past their episode (about 6% at
    16 offsets and episodes of 50-500 steps) are fixed up afterwards, in
    memory: each of their positions takes the window's row of its clipped
    step (which lies inside the window, as the offsets hold the anchor). A
    window that would leave the store (first or last episode) starts inside
    it. Other groups read their rows as before.
    """
    episode, t = (None, ids) if spans.every_step else spans.locate(ids)
    b, n = len(t), spans.num_steps
    fix = spans.fix if pad != "drop" else None
    near = None
    if fix is not None:
        codes, near = fix.codes(t)
        if near.size:
            code = codes[near]
            picked = near[:, None]
            top = int(code.max())
            at_edge = bool(fix.edges.size) and top >= fix.first_edge
        else:
            near = None
    windows: dict[str, tuple[np.ndarray, int]] = {}
    # Per group: (its (B, K) rows and mask) or, windowed, (its (B,) window starts and mask),
    # and the rows of the window read that its near anchors take.
    plans: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
    for g, group in enumerate(groups):
        k = len(group.offsets)
        if not group.windowed or n < k:
            if episode is None:
                episode = spans.ends.searchsorted(t, side="right")
            plans.append((*rows_plan(group, t, episode, spans, pad), None))
            continue
        off = group.first
        start = t + off if off else t
        tables = None if fix is None else fix.tables[g]
        at = None
        if tables is None:
            mask = np.zeros((b, k), bool)
        else:
            # take: about 4x faster than fancy indexing for these (B, K) rows.
            mask = tables[1].take(codes, axis=0)
            if near is not None:
                if top >= tables[3]:
                    at = tables[0].take(code, axis=0)
                if at_edge and tables[2]:
                    start = start.copy() if start is t else start
                    np.clip(start, 0, n - k, out=start)
        plans.append((start, mask, at))
        for key in group.keys:
            windows[key] = (start, k)
    got = access.take_windows_flat(windows)
    masks = []
    for group, (rows, mask, at) in zip(groups, plans):
        masks.append(mask)
        if rows.ndim == 2:
            got.update(access.take(dict.fromkeys(group.keys, rows)))
        elif at is not None:
            for key in group.keys:
                values = got[key]
                values[near] = values[picked, at]
    return got, masks
