"""A snapshot of a bounded, many-writer store: every writer's manifest and the segment
stores it names, opened at once (evictions after it unlink files this process keeps
open, so its rows stay readable, each exactly as committed, until the next one)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.errors import EvictedRowError, GrainReplayError, InvalidStoreError
from grain_replay.sources.base import ReplaySource
from grain_replay.sources.hdf5 import HDF5DataSource
from grain_replay.sources.npy import NpyDataSource
from grain_replay.sources.parts.schema import WRITER_KEY, read_schema, select_leaves
from grain_replay.sources.reading.runs import runs
from grain_replay.sources.reading.stitch import place, reserve
from grain_replay.sources.zarr import ZarrDataSource
from grain_replay.store import layout as layout_lib
from grain_replay.store import parts as parts_lib
from grain_replay.store.formats import PAGE, SEGMENT_NPY_HEADER
from grain_replay.store.layout import LeafSpec

__all__ = [
    "WRITER_KEY",
    "Mapped",
    "Part",
    "Snapshot",
    "build_part",
    "evicted",
    "read_schema",
    "select_leaves",
    "stamp",
]

_CLASSES: dict[str, type[ReplaySource]] = {
    "npy": NpyDataSource,
    "hdf5": HDF5DataSource,
    "zarr": ZarrDataSource,
}


def stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


@dataclasses.dataclass
class Part:
    """One writer in one snapshot: its manifest and the segment stores it names."""

    manifest: parts_lib.Manifest
    stamp: tuple[int, int, int] | None
    # first row of a segment -> its opened store (live segments, then kept retired ones)
    segments: dict[int, ReplaySource]
    rows: dict[int, int]  # first -> committed rows readable in it
    mapped: Mapped | None = None  # the live segments back to back (.npy), or None


@dataclasses.dataclass
class Mapped:
    """A writer's live ``.npy`` segments mapped back to back: one array per leaf."""

    base: int  # the sequence number of row 0 of the arrays
    stop: int  # one past the last committed row
    arrays: dict[str, np.ndarray]


def evicted(wdir: str, m: parts_lib.Manifest, first: int) -> bool:
    """Whether segment ``first`` of ``m`` was evicted since ``m`` was read: its files are
    gone, or being deleted (a newer manifest no longer lists it: the writer commits the
    manifest before it unlinks the segments it dropped)."""
    if not os.path.exists(os.path.join(wdir, parts_lib.segment_name(first, m.format))):
        return True
    now = parts_lib.read_manifest(wdir)
    return now is not None and all(t.first != first for t in now.segments)


def map_segments(wdir: str, m: parts_lib.Manifest, spec: Mapping[str, LeafSpec]) -> Mapped | None:
    """Maps the live segments of a ``.npy`` writer part back to back, or None where it
    cannot (another format, rows that are not whole pages per segment, old headers)."""
    if m.format != "npy" or not m.segments or not spec:
        return None
    header = SEGMENT_NPY_HEADER
    base = m.segments[0].first
    stop = m.segments[-1].first + m.segments[-1].rows
    arrays = {}
    for key, leaf in spec.items():
        row = leaf.dtype.itemsize * int(np.prod(leaf.shape, dtype=np.int64))
        if row == 0 or (m.segment_rows * row) % PAGE or header % PAGE:
            return None
        total = (stop - base) * row
        reservation = reserve(-(-total // PAGE) * PAGE)
        if reservation is None:
            return None
        name = layout_lib.disk_name(key) + ".npy"
        for seg in m.segments:
            file = os.path.join(wdir, parts_lib.segment_name(seg.first, m.format), name)
            try:
                fd = os.open(file, os.O_RDONLY)
            except OSError:
                return None
            try:
                length = seg.rows * row
                if os.fstat(fd).st_size < header + length:
                    return None
                at = reservation.addr + (seg.first - base) * row
                if not place(at, -(-length // PAGE) * PAGE, fd, header):
                    return None
            finally:
                os.close(fd)
        array = np.asarray(reservation.window(total)).view(leaf.dtype)
        array = array.reshape((stop - base, *leaf.shape))
        array.flags.writeable = False
        arrays[key] = array
    return Mapped(base, stop, arrays)


class Snapshot:
    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        live = np.array([p.manifest.live for p in parts], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(live)]).astype(np.int64)
        self.n = int(self.starts[-1])
        self.live_start = np.array([p.manifest.live_start for p in parts], dtype=np.int64)
        self.committed = np.array([p.manifest.committed for p in parts], dtype=np.int64)
        self.seg_rows = np.array([p.manifest.segment_rows for p in parts], dtype=np.int64)
        self.ordinals = np.array([p.manifest.ordinal for p in parts], dtype=np.int64)
        size = int(np.max(self.ordinals)) + 1 if len(parts) else 0
        self.part_of_ordinal = np.full(size, -1, dtype=np.int64)
        self.part_of_ordinal[self.ordinals] = np.arange(len(parts))

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions (int64 in ``[0, n)``) -> (part index, sequence number)."""
        p = np.searchsorted(self.starts, positions, side="right") - 1
        return p, self.live_start[p] + positions - self.starts[p]

    def gather_mapped(
        self,
        p: np.ndarray,
        seq: np.ndarray,
        keys: list[str],
        out: dict[str, np.ndarray],
    ) -> np.ndarray | None:
        """Reads the rows a part's back-to-back map holds (one gather per leaf per part);
        returns the positions in the batch of the other rows, or None if none is left."""
        if len(self.parts) == 1:
            m = self.parts[0].mapped
            if m is None:
                return np.arange(len(p))
            if int(seq.min()) >= m.base and int(seq.max()) < m.stop:
                idx = seq - m.base
                for k in keys:
                    np.take(m.arrays[k], idx, axis=0, out=out[k])
                return None
        mapped = np.zeros(len(p), dtype=bool)
        for pi in np.unique(p):
            m = self.parts[int(pi)].mapped
            if m is None:
                continue
            sel = (p == pi) & (seq >= m.base) & (seq < m.stop)
            if not sel.any():
                continue
            mapped |= sel
            idx = seq[sel] - m.base
            for k in keys:
                out[k][sel] = m.arrays[k][idx]
        rest = np.flatnonzero(~mapped)
        return rest if len(rest) else None

    def gather_segments(
        self,
        p: np.ndarray,
        seq: np.ndarray,
        rest: np.ndarray,
        keys: list[str],
        out: dict[str, np.ndarray],
        where: str,
    ) -> None:
        """Reads rows ``rest`` of the batch (``seq`` of parts ``p``) from their segments'
        stores into ``out``: one vectorized read per leaf per segment touched.

        Raises:
          EvictedRowError: a row is in no segment this snapshot holds open.
        """
        p, seq = p[rest], seq[rest]
        seg_rows = self.seg_rows[p]
        first = seq // seg_rows * seg_rows
        offset = seq - first
        # One run per (part, segment): the pair packed as an id, the part's index in the
        # ordinal's place (both in range: the key splits back exactly).
        for k, sel in runs(parts_lib.make_ids(p, first)):
            at_part, seg_first = parts_lib.split_ids(k)
            part = self.parts[at_part]
            src = part.segments.get(seg_first)
            offs = offset[sel]
            at = rest[sel]
            if src is None or int(offs.max()) >= part.rows.get(seg_first, 0):
                raise EvictedRowError(
                    f"{where}: writer {part.manifest.writer_id!r}: row "
                    f"{seg_first + int(offs.max())} is not readable in this snapshot (evicted "
                    "before this reader opened it, or not yet committed). Fix: refresh() "
                    "more often than the writers evict, or raise capacity."
                )
            if len(keys) == 1:
                out[keys[0]][at] = src.read_leaf(keys[0], offs)
                continue
            flat = src.read_flat(offs, check=False)
            for name in keys:
                out[name][at] = flat[name]

    def readable(self, p: np.ndarray, seq: np.ndarray) -> np.ndarray:
        """Whether each row ``seq`` of part ``p`` is in a segment this snapshot holds open."""
        ok = np.ones(len(p), dtype=bool)
        if not len(p):
            return ok
        if len(self.parts) == 1:  # the common case: one writer, its live rows mapped
            m = self.parts[0].mapped
            if m is not None and int(seq.min()) >= m.base and int(seq.max()) < m.stop:
                return ok
        seg_rows = self.seg_rows[p]
        first = seq // seg_rows * seg_rows
        for k, sel in runs(parts_lib.make_ids(p, first)):  # keyed as gather_segments
            at_part, f = parts_lib.split_ids(k)
            part = self.parts[at_part]
            ok[sel] = (seq[sel] - f) < part.rows[f] if f in part.segments else False
        return ok


def open_segment(
    store: str, m: parts_lib.Manifest, first: int, keys: list[str], kwargs: Mapping[str, Any]
) -> ReplaySource:
    """Segment ``first`` of writer ``m``, opened (mapped) now, with leaves ``keys``."""
    path = os.path.join(
        parts_lib.writer_dir(store, m.writer_id), parts_lib.segment_name(first, m.format)
    )
    src = _CLASSES[m.format](path, keys or None, **kwargs)
    src.open()
    return src


def _open_or_grow(
    store: str, m: parts_lib.Manifest, s: parts_lib.Segment, src: ReplaySource | None,
    keys: list[str], kwargs: Mapping[str, Any],
) -> tuple[ReplaySource, bool]:  # fmt: skip
    """Segment ``s`` of ``m`` holding its ``s.rows`` rows: ``src`` (the previous snapshot's)
    as it is or grown in place, or opened anew; and whether the files were looked at."""
    if src is not None and len(src) >= s.rows:
        return src, False
    if src is not None:
        # The tail grew. The source is the previous snapshot's too, which still reads
        # from it (until the refresh after this one): closing it would have its next
        # read reopen the files, perhaps after an eviction unlinked them. Grown in
        # place, or this snapshot opens its own.
        if src.grow_in_place() and len(src) >= s.rows:
            return src, True
    src = open_segment(store, m, s.first, keys, kwargs)
    if len(src) < s.rows:
        src.refresh()
        # A refresh that cannot grow the maps in place closes them, and the next read
        # would open the files then, perhaps after an eviction unlinked them: map them
        # now, while this snapshot's manifest lists them.
        src.open()
    return src, True


def build_part(
    store: str,
    m: parts_lib.Manifest,
    seen: Any,
    old: Part | None,
    strict: bool,
    spec: Mapping[str, LeafSpec],
    kwargs: Mapping[str, Any],
    opened: Mapping[int, ReplaySource] | None = None,
) -> Part:
    """Writer ``m``'s part of a snapshot: its segments opened (those of ``opened``, then of
    ``old``, reused), its live ``.npy`` segments mapped back to back. ``seen``: the manifest
    file's :func:`stamp` before ``m`` was read. ``strict=False`` skips a segment evicted
    since ``m`` was read (the caller reads a newer manifest and builds again, passing the
    segments this part holds as ``opened``: each was checked whole when it was opened).

    A writer unlinks an evicted segment file by file, after the manifest that drops it.
    An open or grow beside that sees part of it: the format's library raises what it
    raises (zarr: ``KeyError`` for a leaf gone), or worse, succeeds (a Zarr leaf whose
    chunk files went reads as zeros). So a segment looked at here counts only if a
    manifest read after the look still names it (live or retired): its removal had not
    begun.
    """
    keys = [k for k in spec if k != WRITER_KEY]
    segments: dict[int, ReplaySource] = {}
    rows: dict[int, int] = {}
    wdir = parts_lib.writer_dir(store, m.writer_id)
    looked = []
    for s in m.segments:
        prior = None if opened is None else opened.get(s.first)
        if prior is None and old is not None:
            prior = old.segments.get(s.first)
        try:
            src, look = _open_or_grow(store, m, s, prior, keys, kwargs)
        except Exception as e:
            gone = evicted(wdir, m, s.first)
            if gone and not strict:
                continue  # evicted since the manifest was read: retried by the caller
            if isinstance(e, (OSError, GrainReplayError)):
                raise  # a damaged segment (or, strict, an evicted one)
            raise _unreadable(wdir, m, s.first, f"{type(e).__name__}: {e}", gone) from e
        segments[s.first], rows[s.first] = src, s.rows
        if look:
            looked.append(s.first)
    # The manifest's stamp as when ``m`` was read: no commit since, so nothing evicted.
    same = seen is not None and stamp(os.path.join(wdir, parts_lib.MANIFEST_FILE)) == seen
    now = parts_lib.read_manifest(wdir) if looked and not same else None
    on_disk = set() if now is None else {t.first for t in (*now.segments, *now.retired)}
    for f in [] if now is None else sorted({*looked} - on_disk):
        if strict:
            raise _unreadable(wdir, m, f, "removed while it was opened", True)
        del segments[f], rows[f]  # the caller takes the snapshot again
    # Segments evicted since the last snapshot stay open one more generation, so
    # that rows drawn against it are still found by id.
    # Only segments the new manifest dropped: a listed one that could not be opened must
    # stay missing (the caller takes the snapshot again), not be stood in for by its
    # older, shorter self, whose rows past its old length this snapshot would call live.
    listed = {s.first for s in m.segments}
    keep = [] if old is None else [s.first for s in old.manifest.segments if s.first not in listed]
    mapped = None
    if all(s.first in segments for s in m.segments):
        mapped = map_segments(wdir, m, {k: spec[k] for k in keys})
    for f in keep:
        assert old is not None
        segments[f], rows[f] = old.segments[f], old.rows[f]
    return Part(m, seen, segments, rows, mapped)


def _unreadable(
    wdir: str, m: parts_lib.Manifest, first: int, what: str, gone: bool
) -> InvalidStoreError:
    why = "it was evicted meanwhile" if gone else "its manifest lists it: the store is corrupt"
    return InvalidStoreError(
        f"{os.path.join(wdir, parts_lib.segment_name(first, m.format))}: writer "
        f"{m.writer_id!r}'s segment cannot be read ({what}); {why}."
    )
