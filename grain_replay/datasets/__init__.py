"""Other libraries' datasets and buffers, read as they are (read-only): RLDS, torchrl, flashbax
Vaults, LeRobot, Minari and D4RL. Each room may build on the views of :mod:`grain_replay.rl`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grain_replay.lazy import lazy_exports

if TYPE_CHECKING:  # loaded on first use: a loader worker imports only the room it reads
    from grain_replay.datasets.d4rl import D4RLDataSource
    from grain_replay.datasets.lerobot import LeRobotDataSource
    from grain_replay.datasets.minari import MinariDataSource
    from grain_replay.datasets.rlds import RLDSDataSource
    from grain_replay.datasets.torchrl import TorchRLDataSource
    from grain_replay.datasets.vault import VaultDataSource

_ROOMS = {
    "D4RLDataSource": "grain_replay.datasets.d4rl",
    "LeRobotDataSource": "grain_replay.datasets.lerobot",
    "MinariDataSource": "grain_replay.datasets.minari",
    "RLDSDataSource": "grain_replay.datasets.rlds",
    "TorchRLDataSource": "grain_replay.datasets.torchrl",
    "VaultDataSource": "grain_replay.datasets.vault",
}


__getattr__, __dir__ = lazy_exports(__name__, _ROOMS)

__all__ = [
    "D4RLDataSource",
    "LeRobotDataSource",
    "MinariDataSource",
    "RLDSDataSource",
    "TorchRLDataSource",
    "VaultDataSource",
]
