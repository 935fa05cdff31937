"""Other libraries' datasets and buffers, read as they are (read-only): RLDS, torchrl, flashbax
Vaults, LeRobot, Minari and D4RL. Each room may build on the views of :mod:`grain_replay.rl`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name not in _ROOMS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_ROOMS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ROOMS))


__all__ = [
    "D4RLDataSource",
    "LeRobotDataSource",
    "MinariDataSource",
    "RLDSDataSource",
    "TorchRLDataSource",
    "VaultDataSource",
]
