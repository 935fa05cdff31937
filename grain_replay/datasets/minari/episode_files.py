"""Reads of flat steps from HDF5 files that keep one group (``episode_k``) per episode."""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.base import Layout
from grain_replay.sources.hdf5.raw import memmap_offset
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.readers import Handle, LeafReader
from grain_replay.sources.reading.runs import runs
from grain_replay.store.layout import LeafSpec
from grain_replay.store.optional import import_h5py

__all__ = ["EpisodeFileHandle", "episode_names"]

_EPISODE = re.compile(r"episode_(\d+)")
# Address states of an episode's dataset: not looked at yet / not mappable.
_UNKNOWN = -1
_UNMAPPED = -2
# Rows up to this many bytes are gathered byte-wise in one numpy call; larger rows are copied
# row by row (a byte-index array of B x row_bytes would cost more than it saves).
_BYTE_GATHER_MAX = 1024


def episode_names(f: Any) -> list[str]:
    """``episode_k`` group names in numeric order (``episode_10`` after ``episode_9``)."""
    found = [(int(m.group(1)), k) for k in f.keys() if (m := _EPISODE.fullmatch(k))]
    return [k for _, k in sorted(found)]


def _single_extent(dset: Any) -> int | None:
    """File offset of row 0 when all rows lie in one unfiltered extent, row-major, else None."""
    offset = memmap_offset(dset)
    if offset is not None or dset.chunks is None:
        return offset
    if dset.id.get_create_plist().get_nfilters() or dset.dtype.hasobject:
        return None
    if tuple(dset.chunks[1:]) != tuple(dset.shape[1:]) or dset.chunks[0] < dset.shape[0]:
        return None
    if dset.id.get_num_chunks() != 1:
        return None
    info = dset.id.get_chunk_info(0)
    if any(info.chunk_offset) or info.byte_offset is None:
        return None
    return int(info.byte_offset)


class _EpisodeLeafReader(LeafReader):
    """Rows of one leaf. Steps map to (episode, row); unfiltered single-extent datasets are
    gathered straight from a memory map of the file, others read through h5py per episode."""

    def __init__(self, handle: EpisodeFileHandle, key: str, loc: str, offset: int, spec: LeafSpec):
        self._h = handle
        self._key = key
        self._loc = loc
        self._offset = offset
        self._spec = spec
        self._row_bytes = spec.dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64))
        self._addr = handle.addresses(loc)

    def take(self, indices: np.ndarray) -> np.ndarray:
        h = self._h
        out = np.empty((len(indices), *self._spec.shape), dtype=self._spec.dtype)
        if len(indices) == 0:
            return out
        episode = np.searchsorted(h.ends, indices, side="right")
        local = indices - h.starts[episode] + self._offset
        addr = self._addr[episode]
        if (addr == _UNKNOWN).any():
            for e in np.unique(episode[addr == _UNKNOWN]):
                h.resolve(self._loc, int(e), self._key, self._spec)
            addr = self._addr[episode]
        mapped = addr >= 0
        if mapped.all():
            return self._gather(addr + local * self._row_bytes, out)
        if mapped.any():
            pos = np.flatnonzero(mapped)
            out[pos] = self._gather(addr[pos] + local[pos] * self._row_bytes, out[pos])
        pos = np.flatnonzero(~mapped)
        for ep, at in runs(episode[pos]):
            sel = pos[at]
            out[sel] = h.rows(self._key, self._loc, ep, local[sel], self._spec)
        return out

    def _gather(self, starts: np.ndarray, out: np.ndarray) -> np.ndarray:
        mm = self._h.mapped
        rb = self._row_bytes
        if rb == 0:
            return out
        if rb <= _BYTE_GATHER_MAX:
            raw = mm[starts[:, None] + np.arange(rb)]
            return raw.view(self._spec.dtype).reshape(out.shape)
        flat = out.reshape(len(out), -1).view(np.uint8).reshape(len(out), rb)
        for j, s in enumerate(starts.tolist()):
            flat[j] = mm[s : s + rb]
        return out


class EpisodeFileHandle(Handle):
    """One open episode-group HDF5 file: h5py handle, step index, file map and readers.

    Args:
      path: the HDF5 file.
      num_steps, num_episodes: what the source saw when it was made (checked).
      layout: leaf key -> location (dataset path inside an episode group).
      offsets: leaf key -> row offset (1 for next observations and infos).
      cache_bytes: bound of the cache of whole episode datasets read through h5py.
      jpeg: leaf keys whose datasets hold JPEG-encoded frames (decoded when read).
    """

    def __init__(
        self,
        path: str,
        num_steps: int,
        num_episodes: int,
        layout: Layout,
        offsets: dict[str, int],
        cache_bytes: int,
        jpeg: Sequence[str] = (),
    ):
        from grain_replay.sources.reading.jpeg import JpegLeafReader

        self.path = path
        self.file = import_h5py().File(path, "r")
        names = episode_names(self.file)
        self.groups = [self.file[n] for n in names]
        lengths = np.array([g["rewards"].shape[0] for g in self.groups], dtype=np.int64)
        self.ends = np.cumsum(lengths)
        self.starts = self.ends - lengths
        total = int(self.ends[-1]) if len(lengths) else 0
        if total != num_steps or len(names) != num_episodes:
            self.file.close()
            raise InvalidStoreError(
                f"{path}: the dataset changed since the source was made ({len(names)} "
                f"episodes, {total} steps now; {num_episodes} and {num_steps} before). Fix: "
                "create the source again, or call refresh()."
            )
        self.mapped: np.ndarray = np.memmap(path, dtype=np.uint8, mode="r")
        self.cache = ChunkCache(cache_bytes)
        # Above this size an unmappable dataset is read row by row, not whole.
        self.whole_limit = max(1 << 20, cache_bytes // 8)
        self.episodes: Any = None
        self.lock = threading.Lock()
        self._addr: dict[str, np.ndarray] = {}
        self._extra: dict[str, int] = {}
        for key, loc in layout.locations.items():
            self._extra[loc] = max(self._extra.get(loc, 0), offsets[key])
        self.readers: dict[str, LeafReader] = {
            key: (JpegLeafReader if key in jpeg else _EpisodeLeafReader)(
                self, key, loc, offsets[key], layout.spec[key]
            )
            for key, loc in layout.locations.items()
        }

    def addresses(self, loc: str) -> np.ndarray:
        """Per episode, the file offset of row 0 of ``loc`` (or an address state)."""
        return self._addr.setdefault(loc, np.full(len(self.groups), _UNKNOWN, dtype=np.int64))

    def _dataset(self, key: str, loc: str, ep: int, spec: LeafSpec) -> Any:
        dset = self.groups[ep].get(loc)
        if dset is None or not hasattr(dset, "dtype") or tuple(dset.shape[1:]) != spec.shape:
            got = None if dset is None else getattr(dset, "shape", "a group")
            raise InvalidStoreError(
                f"{self.path}: episode {ep} has {loc!r} of shape {got}, expected "
                f"(rows, {', '.join(map(str, spec.shape))}) like the first episode "
                f"(leaf {key!r}). Fix: select other leaves with keys=[...]."
            )
        need = int(self.ends[ep] - self.starts[ep]) + self._extra[loc]
        if dset.shape[0] < need:
            raise InvalidStoreError(
                f"{self.path}: episode {ep} has {dset.shape[0]} rows of {loc!r} but its "
                f"{self.ends[ep] - self.starts[ep]} steps need {need} (leaf {key!r}). The "
                "dataset is inconsistent; re-create it."
            )
        return dset

    def resolve(self, loc: str, ep: int, key: str, spec: LeafSpec) -> None:
        """Finds where episode ``ep``'s ``loc`` rows lie in the file, if in one extent."""
        dset = self._dataset(key, loc, ep, spec)
        offset = _single_extent(dset) if dset.dtype == spec.dtype else None
        self.addresses(loc)[ep] = _UNMAPPED if offset is None else offset

    def rows(self, key: str, loc: str, ep: int, local: np.ndarray, spec: LeafSpec) -> np.ndarray:
        """Rows ``local`` of episode ``ep``'s ``loc``, read through h5py (cached whole)."""
        block = self.cache.get((loc, ep))
        if block is None:
            dset = self._dataset(key, loc, ep, spec)
            if dset.size * dset.dtype.itemsize > self.whole_limit:
                uniq = np.unique(local)
                return dset[uniq][np.searchsorted(uniq, local)]
            block = dset[()]
            self.cache.put((loc, ep), block)
        return block[local]

    def close(self) -> None:
        self.readers = {}
        self.groups = []
        self._addr = {}
        self.mapped = np.zeros(0, np.uint8)
        self.file.close()
