"""Per-format storage of a growing store: rows beyond the committed N are invisible.

Each backend keeps the same invariant: rows ``[0, N)`` of every leaf are on
disk before the metadata says ``N``, and nothing a later append does touches
them. A crash therefore leaves the committed rows intact, and reopening drops
whatever was written after the last commit. The commit primitives (fsync of
many files, in-place headers and metadata) are in :mod:`grain_replay.writers.backends.durable`.
"""

from __future__ import annotations

from grain_replay.writers.backends.base import Backend, write_by_leaf
from grain_replay.writers.backends.hdf5 import HDF5Backend
from grain_replay.writers.backends.npy import NpyBackend, NpySegmentBackend
from grain_replay.writers.backends.zarr import ZarrBackend

__all__ = [
    "Backend",
    "NpyBackend",
    "NpySegmentBackend",
    "ZarrBackend",
    "HDF5Backend",
    "BACKENDS",
    "write_by_leaf",
]

BACKENDS: dict[str, type[Backend]] = {"npy": NpyBackend, "zarr": ZarrBackend, "hdf5": HDF5Backend}
