"""Writers: one-shot atomic writes and the appending ReplayWriter."""

from __future__ import annotations

from grain_replay.writers.oneshot import write, write_hdf5, write_npy, write_zarr
from grain_replay.writers.replay_writer import ReplayWriter, WriterBusyError
from grain_replay.writers.restart import truncate_to_watermark

__all__ = [
    "write",
    "write_hdf5",
    "write_npy",
    "write_zarr",
    "ReplayWriter",
    "WriterBusyError",
    "truncate_to_watermark",
]
