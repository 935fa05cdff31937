"""JPEG-encoded image leaves (as Minari stores image spaces): decoded where read, once per image."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.readers import LeafReader
from grain_replay.sources.reading.runs import runs
from grain_replay.store.layout import LeafSpec
from grain_replay.store.optional import import_optional

__all__ = ["JpegLeafReader", "decode_jpegs", "pack_blobs", "pil_image"]


def pil_image() -> Any:
    """``PIL.Image``, the decoder Minari itself uses (bit-identical frames), or an install hint."""
    return import_optional(
        "PIL.Image",
        "Reading JPEG-encoded Minari image spaces needs Pillow. Fix: pip install "
        "'grain-replay[rl]' (or pip install pillow).",
    )


def decode_jpegs(blobs: Sequence[Any], shape: tuple[int, ...], where: str, key: str) -> np.ndarray:
    """``(len(blobs), *shape)`` uint8 frames decoded from JPEG byte strings (or uint8 arrays).

    Raises:
      InvalidStoreError: a blob is not a JPEG image, or decodes to another shape.
    """
    image = pil_image()
    out = np.empty((len(blobs), *shape), dtype=np.uint8)
    for j, blob in enumerate(blobs):
        try:
            with image.open(io.BytesIO(blob)) as im:
                frame = np.asarray(im, dtype=np.uint8)
        except (OSError, ValueError, SyntaxError) as e:
            raise InvalidStoreError(
                f"{where}: leaf {key!r} holds a frame that is not a readable JPEG image ({e}). "
                "The dataset is damaged. Fix: download or collect it again."
            ) from e
        if frame.shape != shape:
            raise InvalidStoreError(
                f"{where}: leaf {key!r} holds a JPEG frame of shape {frame.shape}, but its image "
                f"space is {shape}. Fix: collect the dataset again, or leave the leaf out with "
                "keys=[...]."
            )
        out[j] = frame
    return out


def pack_blobs(blobs: Sequence[Any]) -> np.ndarray:
    """Byte strings as one uint8 array ``[int64 count, int64 ends..., data]`` (for a byte cache)."""
    sizes = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
    head = np.concatenate([[len(blobs)], np.cumsum(sizes)]).astype(np.int64)
    data = b"".join(np.ascontiguousarray(b).tobytes() for b in blobs)
    return np.concatenate([head.view(np.uint8), np.frombuffer(data, np.uint8)])


def unpack_blob(packed: np.ndarray, row: int) -> memoryview:
    """Byte string ``row`` of :func:`pack_blobs`'s array (a view, no copy)."""
    n = int(packed[:8].view(np.int64)[0])
    ends = packed[8 : 8 * (n + 1)].view(np.int64)
    base = 8 * (n + 1)
    start = base + (int(ends[row - 1]) if row else 0)
    return memoryview(packed[start : base + int(ends[row])].data)


class JpegLeafReader(LeafReader):
    """Rows of a JPEG-encoded image leaf of an episode-group HDF5 file.

    An episode's encoded frames are read with one h5py call and kept (packed,
    compressed size) in the handle's byte-bounded cache; only the requested
    steps are decoded, each distinct one once per batch.

    Args:
      handle: the :class:`~grain_replay.datasets.minari.episode_files.EpisodeFileHandle`.
      key, loc: leaf key and dataset path inside an episode group.
      offset: row offset (1 for next observations).
      spec: the decoded frame's spec (uint8, the image space's shape).
    """

    def __init__(self, handle: Any, key: str, loc: str, offset: int, spec: LeafSpec):
        self._h = handle
        self._key = key
        self._loc = loc
        self._offset = offset
        self._shape = tuple(spec.shape)

    def take(self, indices: np.ndarray) -> np.ndarray:
        h = self._h
        out = np.empty((len(indices), *self._shape), dtype=np.uint8)
        if len(indices) == 0:
            return out
        episode = np.searchsorted(h.ends, indices, side="right")
        local = indices - h.starts[episode] + self._offset
        for ep, sel in runs(episode):
            packed = self._encoded(ep)
            rows, inverse = np.unique(local[sel], return_inverse=True)
            frames = decode_jpegs(
                [unpack_blob(packed, int(r)) for r in rows], self._shape, h.path, self._key
            )
            out[sel] = frames[inverse.reshape(-1)]
        return out

    def _encoded(self, ep: int) -> np.ndarray:
        h = self._h
        cache_key = (f"jpeg:{self._loc}", ep)
        packed = h.cache.get(cache_key)
        if packed is not None:
            return packed
        dset = h.groups[ep].get(self._loc)
        steps = int(h.ends[ep] - h.starts[ep])
        need = steps + self._offset
        encoded = dset is not None and getattr(dset, "ndim", 0) in (1, 2)
        if not encoded or dset.shape[0] < need:
            got = None if dset is None else getattr(dset, "shape", "a group")
            raise InvalidStoreError(
                f"{h.path}: episode {ep} has {self._loc!r} of shape {got}; a JPEG-encoded image "
                f"leaf holds one encoded frame per row ({need} rows for {steps} steps) (leaf "
                f"{self._key!r}). The dataset is inconsistent; collect it again."
            )
        # Variable-length rows read as an object array of uint8 arrays; equal-length ones
        # (Minari then writes a plain 2-D uint8 dataset) as the rows of a 2-D array.
        packed = pack_blobs(list(dset[()]))
        h.cache.put(cache_key, packed)
        return packed
