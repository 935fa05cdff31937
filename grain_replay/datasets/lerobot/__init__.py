"""LeRobot datasets (v3.0, v2.1) read in place: parquet columns and PyAV-decoded camera frames."""

from __future__ import annotations

from grain_replay.datasets.lerobot.meta import LeRobotMeta, read_meta
from grain_replay.datasets.lerobot.source import LeRobotDataSource
from grain_replay.errors import FrameTimestampError

__all__ = ["LeRobotDataSource", "FrameTimestampError", "LeRobotMeta", "read_meta"]
