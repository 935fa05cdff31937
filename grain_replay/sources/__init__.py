"""Random-access grain data sources over array stores: HDF5, ``.npy``, ``.npz``, Zarr and a
bounded many-writer store's parts. Other libraries' datasets are in :mod:`grain_replay.datasets`;
``open_source`` is in :mod:`grain_replay.opening`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grain_replay.lazy import lazy_exports
from grain_replay.sources.base import BatchSource, ReplaySource, SourceSurface

if TYPE_CHECKING:  # loaded on first use: a loader worker imports only the room it reads
    from grain_replay.sources.hdf5 import HDF5DataSource
    from grain_replay.sources.npy import NpyDataSource
    from grain_replay.sources.npz import NpzDataSource
    from grain_replay.sources.parts import ObjectPartsDataSource, PartsDataSource
    from grain_replay.sources.zarr import ZarrDataSource

# Class name -> its room, imported on first use.
_ROOMS = {
    "HDF5DataSource": "grain_replay.sources.hdf5",
    "NpyDataSource": "grain_replay.sources.npy",
    "NpzDataSource": "grain_replay.sources.npz",
    "ObjectPartsDataSource": "grain_replay.sources.parts",
    "PartsDataSource": "grain_replay.sources.parts",
    "ZarrDataSource": "grain_replay.sources.zarr",
}


__getattr__, __dir__ = lazy_exports(__name__, _ROOMS)

__all__ = [
    "BatchSource",
    "ReplaySource",
    "SourceSurface",
    "HDF5DataSource",
    "NpyDataSource",
    "NpzDataSource",
    "ObjectPartsDataSource",
    "PartsDataSource",
    "ZarrDataSource",
]
