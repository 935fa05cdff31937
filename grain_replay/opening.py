"""``open_source``: the source class a store's contents call for, and its table."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from grain_replay.sources.base import ReplaySource
from grain_replay.store.formats import detect_format
from grain_replay.store.parts import is_parts_store

__all__ = ["SOURCE_CLASSES", "open_source", "source_class"]

# Class name -> (module, the detect_format name it opens). A new format or dataset
# reader adds its row here (and its signature to store/formats.py's detect_format).
SOURCE_CLASSES = {
    "HDF5DataSource": ("grain_replay.sources.hdf5", "hdf5"),
    "NpyDataSource": ("grain_replay.sources.npy", "npy"),
    "NpzDataSource": ("grain_replay.sources.npz", "npz"),
    "PartsDataSource": ("grain_replay.sources.parts", None),
    "RLDSDataSource": ("grain_replay.datasets.rlds", "rlds"),
    "TorchRLDataSource": ("grain_replay.datasets.torchrl", "torchrl"),
    "VaultDataSource": ("grain_replay.datasets.vault", "vault"),
    "ZarrDataSource": ("grain_replay.sources.zarr", "zarr"),
}


def source_class(name: str) -> type[ReplaySource]:
    """The class named ``name`` in :data:`SOURCE_CLASSES`, its module imported on first use."""
    return getattr(importlib.import_module(SOURCE_CLASSES[name][0]), name)


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
      UnfinishedWriteError: nothing is at ``path`` but the ``.partial`` of a write
        of it that never finished.
      InvalidStoreError: the format cannot be recognized.
    """
    if is_parts_store(os.fspath(path)):
        return source_class("PartsDataSource")(path, keys, **kwargs)
    fmt = detect_format(path)
    cls: type[ReplaySource] = next(
        source_class(name) for name, (_, opens) in SOURCE_CLASSES.items() if opens == fmt
    )
    if storage_options is not None:
        kwargs["storage_options"] = storage_options
    return cls(path, keys, **kwargs)
