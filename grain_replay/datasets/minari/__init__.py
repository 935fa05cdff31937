"""Minari datasets (HDF5 or Arrow episodes), read as they are."""

from __future__ import annotations

from grain_replay.datasets.minari.source import MinariDataSource

__all__ = ["MinariDataSource"]
