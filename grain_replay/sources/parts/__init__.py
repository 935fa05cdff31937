"""The many-writer reader: the union of a bounded store's live rows, one snapshot per refresh."""

from __future__ import annotations

from grain_replay.sources.parts.objects import ObjectPartsDataSource
from grain_replay.sources.parts.source import PartsDataSource

__all__ = ["ObjectPartsDataSource", "PartsDataSource"]
