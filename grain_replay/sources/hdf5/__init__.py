"""HDF5 stores: the source, raw chunk reads, codecs, references out of the file, remote files."""

from __future__ import annotations

from grain_replay.sources.hdf5.source import HDF5DataSource

__all__ = ["HDF5DataSource"]
