"""Random-access grain data sources over HDF5, ``.npy`` and Zarr stores."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from grain_replay.formats import detect_format
from grain_replay.parts import is_parts_store
from grain_replay.sources.base import BatchSource, ReplaySource, SourceSurface

if TYPE_CHECKING:  # loaded on first use: a loader worker imports only the room it reads
    from grain_replay.sources.hdf5 import HDF5DataSource
    from grain_replay.sources.npy import NpyDataSource
    from grain_replay.sources.npz import NpzDataSource
    from grain_replay.sources.parts import PartsDataSource
    from grain_replay.sources.rlds import RLDSDataSource
    from grain_replay.sources.torchrl import TorchRLDataSource
    from grain_replay.sources.vault import VaultDataSource
    from grain_replay.sources.zarr import ZarrDataSource

# Class name -> (module, the detect_format name it opens).
_ROOMS = {
    "HDF5DataSource": ("grain_replay.sources.hdf5", "hdf5"),
    "NpyDataSource": ("grain_replay.sources.npy", "npy"),
    "NpzDataSource": ("grain_replay.sources.npz", "npz"),
    "PartsDataSource": ("grain_replay.sources.parts", None),
    "RLDSDataSource": ("grain_replay.sources.rlds", "rlds"),
    "TorchRLDataSource": ("grain_replay.sources.torchrl", "torchrl"),
    "VaultDataSource": ("grain_replay.sources.vault", "vault"),
    "ZarrDataSource": ("grain_replay.sources.zarr", "zarr"),
}


def __getattr__(name: str) -> Any:
    if name not in _ROOMS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_ROOMS[name][0]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_ROOMS))


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
        return __getattr__("PartsDataSource")(path, keys, **kwargs)
    fmt = detect_format(path)
    cls: type[ReplaySource] = next(
        __getattr__(name) for name, (_, opens) in _ROOMS.items() if opens == fmt
    )
    if storage_options is not None:
        kwargs["storage_options"] = storage_options
    return cls(path, keys, **kwargs)
