"""Leaf readers over the indexed shards: each batch reads only the bytes of its steps."""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Sequence

import numpy as np

from grain_replay.datasets.rlds.arrayrecord import RecordCache
from grain_replay.datasets.rlds.features import STEPS, Feature
from grain_replay.datasets.rlds.frames import FrameCache
from grain_replay.datasets.rlds.images import decode_image, jpeg_decoder
from grain_replay.datasets.rlds.index import Index
from grain_replay.errors import InvalidStoreError, MissingDependencyError
from grain_replay.sources.reading.pool import run_grouped
from grain_replay.sources.reading.readers import LeafReader, window_rows

__all__ = ["Shards", "make_reader"]


class Shards:
    """The shard files of one process, opened on first use (thread-safe), read with pread."""

    def __init__(self, paths: Sequence[str], sizes: Sequence[int]):
        self.paths = list(paths)
        self.sizes = list(sizes)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                path = self.paths[shard]
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                size = os.fstat(fd).st_size
                if size != self.sizes[shard]:
                    os.close(fd)
                    raise InvalidStoreError(
                        f"{path}: the shard has {size} bytes, but {self.sizes[shard]} when it "
                        "was indexed: it changed under the source. Fix: create the source "
                        "again (the index is rebuilt)."
                    )
                self._fds[shard] = fd
            return fd

    def read(self, shard: int, offset: int, n: int) -> bytes:
        data = os.pread(self.fd(shard), n, offset)
        if len(data) != n:
            raise InvalidStoreError(
                f"{self.paths[shard]}: truncated at byte offset {offset} (wanted {n} bytes, "
                f"got {len(data)}): the shard shrank since it was indexed. Fix: copy it again "
                "and create the source again."
            )
        return data

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


class _Base(LeafReader):
    def __init__(self, f: Feature, index: Index, shards: Shards | RecordCache):
        self.f = f
        self.index = index
        self.shards = shards
        self.step_level = f.level == STEPS

    def _records(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(episode, step_in_episode, record)``: record is the step (step leaves) or the
        episode (episode leaves) whose values are read."""
        ends = self.index.ends
        episode = np.searchsorted(ends, steps, side="right")
        j = steps - (ends[episode] - self.index.arrays["n_steps"][episode])
        return episode, j, steps if self.step_level else episode

    def where(self, episode: int, j: int) -> str:
        shard = int(self.index.episode_shard[episode])
        first = int(np.searchsorted(self.index.episode_shard, shard, side="left"))
        return (
            f"{self.shards.paths[shard]}: episode {episode - first} of the shard (episode "
            f"{episode} of the dataset), step {j}, feature {self.f.key!r}"
        )


class _IntReader(_Base):
    """Int64-list leaves (flags, ids): decoded when indexed, gathered from memory."""

    def __init__(self, f: Feature, index: Index, shards: Shards | RecordCache):
        super().__init__(f, index, shards)
        self.values = index.arrays[f.key + "#val"].reshape(-1, *f.shape)

    def take(self, indices: np.ndarray) -> np.ndarray:
        _, _, rec = self._records(np.asarray(indices, np.int64))
        return self.values[rec]


class _FloatReader(_Base):
    """Float-list leaves: ``prod(shape)`` float32 values per step, an episode's steps one
    after the other in its record, so a run of consecutive steps is one ``pread``."""

    def __init__(self, f: Feature, index: Index, shards: Shards | RecordCache):
        super().__init__(f, index, shards)
        self.off = index.arrays[f.key + "#off"]
        self.stride = index.arrays[f.key + "#stride"]

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The rows, read in runs: rows that follow each other in one episode with steps
        ascending by 0 or 1 (a window of an action chunk, its edge-clipped repeats, an
        episode leaf repeated on its steps) are one ``pread`` of the run's bytes, the rows
        picked from it. Random rows are one ``pread`` each, as before."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        size = self.f.size
        if size == 0 or not idx.size:
            return np.zeros((len(idx), *self.f.shape), self.f.dtype)
        episode, j, _ = self._records(idx)
        if not self.step_level:
            j = np.zeros_like(j)  # one value per episode: every step of it reads the same
        # Run boundaries: another episode, or a step that is not the last one or the next.
        step = np.diff(j)
        new = np.empty(len(idx), bool)
        new[0] = True
        np.logical_or(episode[1:] != episode[:-1], (step < 0) | (step > 1), out=new[1:])
        heads = np.flatnonzero(new)
        run = np.cumsum(new) - 1
        first_j = j[heads]
        last_j = np.maximum.reduceat(j, heads)
        ep = episode[heads]
        count = last_j - first_j + 1
        stride = self.stride[ep].astype(np.int64)
        width = size * stride  # bytes a step
        shard = self.index.episode_shard[ep].tolist()
        first = (self.off[ep] + first_j * width).tolist()
        nbytes = (count * width).tolist()
        read = self.shards.read
        if np.all(stride == 4):
            raw = b"".join(read(int(s), int(o), int(n)) for s, o, n in zip(shard, first, nbytes))
            vals = np.frombuffer(raw, "<f4").reshape(-1, size)
        else:
            parts = []
            for s, o, n, st in zip(shard, first, nbytes, stride.tolist()):
                b = np.frombuffer(read(int(s), int(o), int(n)), np.uint8).reshape(-1, st)
                parts.append(np.ascontiguousarray(b[:, st - 4 :]).view("<f4").reshape(-1, size))
            vals = np.concatenate(parts)
        # Each row's place in the runs read: its run's first row there, plus its step's lead.
        base = np.cumsum(count) - count
        rows = base[run] + (j - first_j[run])
        if len(heads) == len(idx):  # every row a run of its own: in order, copied once
            return vals.reshape(len(idx), *self.f.shape).astype(self.f.dtype)
        got = vals.take(rows, axis=0)
        return got.reshape(len(idx), *self.f.shape).astype(self.f.dtype, copy=False)

    def take_windows_fixed(
        self, starts: np.ndarray, length: int, near: np.ndarray | None, at: np.ndarray | None
    ) -> np.ndarray:
        """The windows' rows with their fix-ups applied first, then read as runs: an
        anchor's chunk clipped to its episode is one ``pread`` (the default would read
        the rows past the episode's end too, from the next one, then replace them)."""
        rows = window_rows(starts, length).reshape(len(starts), length)
        if near is not None and at is not None and len(near):
            rows[near] = starts[near, None] + at
        got = self.take(rows.reshape(-1))
        return got.reshape(len(starts), length, *got.shape[1:])


class _BytesReader(_Base):
    """Bytes-list leaves: text, encoded tensors and images, one pread per element."""

    def __init__(self, f: Feature, index: Index, shards: Shards | RecordCache):
        super().__init__(f, index, shards)
        self.off = index.arrays[f.key + "#off"]
        self.len = index.arrays[f.key + "#len"]
        self.per = 1 if f.kind in ("image", "raw") else f.size
        # Decoded frames kept on disk (step-level images only; see frames.py).
        self.frames: FrameCache | None = None

    def _blobs(self, idx: np.ndarray) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        episode, j, rec = self._records(idx)
        per = self.per
        elem = (rec[:, None] * per + np.arange(per)).reshape(-1)
        shard = np.repeat(self.index.episode_shard[episode], per)
        read = self.shards.read
        blobs = [
            read(s, o, n)
            for s, o, n in zip(shard.tolist(), self.off[elem].tolist(), self.len[elem].tolist())
        ]
        return blobs, episode, j

    @property
    def dtype(self) -> np.dtype:
        if self.f.kind == "text":
            width = int(self.len.max()) if self.len.size else 1
            return np.dtype(f"S{max(1, width)}")
        return self.f.dtype

    def take(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, np.int64).reshape(-1)
        frames = self.frames
        if frames is not None and frames.enabled:
            return self._cached_images(idx, frames)
        f = self.f
        if f.kind == "image":
            return self._decoded(idx)
        blobs, episode, j = self._blobs(idx)
        if f.kind == "text":
            return np.array(blobs, dtype=self.dtype).reshape(len(idx), *f.shape)
        if f.kind == "raw":
            out = np.empty((len(idx), *f.shape), f.dtype)
            for k, blob in enumerate(blobs):
                try:
                    data = zlib.decompress(blob) if f.compressed else blob
                    out[k] = np.frombuffer(data, f.dtype.newbyteorder("<")).reshape(f.shape)
                except (zlib.error, ValueError) as e:
                    raise InvalidStoreError(
                        f"{self.where(int(episode[k]), int(j[k]))}: the encoded tensor does "
                        f"not decode to {f.dtype}{list(f.shape)} ({e}). Fix: the shard is "
                        "corrupt; copy it again, or leave the feature out with keys=[...]."
                    ) from e
            return out
        return self._images(blobs, episode, j)

    def _decoded(self, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The images of steps ``idx``, each distinct step read and decoded once (a frame
        stack's clipped repeats at an episode's start, the shared frames of overlapping
        stacks), into ``out`` if given."""
        uniq, inverse = np.unique(idx, return_inverse=True)
        if len(uniq) == len(idx):
            blobs, episode, j = self._blobs(idx)
            return self._images(blobs, episode, j, out)
        blobs, episode, j = self._blobs(uniq)
        decoded = self._images(blobs, episode, j)
        if out is None:
            return decoded.take(inverse.reshape(-1), axis=0)
        np.take(decoded, inverse.reshape(-1), axis=0, out=out)
        return out

    def take_into(self, indices: np.ndarray, out: np.ndarray) -> None:
        """Images are read (cached frames) or decoded straight into ``out``."""
        f = self.f
        if f.kind != "image" or out.dtype != f.dtype or not out.flags.c_contiguous:
            out[...] = self.take(indices)
            return
        idx = np.asarray(indices, np.int64).reshape(-1)
        frames = self.frames
        if frames is not None and frames.enabled:
            self._cached_images(idx, frames, out)
        else:
            self._decoded(idx, out)

    def _cached_images(
        self, idx: np.ndarray, frames: FrameCache, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Frames from the cache; the others decoded (as without it) and stored there."""
        if out is None:
            out = np.empty((len(idx), *self.f.shape), self.f.dtype)
        _, _, rec = self._records(idx)
        miss = np.flatnonzero(~frames.read(rec, out))
        if miss.size:
            # Each distinct step decoded and stored once.
            uniq, inverse = np.unique(idx[miss], return_inverse=True)
            blobs, episode, j = self._blobs(uniq)
            decoded = self._images(blobs, episode, j)
            out[miss] = decoded[inverse.reshape(-1)]  # uniq is sorted: back in miss order
            frames.write(self._records(uniq)[2].tolist(), decoded)
        return out

    def _images(
        self,
        blobs: list[bytes],
        episode: np.ndarray,
        j: np.ndarray,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        f = self.f
        if out is None:
            out = np.empty((len(blobs), *f.shape), f.dtype)
        fast = jpeg_decoder()

        def decode(k: int) -> None:
            try:
                out[k] = decode_image(blobs[k], f.shape, f.dtype, fast)
            except MissingDependencyError:
                raise
            except Exception as e:  # the decoders raise many kinds for bad bytes
                raise InvalidStoreError(
                    f"{self.where(int(episode[k]), int(j[k]))}: the encoded image does not "
                    f"decode to {f.dtype}{list(f.shape)} ({type(e).__name__}: {e}). Fix: the "
                    "shard is corrupt; copy it again, or leave the feature out with keys=[...]."
                ) from e

        run_grouped(list(range(len(blobs))), decode)
        return out


def make_reader(f: Feature, index: Index, shards: Shards | RecordCache) -> LeafReader:
    """The reader of leaf ``f``."""
    if f.wire == "int64":
        return _IntReader(f, index, shards)
    if f.wire == "float":
        return _FloatReader(f, index, shards)
    return _BytesReader(f, index, shards)
