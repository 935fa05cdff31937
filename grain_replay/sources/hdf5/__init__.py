"""HDF5 stores: the source, raw chunk reads, codecs, references out of the file, remote files,
files another process holds open for writing (held)."""

from __future__ import annotations

from grain_replay.sources.hdf5.source import HDF5DataSource

__all__ = ["HDF5DataSource"]
