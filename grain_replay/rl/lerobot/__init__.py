"""LeRobot datasets (v3.0, v2.1) read in place: parquet columns and PyAV-decoded camera frames."""

from __future__ import annotations

from grain_replay.errors import FrameTimestampError
from grain_replay.rl.lerobot.meta import LeRobotMeta, read_meta
from grain_replay.rl.lerobot.source import LeRobotDataSource

__all__ = ["LeRobotDataSource", "FrameTimestampError", "LeRobotMeta", "read_meta"]
