"""Image features of a LeRobot dataset: PNG/JPEG bytes in parquet, decoded with PyAV per frame."""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from grain_replay.datasets.lerobot.columns import ParquetFiles, Segments
from grain_replay.datasets.lerobot.video import import_av
from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.readers import LeafReader

__all__ = ["EncodedCache", "ImageReader", "decode_image"]

# Codec of an encoded image, from its first bytes.
_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "mjpeg"))


def decode_image(data: bytes, where: str) -> np.ndarray:
    """An encoded PNG or JPEG image as a uint8 ``(H, W, 3)`` RGB array.

    A fresh codec context per image: contexts are not thread-safe, and one
    costs about 40 us against the decode itself.
    """
    av = import_av()
    codec = next((name for magic, name in _MAGIC if data.startswith(magic)), None)
    if codec is None:
        raise InvalidStoreError(
            f"{where}: the image is neither PNG nor JPEG (starts with {data[:8]!r}). Fix: "
            "re-create the dataset with LeRobot's writer (it stores PNG)."
        )
    try:
        ctx = av.CodecContext.create(codec, "r")
        frames = ctx.decode(av.Packet(data)) + ctx.decode(None)
    except av.error.FFmpegError as e:
        raise InvalidStoreError(f"{where}: the {codec} image cannot be decoded ({e}).") from e
    if not frames:
        raise InvalidStoreError(f"{where}: the {codec} image decodes to no frame.")
    return np.ascontiguousarray(frames[0].to_ndarray(format="rgb24"))


class EncodedCache:
    """A byte-bounded LRU of encoded image columns (pyarrow arrays), one entry per segment."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._data: collections.OrderedDict[tuple[str, int], Any] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> Any:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: tuple[str, int], value: Any) -> None:
        nbytes = int(value.nbytes)
        if nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._data:
                return
            self._data[key] = value
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                _, old = self._data.popitem(last=False)
                self._bytes -= int(old.nbytes)


class ImageReader(LeafReader):
    """Frames of one image feature as uint8 ``(H, W, 3)`` arrays.

    The encoded bytes of a segment (a data file or row group) are read once
    and kept in ``encoded``; each frame is decoded on first use and kept in the
    frame cache.
    """

    def __init__(
        self,
        key: str,
        shape: tuple[int, int, int],
        files: ParquetFiles,
        segments: Segments,
        encoded: EncodedCache,
        frames: ChunkCache,
    ):
        self._key = key
        self._shape = shape
        self._files = files
        self._segments = segments
        self._encoded = encoded
        self._frames = frames

    def _column(self, s: int) -> Any:
        name = (self._key, s)
        col = self._encoded.get(name)
        if col is None:
            import pyarrow as pa

            f, groups = self._segments.parts[s]
            with self._files.lock(f):
                col = self._files.read(f, groups, self._key)
            col = pa.concat_arrays(col.chunks) if col.num_chunks != 1 else col.chunk(0)
            if pa.types.is_struct(col.type):
                col = col.field("bytes")
            self._encoded.put(name, col)
        return col

    def take(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), *self._shape), dtype=np.uint8)
        if len(indices) == 0:
            return out
        uniq, inv = np.unique(indices, return_inverse=True)
        got: list[np.ndarray | None] = [self._frames.get((self._key, int(r))) for r in uniq]
        seg = self._segments.of(uniq)
        for j in [j for j, g in enumerate(got) if g is None]:
            s = int(seg[j])
            f = self._segments.parts[s][0]
            row = int(uniq[j])
            where = f"{self._files.path(f)}: feature {self._key!r}, frame {row}"
            data = self._column(s)[row - int(self._segments.starts[s])].as_py()
            if not data:
                raise InvalidStoreError(
                    f"{where}: no embedded image bytes (the image is stored as a path "
                    "only). Fix: re-create the dataset with LeRobot's writer, which embeds them."
                )
            frame = decode_image(data, where)
            if frame.shape != self._shape:
                raise InvalidStoreError(
                    f"{where}: the image decodes to shape {frame.shape}, but info.json declares "
                    f"{self._shape}. Fix: correct meta/info.json."
                )
            frame.flags.writeable = False
            self._frames.put((self._key, row), frame)
            got[j] = frame
        np.take(np.stack(got), inv.reshape(-1), axis=0, out=out)  # type: ignore[arg-type, unused-ignore]
        return out
