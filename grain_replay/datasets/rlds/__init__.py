"""RLDS datasets (TFDS-built TFRecord shards of episodes) read without TensorFlow."""

from __future__ import annotations

from grain_replay.datasets.rlds.source import RLDSDataSource

__all__ = ["RLDSDataSource"]
