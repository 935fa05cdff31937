"""The per-process handle of a ``LeRobotDataSource``: parquet files, videos, decoded caches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from grain_replay.datasets.lerobot.columns import ColumnReader, ParquetFiles, Segments
from grain_replay.datasets.lerobot.images import EncodedCache, ImageReader
from grain_replay.datasets.lerobot.meta import LeRobotMeta
from grain_replay.datasets.lerobot.video import VideoFiles, VideoReader
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.readers import Handle, LeafReader
from grain_replay.store.layout import LeafSpec

__all__ = ["FrameHandle"]

# A data file whose frames decode to more than this share of the cache is
# decoded row group by row group instead of whole.
_BLOCK_SHARE = 4


class FrameHandle(Handle):
    """The per-process state: open parquet files and videos, the decoded-data caches."""

    def __init__(
        self,
        meta: LeRobotMeta,
        spec: Mapping[str, LeafSpec],
        numeric_spec: Mapping[str, LeafSpec],
        image_keys: Sequence[str],
        cache_bytes: int,
        frame_cache_bytes: int,
        tolerance_s: float,
    ):
        self.files = ParquetFiles(meta.root, meta.data_files)
        self.videos = VideoFiles(meta.root)
        cameras = [k for k in spec if k in meta.cameras]
        images = [k for k in spec if k in image_keys]
        numeric = {k: s for k, s in spec.items() if k in numeric_spec}
        if cameras and "timestamp" not in numeric:
            numeric["timestamp"] = numeric_spec["timestamp"]
        cache = ChunkCache(cache_bytes)
        row_bytes = 0
        for k, s in numeric.items():
            nbytes = s.dtype.itemsize * int(np.prod(s.shape, dtype=np.int64))
            cache.register(k, meta.num_frames * nbytes)
            row_bytes += nbytes
        segments = Segments(meta.data_files, row_bytes, max(1, cache.max_bytes // _BLOCK_SHARE))
        readers: dict[str, LeafReader] = {
            k: ColumnReader(k, s.shape, s.dtype, self.files, segments, cache)
            for k, s in numeric.items()
        }
        frames = ChunkCache(frame_cache_bytes)
        encoded = EncodedCache(frame_cache_bytes)
        for key in images:
            shape = spec[key].shape
            readers[key] = ImageReader(
                key, (shape[0], shape[1], shape[2]), self.files, segments, encoded, frames
            )
        for cam in cameras:
            readers[cam] = VideoReader(
                meta.cameras[cam], readers["timestamp"], meta.ends, meta.episode_index,
                self.videos, frames, meta.fps, tolerance_s,
            )  # fmt: skip
        self.readers = readers
        self.numeric_cache = cache
        self.frame_cache = frames

    def close(self) -> None:
        self.files.close()
        self.videos.close()
