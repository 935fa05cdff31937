"""Where a batch of sequences reads: offset groups, anchors, row plans."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from grain_replay.layout import LeafSpec
from grain_replay.rl._derived import Spans
from grain_replay.rl.episodes import EpisodeIndex

if TYPE_CHECKING:
    from grain_replay.rl._sequence_windows import FixTables

__all__ = [
    "MAX_WINDOW",
    "WINDOW_ROW_BYTES",
    "Anchors",
    "OffsetGroup",
    "row_bytes",
    "rows_plan",
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
