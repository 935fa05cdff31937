"""Random-access grain data sources over HDF5, ``.npy`` and Zarr stores."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from grain_replay.formats import detect_format
from grain_replay.parts import is_parts_store
from grain_replay.sources.base import BatchSource, ReplaySource, SourceSurface
from grain_replay.sources.hdf5 import HDF5DataSource
from grain_replay.sources.npy import NpyDataSource
from grain_replay.sources.npz import NpzDataSource
from grain_replay.sources.parts import PartsDataSource
from grain_replay.sources.rlds import RLDSDataSource
from grain_replay.sources.torchrl import TorchRLDataSource
from grain_replay.sources.vault import VaultDataSource
from grain_replay.sources.zarr import ZarrDataSource

__all__ = [
    "BatchSource",
    "ReplaySource",
    "SourceSurface",
    "HDF5DataSource",
    "NpyDataSource",
    "RLDSDataSource",
    "NpzDataSource",
    "PartsDataSource",
    "TorchRLDataSource",
    "VaultDataSource",
    "ZarrDataSource",
    "detect_format",
    "open_source",
]


def open_source(
    path: str | os.PathLike[str],
    keys: Sequence[str] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> ReplaySource:
    """Opens ``path`` with the source class its contents call for.

    Args:
      path: an HDF5 file, a ``.npy`` file or directory, a Zarr group, a TFDS-built
        RLDS dataset folder, an ``.npz`` archive, a torchrl buffer dump, a flashbax
        Vault, or an URL ending in ``.zarr`` / ``.h5``.
      keys: leaves (or groups) to read; default all.
      storage_options: fsspec options for URLs.
      **kwargs: passed to the source class (e.g. ``cache_bytes``).

    A bounded, many-writer store (``ReplayWriter(path, capacity=..., writer_id=...)``)
    opens as a :class:`PartsDataSource`: the union of every writer's live rows.

    Raises:
      StoreNotFoundError: nothing is at ``path``.
      InvalidStoreError: the format cannot be recognized.
    """
    if is_parts_store(os.fspath(path)):
        return PartsDataSource(path, keys, **kwargs)  # type: ignore[return-value]
    classes: dict[str, type[ReplaySource]] = {
        "hdf5": HDF5DataSource,
        "npy": NpyDataSource,
        "npz": NpzDataSource,
        "torchrl": TorchRLDataSource,
        "vault": VaultDataSource,
        "zarr": ZarrDataSource,
        "rlds": RLDSDataSource,
    }
    cls = classes[detect_format(path)]
    if storage_options is not None:
        kwargs["storage_options"] = storage_options
    return cls(path, keys, **kwargs)
