"""RL views: episodes, windows, sequences, n-step transitions, Minari, D4RL, LeRobot datasets."""

from __future__ import annotations

from grain_replay.rl.d4rl import D4RLDataSource
from grain_replay.rl.episodes import (
    EpisodeFlags,
    EpisodeIndex,
    build_episode_index,
    episode_cache_path,
)
from grain_replay.rl.lerobot import LeRobotDataSource
from grain_replay.rl.minari import MinariDataSource
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
    "D4RLDataSource",
    "MinariDataSource",
    "LeRobotDataSource",
]
