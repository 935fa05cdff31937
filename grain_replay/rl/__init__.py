"""RL views over any step source: episodes, windows, sequences, n-step transitions."""

from __future__ import annotations

from grain_replay.rl.episodes import (
    EpisodeFlags,
    EpisodeIndex,
    build_episode_index,
    episode_cache_path,
)
from grain_replay.rl.sequence import SequenceDataSource
from grain_replay.rl.transitions import NStepDataSource, NStepOptions, TransitionDataSource
from grain_replay.rl.windows import WindowDataSource, WindowOptions

__all__ = [
    "EpisodeIndex",
    "EpisodeFlags",
    "build_episode_index",
    "episode_cache_path",
    "WindowDataSource",
    "WindowOptions",
    "SequenceDataSource",
    "NStepDataSource",
    "NStepOptions",
    "TransitionDataSource",
]
