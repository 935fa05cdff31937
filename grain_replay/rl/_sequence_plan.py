"""Where a batch of sequences reads: offset groups, anchors, row plans, windowed reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

from grain_replay.layout import LeafSpec
from grain_replay.rl._access import LeafAccess
from grain_replay.rl._derived import Spans
from grain_replay.rl.episodes import EpisodeIndex

__all__ = [
    "MAX_WINDOW",
    "WINDOW_ROW_BYTES",
    "Anchors",
    "OffsetGroup",
    "read_windowed",
    "row_bytes",
    "rows_plan",
]

# Longest run of offsets read as windows (its lookup tables are K x K).
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
        self.before = bool(offsets.min() < 0)  # clip to the episode's first step
        self.after = bool(offsets.max() > 0)  # clip to its last step
        self._tiled = offsets[:0]
        # Consecutive ascending offsets: each anchor's steps are one window of rows.
        self.run = bool(np.all(np.diff(offsets) == 1)) and len(offsets) <= MAX_WINDOW
        self.windowed = False  # set by the view: read as windows (see SequenceDataSource)
        self._tables: tuple[np.ndarray, ...] | None = None

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per window position ``p`` (0..K-1), ``(K, K)`` rows over the window's j:

        ``pad_before[p] = j < p`` and ``at_least[p] = max(j, p)`` (an episode that
        starts at window position p), ``pad_after[p] = j > p`` and ``at_most[p] =
        min(j, p)`` (one that ends there). Read-only, made once.
        """
        tables = self._tables
        if tables is None:
            k = len(self.offsets)
            j = np.arange(k, dtype=np.int64)
            p = j[:, None]
            tables = (j < p, np.maximum(j, p), j > p, np.minimum(j, p))
            for t in tables:
                t.flags.writeable = False
            self._tables = tables  # a race only recomputes it
        return cast(tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tables)

    def tiled(self, b: int) -> np.ndarray:
        """The offsets repeated for ``b`` anchors, ``(b * K,)`` (read-only, kept per size)."""
        tiled = self._tiled
        if len(tiled) != b * len(self.offsets):
            tiled = np.tile(self.offsets, b)
            tiled.flags.writeable = False
            self._tiled = tiled  # a race only recomputes it
        return tiled


class Anchors(Spans):
    """The records (anchor steps) per episode, with the episode bounds a batch clips to."""

    def __init__(self, first: np.ndarray, count: np.ndarray, index: EpisodeIndex):
        super().__init__(first, count)
        self.ends = index.ends
        self.starts = index.starts
        self.lasts = index.ends - 1
        # Every step anchors one record, in order: a record id is its step id.
        self.every_step = self.total == index.num_steps
        self.num_steps = index.num_steps

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


def read_windowed(
    groups: Sequence[OffsetGroup],
    access: LeafAccess,
    spans: Anchors,
    ids: np.ndarray,
    pad: str,
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The leaves and the groups' masks of a batch of a grain_replay source with a
    windowed group (see ``SequenceDataSource._group_plans``).

    A windowed group's anchors read the window of its offsets' steps,
    ``read_windows(key, t + offsets[0], K)`` per leaf, one copy per window
    on a memory-mapped leaf. Only the anchors whose window crosses their
    episode's bounds (or the store's) are fixed up afterwards, in memory:
    each of their positions takes the window's row of its clipped step
    (which lies inside the window, as the offsets hold the anchor), and
    their masks are filled. Other groups read their rows as before.
    """
    episode, t = spans.locate(ids)
    b = len(t)
    n = spans.num_steps
    drop = pad == "drop"
    first = last = None
    got: dict[str, np.ndarray] = {}
    masks = []
    for group in groups:
        k = len(group.offsets)
        if not group.windowed or n < k:
            rows, is_pad = rows_plan(group, t, episode, spans, pad)
            masks.append(is_pad)
            got.update(access.take(dict.fromkeys(group.keys, rows)))
            continue
        off = int(group.offsets[0])
        start = t + off if off else t
        if drop or not (group.before or group.after):
            # Every window lies inside its episode.
            for key in group.keys:
                got[key] = access.take_windows(key, start, k)
            masks.append(np.zeros((b, k), bool))
            continue
        # The window position where the episode starts (clipped to 0) and where it
        # ends (clipped to K-1); an anchor with neither inside its window reads it as is.
        pad_before, at_least, pad_after, at_most = group.tables()
        if group.before:
            if first is None:
                first = spans.starts[episode]
            lo = first - start
            np.maximum(lo, 0, out=lo)
        if group.after:
            if last is None:
                last = spans.lasts[episode]
            hi = last - start
            np.minimum(hi, k - 1, out=hi)
        if group.before and group.after:
            mask = pad_before.take(lo, axis=0)
            mask |= pad_after.take(hi, axis=0)
            near = ((lo > 0) | (hi < k - 1)).nonzero()[0]
        elif group.before:
            mask = pad_before.take(lo, axis=0)
            near = lo.nonzero()[0]
        else:
            mask = pad_after.take(hi, axis=0)
            near = (hi < k - 1).nonzero()[0]
        if not near.size:
            for key in group.keys:
                got[key] = access.take_windows(key, start, k)
            masks.append(mask)
            continue
        # Each position of those anchors reads the window's row of its clipped step.
        if group.before:
            at = at_least.take(lo[near], axis=0)
            if group.after:
                np.minimum(at, hi[near, None], out=at)
        else:
            at = at_most.take(hi[near], axis=0)
        # A window that would leave the store (first or last episode) starts inside it.
        inside = start
        wanted = start[near]
        if np.minimum.reduce(wanted) < 0 or np.maximum.reduce(wanted) > n - k:
            moved = np.maximum(wanted, 0)
            np.minimum(moved, n - k, out=moved)
            inside = start.copy()
            inside[near] = moved
            at += (wanted - moved)[:, None]
        rows = near[:, None]
        for key in group.keys:
            values = access.take_windows(key, inside, k)
            values[near] = values[rows, at]
            got[key] = values
        masks.append(mask)
    return got, masks
