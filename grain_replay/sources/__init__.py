"""Random-access grain data sources over HDF5, ``.npy`` and Zarr stores."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.sources.base import ReplaySource, is_url
from grain_replay.sources.hdf5.source import HDF5_SIGNATURE, HDF5DataSource
from grain_replay.sources.npy import NPY_MAGIC, NpyDataSource
from grain_replay.sources.reading.files import require_regular_file
from grain_replay.sources.zarr.source import ZarrDataSource

# Files whose presence makes a directory a Zarr store.
ZARR_MARKERS = ("zarr.json", ".zgroup", ".zarray", ".zmetadata", ".zattrs")

__all__ = ["ReplaySource", "HDF5DataSource", "NpyDataSource", "ZarrDataSource", "open_source"]


def detect_format(path: str | os.PathLike[str]) -> str:
    """``"hdf5"``, ``"npy"`` or ``"zarr"`` from what is at ``path`` (suffix for URLs)."""
    path = os.fspath(path)
    if is_url(path):
        stripped = path.rstrip("/")
        if stripped.endswith((".h5", ".hdf5")):
            return "hdf5"
        if stripped.endswith(".zarr"):
            return "zarr"
        raise InvalidStoreError(
            f"Cannot tell the format of {path} from its suffix. Fix: use gr.ZarrDataSource or "
            "gr.HDF5DataSource directly."
        )
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(8)
        if magic == HDF5_SIGNATURE:
            return "hdf5"
        if magic.startswith(NPY_MAGIC):
            return "npy"
        raise InvalidStoreError(
            f"{path} is neither an HDF5 nor a .npy file (magic bytes {magic!r}). Fix: pass an "
            "HDF5 file, a .npy file, a directory of .npy files or a Zarr group."
        )
    if os.path.isdir(path):
        # Zarr v3 (group or array: zarr.json), v2 group (.zgroup), v2 array (.zarray),
        # and a v2 store with only consolidated metadata or attributes.
        if any(os.path.exists(os.path.join(path, name)) for name in ZARR_MARKERS):
            return "zarr"
        return "npy"
    if os.path.exists(path):
        require_regular_file(path)  # a FIFO, device or socket
    raise StoreNotFoundError(f"No replay store at {path}. Fix: check the path.")


def open_source(
    path: str | os.PathLike[str],
    keys: Sequence[str] | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> ReplaySource:
    """Opens ``path`` with the source class its contents call for.

    Args:
      path: an HDF5 file, a ``.npy`` file or directory, a Zarr group, or an URL
        ending in ``.zarr`` / ``.h5``.
      keys: leaves (or groups) to read; default all.
      storage_options: fsspec options for URLs.
      **kwargs: passed to the source class (e.g. ``cache_bytes``).

    Raises:
      StoreNotFoundError: nothing is at ``path``.
      InvalidStoreError: the format cannot be recognized.
    """
    cls = {"hdf5": HDF5DataSource, "npy": NpyDataSource, "zarr": ZarrDataSource}[
        detect_format(path)
    ]
    if storage_options is not None:
        kwargs["storage_options"] = storage_options
    return cls(path, keys, **kwargs)
