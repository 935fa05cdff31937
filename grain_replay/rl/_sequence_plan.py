"""Where a batch of sequences reads: offset groups, anchors, row plans, windowed reads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from grain_replay.layout import LeafSpec
from grain_replay.rl._access import LeafAccess
from grain_replay.rl._derived import Spans
from grain_replay.rl.episodes import EpisodeIndex

__all__ = [
    "MAX_WINDOW",
    "NEAR_TABLE_STEPS",
    "WINDOW_ROW_BYTES",
    "Anchors",
    "OffsetGroup",
    "read_windowed",
    "row_bytes",
    "rows_plan",
]

# Longest run of offsets read as windows (a window is one item of K rows).
MAX_WINDOW = 256
# Largest row of a leaf read as windows.
WINDOW_ROW_BYTES = 1024
# Largest store whose anchors near an episode's bounds are found in a table of a byte a step.
NEAR_TABLE_STEPS = 1 << 23


def row_bytes(leaf: LeafSpec) -> int:
    return int(np.dtype(leaf.dtype).itemsize * np.prod(leaf.shape, dtype=np.int64))


class OffsetGroup:
    """One distinct offset list and the leaves that read at it."""

    def __init__(self, offsets: np.ndarray, keys: tuple[str, ...]):
        self.offsets = offsets
        self.keys = keys
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


class Anchors(Spans):
    """The records (anchor steps) per episode, with the episode bounds a batch clips to.

    ``lo <= 0 <= hi`` are the smallest and largest offset the view reads: an
    anchor ``t`` of episode ``e`` with ``starts[e] <= t + lo`` and ``t + hi <
    ends[e]`` reads only steps of its episode (and of the store), so nothing of
    it needs clipping. :meth:`near` finds the others.
    """

    def __init__(
        self, first: np.ndarray, count: np.ndarray, index: EpisodeIndex, lo: int = 0, hi: int = 0
    ):
        super().__init__(first, count)
        self.ends = index.ends
        self.starts = index.starts
        self.lasts = index.ends - 1
        # Every step anchors one record, in order: a record id is its step id.
        self.every_step = self.total == index.num_steps
        self.num_steps = index.num_steps
        # Per episode the anchors that need no clipping, [starts - lo, max(ends - hi, that)),
        # as one sorted list of bounds behind a first one below every step: an anchor is
        # inside one such interval exactly when an even number of bounds lies at or below it.
        # (Those intervals ascend: the next one starts at ends - lo >= both of its ends.)
        safe_from = self.starts - lo
        safe_to = np.maximum(self.ends - hi, safe_from)
        bounds = np.empty(2 * len(safe_from) + 1, np.int64)
        bounds[0] = np.iinfo(np.int64).min
        bounds[1::2] = safe_from
        bounds[2::2] = safe_to
        bounds.flags.writeable = False
        self.bounds = bounds
        # Up to NEAR_TABLE_STEPS steps, one byte per step answers it instead: a take of the
        # batch's steps, where the binary search cost 3-5x more (random needles).
        self.near_steps: np.ndarray | None = None
        n = self.num_steps
        if 0 < n <= NEAR_TABLE_STEPS:
            edges = np.zeros(n + 1, np.int32)
            np.add.at(edges, np.minimum(safe_from, n), 1)
            np.add.at(edges, np.minimum(safe_to, n), -1)
            near = np.cumsum(edges[:n]) == 0
            near.flags.writeable = False
            self.near_steps = near

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

    def near(self, t: np.ndarray) -> np.ndarray:
        """Positions in ``t`` (anchor steps) of the anchors whose offsets reach past their
        episode's first or last step: one binary search for the batch."""
        table = self.near_steps
        if table is not None:
            return table.take(t).nonzero()[0]
        return (self.bounds.searchsorted(t, side="right") & 1).nonzero()[0]


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
    ``read_windows_flat`` (one copy per window on a memory-mapped leaf). One
    lookup (:meth:`Anchors.near`) finds the few anchors whose offsets reach past their
    episode (about 6% at 16 offsets and episodes of 50-500 steps); only
    those are fixed up afterwards, in memory: each of their positions takes
    the window's row of its clipped step (which lies inside the window, as the
    offsets hold the anchor), and their mask rows are filled. A window that
    would leave the store (first or last episode) starts inside it. Other
    groups read their rows as before.
    """
    every_step = spans.every_step
    episode, t = (None, ids) if every_step else spans.locate(ids)
    b = len(t)
    n = spans.num_steps
    near = spans.near(t) if pad != "drop" else t[:0]
    fix = near.size > 0
    if fix:
        t_near = t[near]
        e_near = spans.ends.searchsorted(t_near, side="right") if episode is None else episode[near]
        first, last = spans.starts[e_near], spans.lasts[e_near]
        t_lo, t_hi = int(t_near.min()), int(t_near.max())
    windows: dict[str, tuple[np.ndarray, int]] = {}
    # Per group: (its (B, K) rows and mask) or, windowed, (its (B,) window starts and mask).
    plans: list[tuple[np.ndarray, np.ndarray]] = []
    for group in groups:
        k = len(group.offsets)
        if not group.windowed or n < k:
            if episode is None:
                episode = spans.ends.searchsorted(t, side="right")
            plans.append(rows_plan(group, t, episode, spans, pad))
            continue
        off = int(group.offsets[0])
        start = t + off if off else t
        # A near anchor's window may leave the store: it starts inside, fixed up below.
        if fix and (t_lo + off < 0 or t_hi + off > n - k):
            start = start.copy() if start is t else start
            np.clip(start, 0, n - k, out=start)
        plans.append((start, np.zeros((b, k), bool)))
        for key in group.keys:
            windows[key] = (start, k)
    got = access.take_windows_flat(windows)
    masks = []
    for group, (rows, is_pad) in zip(groups, plans):
        masks.append(is_pad)
        if rows.ndim == 2:
            got.update(access.take(dict.fromkeys(group.keys, rows)))
            continue
        if not fix or not (group.before or group.after):
            continue
        # Per near anchor and offset: its step clipped to the episode, where it lies in
        # the window read, and whether it is padding.
        want = t_near[:, None] + group.offsets
        steps = np.maximum(want, first[:, None]) if group.before else want
        if group.after:
            steps = np.minimum(steps, last[:, None], out=None if steps is want else steps)
        is_pad[near] = steps != want
        at = steps - rows[near][:, None]
        picked = near[:, None]
        for key in group.keys:
            values = got[key]
            values[near] = values[picked, at]
    return got, masks
