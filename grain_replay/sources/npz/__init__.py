"""``.npz`` archives (``np.savez``, ``np.savez_compressed``, OGBench datasets) as sources."""

from grain_replay.sources.npz.source import NpzDataSource

__all__ = ["NpzDataSource"]
