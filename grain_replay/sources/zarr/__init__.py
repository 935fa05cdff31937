"""Zarr v3 stores: the source, checks of local files, local chunk decoding, remote groups."""

from __future__ import annotations

from grain_replay.sources.zarr.source import ZarrDataSource

__all__ = ["ZarrDataSource"]
