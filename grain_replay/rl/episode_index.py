"""Where each episode of a step store starts and ends: ``EpisodeIndex``, vectorized lookups.

Built from a store's flags (and cached beside it) by ``rl/episodes.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from grain_replay.errors import InvalidArgumentError, RecordIndexError

__all__ = ["EpisodeIndex"]


@dataclasses.dataclass(frozen=True, eq=False)
class EpisodeIndex:
    """Where each episode of a step store starts and ends.

    Episodes are contiguous runs of steps. Episode ``e`` holds steps
    ``[starts[e], ends[e])``. Lookups are vectorized over arrays of steps or
    episodes; finding the episode of a step is a binary search over the
    episode ends (O(log E) per step, memory O(E), independent of the number of
    steps).

    Attributes:
      ends: ``(E,)`` int64, exclusive end of each episode, increasing; the last
        one is the number of steps.
      terminated: ``(E,)`` bool, True where the episode ended by termination
        (no bootstrapping past its last step); False where it was truncated
        (time limit) or is unfinished.
      open_last: the last episode has no end flag: the store stopped (or is
        still growing) in the middle of it.

    Examples:
      >>> idx = EpisodeIndex.from_flags(np.array([0, 0, 1, 0, 1], bool))
      >>> idx.episode_of(np.array([0, 3])), idx.starts, idx.ends
      (array([0, 1]), array([0, 3]), array([3, 5]))
    """

    ends: np.ndarray
    terminated: np.ndarray
    open_last: bool = False

    def __post_init__(self) -> None:
        ends = np.asarray(self.ends, dtype=np.int64).reshape(-1)
        term = np.asarray(self.terminated, dtype=bool).reshape(-1)
        if ends.shape != term.shape:
            raise InvalidArgumentError(
                f"ends and terminated must have one entry per episode, got {ends.shape} "
                f"and {term.shape}"
            )
        if ends.size and (ends[0] <= 0 or np.any(np.diff(ends) <= 0)):
            raise InvalidArgumentError(
                "ends must be positive and strictly increasing (no empty episode)"
            )
        object.__setattr__(self, "ends", ends)
        object.__setattr__(self, "terminated", term)

    @classmethod
    def from_flags(cls, done: np.ndarray, terminated: np.ndarray | None = None) -> EpisodeIndex:
        """Index from per-step flags.

        Args:
          done: ``(N,)`` flags, True on the last step of each episode.
          terminated: ``(N,)`` flags, True where an episode ended by termination;
            default ``done`` (every end is a termination).

        Returns:
          The index; steps after the last flag form an open last episode.
        """
        done = np.asarray(done).reshape(-1) != 0
        term = done if terminated is None else np.asarray(terminated).reshape(-1) != 0
        ends = np.flatnonzero(done) + 1
        return cls.from_ends(ends, term[ends - 1], len(done))

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int] | np.ndarray,
        terminated: Sequence[bool] | np.ndarray,
        open_last: bool = False,
    ) -> EpisodeIndex:
        """Index from per-episode lengths (all positive) and termination flags."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        return cls(np.cumsum(lengths), np.asarray(terminated, dtype=bool), open_last)

    @classmethod
    def from_ends(cls, ends: np.ndarray, term: np.ndarray, n: int) -> EpisodeIndex:
        """Index of ``n`` steps from the exclusive ends of the finished episodes and their
        termination flags; steps after the last end form an open last episode."""
        ends = np.asarray(ends, dtype=np.int64)
        open_last = bool(n > 0 and (ends.size == 0 or ends[-1] != n))
        if open_last:
            ends = np.append(ends, n)
            term = np.append(term, False)
        return cls(ends, term, open_last)

    @property
    def num_steps(self) -> int:
        return int(self.ends[-1]) if self.ends.size else 0

    @property
    def num_episodes(self) -> int:
        return int(self.ends.size)

    def __len__(self) -> int:
        return self.num_episodes

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """``(E,)`` int64, first step of each episode."""
        return np.concatenate([[0], self.ends[:-1]]).astype(np.int64)

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """``(E,)`` int64, steps of each episode."""
        return self.ends - self.starts

    def episode_of(self, steps: Sequence[int] | np.ndarray) -> np.ndarray:
        """Episode id of each step (vectorized).

        Raises:
          RecordIndexError: a step is outside ``[0, num_steps)``.
        """
        steps = np.asarray(steps, dtype=np.int64)
        n = self.num_steps
        bad = (steps < 0) | (steps >= n)
        if bad.any():
            raise RecordIndexError(
                f"step {int(steps[bad].reshape(-1)[0])} is out of range for an episode index of "
                f"{n} steps (valid: 0 <= step < {n})."
            )
        return np.searchsorted(self.ends, steps, side="right")

    def __repr__(self) -> str:
        return (
            f"EpisodeIndex(num_episodes={self.num_episodes}, num_steps={self.num_steps}, "
            f"open_last={self.open_last})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EpisodeIndex):
            return NotImplemented
        return (
            self.open_last == other.open_last
            and np.array_equal(self.ends, other.ends)
            and np.array_equal(self.terminated, other.terminated)
        )

    __hash__ = None  # type: ignore[assignment]
