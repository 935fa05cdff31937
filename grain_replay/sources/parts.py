"""The reader of a bounded, many-writer store: the union of every writer's live rows.

A snapshot (taken at construction and at each :meth:`PartsDataSource.refresh`)
is every writer's manifest plus the segment stores they name, opened (mapped)
at once: evictions after it unlink files this process keeps open, so the
snapshot's rows stay readable, each exactly as committed, until the next
refresh. Writers are in sorted id order, each oldest row first; position ``i``
of a snapshot is one writer's row ``seq``, whose id is ``ordinal << 40 | seq``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import layout as layout_lib
from grain_replay import parts as parts_lib
from grain_replay import tree as tree_lib
from grain_replay.errors import (
    EvictedRowError,
    GrainReplayError,
    InvalidStoreError,
    RecordIndexError,
    UnknownLeafError,
)
from grain_replay.layout import LeafSpec
from grain_replay.sources import parts_gather as gather
from grain_replay.sources import parts_snapshot as snapshots
from grain_replay.sources.base import Layout, select_keys
from grain_replay.sources.checks import as_record_index, check_indices, check_out
from grain_replay.sources.parts_snapshot import WRITER_KEY, Part, Snapshot
from grain_replay.sources.reading.runs import runs
from grain_replay.sources.surface import SourceSurface

__all__ = ["WRITER_KEY", "PartsDataSource"]


class PartsDataSource(SourceSurface):
    """The union of every writer's live rows of a bounded, many-writer store.

    Made by :func:`grain_replay.open_source` for a store written with
    ``ReplayWriter(path, capacity=..., writer_id=...)``. ``len(src)`` is the
    live rows of the snapshot; ``refresh()`` takes a new one (commits,
    evictions, new writers), re-reading only the manifests that changed.

    Args:
      path: the store directory.
      keys: leaves to read; add ``"_writer"`` for each row's writer as an
        int64 leaf (the writer's ordinal; ``src.writer_ordinals`` maps ids to
        ordinals). Default: every stored leaf, without ``"_writer"``.
      **kwargs: passed to each segment's source (e.g. ``cache_bytes``).
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {"_snap": None, "_pid": None, "_by_ordinal": None}

    def __init__(
        self, path: str | os.PathLike[str], keys: Sequence[str] | None = None, **kwargs: Any
    ) -> None:
        self._path = os.path.abspath(os.fspath(path))
        self._format = parts_lib.read_store_file(self._path)
        requested = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
        self._with_writer = requested is not None and WRITER_KEY in requested
        self._requested = None if requested is None else [k for k in requested if k != WRITER_KEY]
        if self._requested == [] and self._with_writer:
            self._requested = None
        self._only_writer = requested == [WRITER_KEY]
        self._kwargs = dict(kwargs)
        self._lock = threading.Lock()
        self._snap: Snapshot | None = None
        self._pid: int | None = None
        self._by_ordinal: tuple[Snapshot, gather.OrdinalMaps | None] | None = None
        # What a pickle carries: the manifests of the snapshot (no open files).
        self._manifests: list[tuple[parts_lib.Manifest, tuple[int, int, int] | None]] = []
        self._spec: dict[str, LeafSpec] = {}
        self._treedef: dict[str, Any] = {"type": "dict", "keys": [], "children": []}
        self._build = tree_lib.compile_unflatten(self._treedef)
        self._seg_keys: list[str] = []
        self._schema_text: str | None = None
        self.replaced = 0  # rows read_ids(evicted="replace") replaced in this process
        self.refresh()

    # -- snapshot -------------------------------------------------------------------

    def _schema(self, manifests: list[parts_lib.Manifest]) -> None:
        """Spec and treedef from the writers' schemas (which must agree)."""

        def parse(text: str) -> layout_lib.StoreMetadata:
            return layout_lib.StoreMetadata.from_json(text, where=self._path)

        first: tuple[str, layout_lib.StoreMetadata] | None = None
        first_text = first_id = None
        for m in manifests:
            if m.schema is None or m.schema == first_text:
                continue  # the same text as the first: parsed at most once
            if first_text is None:  # parsed only if another text or a new one needs it
                first_text, first_id = m.schema, m.writer_id
                continue
            first = first or (str(first_id), parse(first_text))
            meta = parse(m.schema)
            if meta.leaves != first[1].leaves or meta.treedef != first[1].treedef:
                raise InvalidStoreError(
                    f"{self._path}: writer {m.writer_id!r} wrote leaves {list(meta.leaves)} "
                    f"that do not match writer {first[0]!r}'s {list(first[1].leaves)} (or "
                    "their dtypes/shapes). Fix: remove one writer's folder under writers/, or "
                    "read it alone."
                )
        if first_text is None or first_text == self._schema_text:
            return  # nothing new: spec and treedef as they are
        first = first or (str(first_id), parse(first_text))
        self._schema_text = first_text
        meta = first[1]
        full = Layout(0, dict(meta.leaves), meta.treedef, {k: k for k in meta.leaves})
        if self._only_writer:
            chosen = Layout(0, {}, {"type": "dict", "keys": [], "children": []}, {})
        else:
            chosen = select_keys(full, self._requested, self._path)
        spec, treedef = dict(chosen.spec), chosen.treedef
        if self._with_writer:
            if treedef.get("type") != "dict" or WRITER_KEY in treedef["keys"]:
                raise UnknownLeafError(
                    f"{self._path}: keys= names {WRITER_KEY!r}, which needs records that are "
                    "dicts without a leaf of that name. Fix: drop it from keys."
                )
            treedef = {
                "type": "dict",
                "keys": [*treedef["keys"], WRITER_KEY],
                "children": [*treedef["children"], {"type": "leaf"}],
            }
            spec[WRITER_KEY] = LeafSpec(np.dtype(np.int64), ())
        self._spec, self._treedef = spec, treedef
        self._build = tree_lib.compile_unflatten(treedef)
        self._seg_keys = [k for k in spec if k != WRITER_KEY]

    def _take(self, previous: Snapshot | None) -> Snapshot:
        """A snapshot of the store now, reusing what did not change since ``previous``."""
        old = {} if previous is None else {p.manifest.writer_id: p for p in previous.parts}
        for _ in range(20):
            found: list[tuple[parts_lib.Manifest, Any, Part | None, bool]] = []
            for wid in parts_lib.list_writers(self._path):
                wdir = parts_lib.writer_dir(self._path, wid)
                stamp = snapshots.stamp(os.path.join(wdir, parts_lib.MANIFEST_FILE))
                if stamp is None:
                    continue  # no commit yet
                prev = old.get(wid)
                if prev is not None and prev.stamp == stamp:
                    found.append((prev.manifest, stamp, prev, True))
                    continue
                m = parts_lib.read_manifest(wdir)
                if m is not None:
                    found.append((m, stamp, prev, False))
            self._schema([m for m, _, _, _ in found])
            parts, ok = [], True
            for m, stamp, prev, same in found:
                if same:
                    assert prev is not None
                    parts.append(prev)
                    continue
                part = snapshots.build_part(
                    self._path, m, stamp, prev, False, self._spec, self._kwargs
                )
                if any(s.first not in part.segments for s in m.segments):
                    ok = False  # a segment went between reading the manifest and opening it
                    break
                parts.append(part)
            if ok:
                self._manifests = [(p.manifest, p.stamp) for p in parts]
                return Snapshot(parts)
        raise InvalidStoreError(
            f"{self._path}: the writers evict faster than this reader can open their "
            "segments. Fix: raise capacity (more rows per segment)."
        )

    def _restore(self) -> Snapshot:
        """This process's snapshot of the manifests a pickle carried (same positions)."""
        parts = []
        for m, stamp in self._manifests:
            try:
                parts.append(
                    snapshots.build_part(self._path, m, stamp, None, True, self._spec, self._kwargs)
                )
            except (OSError, GrainReplayError) as e:
                raise EvictedRowError(
                    f"{self._path}: writer {m.writer_id!r}: a segment of the snapshot this "
                    f"copy of the source was pickled with is gone ({e}); its rows were "
                    "evicted. Fix: read bounded stores with sampling=gr.UniformReplay() "
                    "(rows travel by id), or refresh() the source."
                ) from e
        return Snapshot(parts)

    def _snapshot(self) -> Snapshot:
        return self._per_process("_snap", self._restore)

    def refresh(self) -> int:
        """Takes a new snapshot (new commits, evictions and writers); returns its length.

        Rows of the previous snapshot stay readable by id (:meth:`read_ids`) until
        the refresh after this one.
        """
        pid = os.getpid()
        with self._lock:
            previous = self._snap if self._pid == pid else None
            snap = self._take(previous)
            self._snap, self._pid = snap, pid
        return snap.n

    # -- identity and ids -------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._path

    @property
    def format(self) -> str:
        return self._format

    @property
    def spec(self) -> Mapping[str, LeafSpec]:
        return dict(self._spec)

    @property
    def treedef(self) -> dict[str, Any]:
        return self._treedef

    @property
    def checksums(self) -> None:
        return None

    @property
    def writers(self) -> list[parts_lib.Manifest]:
        """The manifest of each writer in the snapshot, in reading order."""
        return [m for m, _ in self._manifests]

    @property
    def writer_ordinals(self) -> dict[str, int]:
        """Writer id -> its ordinal (the ``"_writer"`` leaf, the high bits of row ids)."""
        return {m.writer_id: m.ordinal for m, _ in self._manifests}

    def __len__(self) -> int:
        return sum(m.live for m, _ in self._manifests)

    def __repr__(self) -> str:
        keys = list(self._spec)
        return f"PartsDataSource(path={self._path!r}, keys={keys!r}, num_records={len(self)})"

    def ids(self, positions: Sequence[int] | np.ndarray, *, check: bool = True) -> np.ndarray:
        """The stable row id (``ordinal << 40 | seq``, int64) of each position of the snapshot.

        ``check=False`` trusts ``positions`` to be int64 in ``[0, len)`` (a sampler's draws).
        """
        snap = self._snapshot()
        if not check and len(snap.parts) == 1:
            shift = (int(snap.ordinals[0]) << parts_lib.ID_SHIFT) + int(snap.live_start[0])
            return np.asarray(positions, dtype=np.int64) + shift
        pos = check_indices(positions, snap.n, self._path)
        p, seq = snap.locate(pos)
        return (snap.ordinals[p] << parts_lib.ID_SHIFT) | seq

    def positions(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The position of each id in the snapshot, -1 where the row is not live in it."""
        snap = self._snapshot()
        ids = np.asarray(ids, dtype=np.int64)
        ordinal, seq = ids >> parts_lib.ID_SHIFT, ids & parts_lib.SEQ_MASK
        known = (ordinal >= 0) & (ordinal < len(snap.part_of_ordinal))
        p = np.where(known, snap.part_of_ordinal[np.where(known, ordinal, 0)], -1)
        pc = np.maximum(p, 0)
        live = (
            (p >= 0)
            & (seq >= snap.live_start[pc] if len(snap.parts) else False)
            & (seq < snap.committed[pc] if len(snap.parts) else False)
        )
        if not len(snap.parts):
            return np.full(ids.shape, -1, dtype=np.int64)
        return np.where(live, snap.starts[pc] + seq - snap.live_start[pc], -1)

    # -- reads --------------------------------------------------------------------------

    def _gather(
        self,
        snap: Snapshot,
        p: np.ndarray,
        seq: np.ndarray,
        keys: Sequence[str] | None = None,
    ) -> dict[str, np.ndarray]:
        """Rows ``seq`` of parts ``p``: one vectorized read per leaf per segment touched."""
        b = len(p)
        names = list(self._spec) if keys is None else list(keys)
        out = {k: np.empty((b, *self._spec[k].shape), self._spec[k].dtype) for k in names}
        if WRITER_KEY in out:
            out[WRITER_KEY][...] = snap.ordinals[p] if b else 0
        seg_keys = [k for k in names if k != WRITER_KEY]
        if not seg_keys or b == 0:
            return out
        rest = snap.gather_mapped(p, seq, seg_keys, out)
        if rest is None:
            return out
        p, seq = p[rest], seq[rest]
        seg_rows = snap.seg_rows[p]
        first = seq // seg_rows * seg_rows
        offset = seq - first
        for k, sel in runs(p * (1 << parts_lib.ID_SHIFT) + first):
            part = snap.parts[k >> parts_lib.ID_SHIFT]
            seg_first = k & parts_lib.SEQ_MASK
            src = part.segments.get(seg_first)
            offs = offset[sel]
            at = rest[sel]
            if src is None or int(offs.max()) >= part.rows.get(seg_first, 0):
                raise EvictedRowError(
                    f"{self._path}: writer {part.manifest.writer_id!r}: row "
                    f"{seg_first + int(offs.max())} is not readable in this snapshot (evicted "
                    "before this reader opened it, or not yet committed). Fix: refresh() "
                    "more often than the writers evict, or raise capacity."
                )
            if len(seg_keys) == 1:
                out[seg_keys[0]][at] = src.read_leaf(seg_keys[0], offs)
                continue
            flat = src.read_flat(offs, check=False)
            for name in seg_keys:
                out[name][at] = flat[name]
        return out

    def read_flat(
        self, indices: Sequence[int] | np.ndarray, *, check: bool = True
    ) -> dict[str, np.ndarray]:
        snap = self._snapshot()
        if check:
            idx = check_indices(indices, snap.n, self._path)
        else:
            idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + snap.n, idx)
        p, seq = snap.locate(idx)
        return self._gather(snap, p, seq)

    def read_leaf(self, key: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows ``indices`` of the single leaf ``key``."""
        if key not in self._spec:
            raise UnknownLeafError(f"{self._path}: no leaf {key!r}; leaves: {list(self._spec)}")
        snap = self._snapshot()
        idx = check_indices(indices, snap.n, self._path)
        p, seq = snap.locate(idx)
        return self._gather(snap, p, seq, [key])[key]

    def writer_starts(self) -> np.ndarray:
        """The position of each writer's oldest live row in the snapshot (episode views cut
        episodes there: no episode or window runs from one writer's rows into another's)."""
        return self._snapshot().starts[:-1].copy()

    def segments(self) -> list[tuple[str, int, int, str]]:
        """``(writer_id, first row, committed rows, path)`` of each live segment of the snapshot."""
        out = []
        for m, _ in self._manifests:
            wdir = parts_lib.writer_dir(self._path, m.writer_id)
            for seg in m.segments:
                path = os.path.join(wdir, parts_lib.segment_name(seg.first, m.format))
                out.append((m.writer_id, seg.first, seg.rows, path))
        return out

    def read_batch(self, indices: Sequence[int] | np.ndarray, *, check: bool = True) -> Any:
        return self._build(self.read_flat(indices, check=check))

    def read_into(
        self,
        indices: Sequence[int] | np.ndarray,
        out: Mapping[str, np.ndarray],
        *,
        check: bool = True,
    ) -> None:
        if check:
            check_out(out, self._spec, len(np.asarray(indices).reshape(-1)), self._path)
        flat = self.read_flat(indices, check=check)
        for k, dst in out.items():
            dst[...] = flat[k]

    def read_ids(self, ids: Sequence[int] | np.ndarray, *, evicted: str = "raise") -> Any:
        """Records by row id; see :meth:`read_ids_flat`."""
        return self._build(self.read_ids_flat(ids, evicted=evicted))

    def read_ids_flat(
        self, ids: Sequence[int] | np.ndarray, *, evicted: str = "raise"
    ) -> dict[str, np.ndarray]:
        """Records by row id (see :meth:`ids`), from this snapshot or the one before it.

        An id newer than the snapshot takes a new one first. A row drawn from an
        older snapshot that has been evicted since is read from the segment this
        process still holds open (segments stay open one refresh longer, and the
        writer keeps its newest evicted segment on disk).

        Args:
          ids: row ids, any shape (flattened).
          evicted: what to do with a row whose segment this process never opened
            and which is gone: ``"raise"``, or ``"replace"`` it with a live row
            of the same writer (``live_start + (seq - live_start) % live``, a
            function of the snapshot): uniform replay does, since that row is
            as good a uniform draw. Every row returned is whole, as committed.

        Raises:
          EvictedRowError: with ``evicted="raise"``, a row that cannot be read any more.
        """
        return self._read_ids(ids, evicted)[0]

    def read_ids_checked(self, ids: Sequence[int] | np.ndarray) -> tuple[Any, np.ndarray]:
        """Records by row id, and which of them are the rows asked for.

        As ``read_ids(ids, evicted="replace")``, with a bool mask that is False where
        a row could not be read any more and another live row of its writer stands in
        (a caller that names rows by id, such as prioritized replay, drops those).
        """
        flat, ok = self._read_ids(ids, "replace")
        return self._build(flat), ok

    def _read_ids(
        self, ids: Sequence[int] | np.ndarray, evicted: str
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        try:
            snap = self._snapshot()
        except EvictedRowError:  # a pickled snapshot whose segments went: take a new one
            self.refresh()
            snap = self._snapshot()
        if len(snap.parts) == 1 and len(ids) and snap.parts[0].mapped is not None:
            # One writer whose live rows are mapped: one gather per leaf, no grouping.
            m = snap.parts[0].mapped
            rows = ids - ((int(snap.ordinals[0]) << parts_lib.ID_SHIFT) + m.base)
            if int(rows.min()) >= 0 and int(rows.max()) < m.stop - m.base:
                out = {k: np.take(m.arrays[k], rows, axis=0) for k in self._seg_keys}
                if WRITER_KEY in self._spec:
                    out[WRITER_KEY] = np.full(len(ids), snap.ordinals[0], dtype=np.int64)
                return {k: out[k] for k in self._spec}, np.ones(len(ids), dtype=bool)
        elif len(snap.parts) > 1 and len(ids):
            fast = self._read_mapped(snap, ids)
            if fast is not None:
                return fast, np.ones(len(ids), dtype=bool)
        ordinal, seq = ids >> parts_lib.ID_SHIFT, ids & parts_lib.SEQ_MASK
        for attempt in range(2):
            known = (ordinal >= 0) & (ordinal < len(snap.part_of_ordinal))
            p = np.where(known, snap.part_of_ordinal[np.where(known, ordinal, 0)], -1)
            ahead = (p < 0) | (seq >= snap.committed[np.maximum(p, 0)])
            if not ahead.any() or attempt:
                break
            self.refresh()
            snap = self._snapshot()
        if (p < 0).any():
            raise EvictedRowError(
                f"{self._path}: no writer with ordinal {int(ordinal[p < 0][0])} in the store. "
                "Fix: pass ids returned by src.ids() of this store."
            )
        ok = snap.readable(p, seq)
        if not ok.all():
            bad = int(np.argmin(ok))
            part = snap.parts[int(p[bad])]
            if evicted != "replace" or part.manifest.live == 0:
                raise EvictedRowError(
                    f"{self._path}: writer {part.manifest.writer_id!r}: row {int(seq[bad])} "
                    "was evicted before this reader opened its segment. Fix: refresh() "
                    "more often than the writers evict, or raise capacity."
                )
            start, live = snap.live_start[p], snap.committed[p] - snap.live_start[p]
            seq = np.where(ok, seq, start + (seq - start) % np.maximum(live, 1))
            self.replaced += int((~ok).sum())
        return self._gather(snap, p, seq), ok

    def _read_mapped(self, snap: Snapshot, ids: np.ndarray) -> dict[str, np.ndarray] | None:
        """Rows ``ids`` when each lies in its writer's back-to-back map (see
        :mod:`~grain_replay.sources.parts_gather`; its tables kept per snapshot)."""
        cached = self._by_ordinal
        if cached is None or cached[0] is not snap:
            cached = self._by_ordinal = (snap, gather.ordinal_maps(snap))
        if cached[1] is None:
            return None
        out = gather.read_mapped(cached[1], ids, self._spec, self._seg_keys)
        if out is not None and WRITER_KEY in self._spec:
            out[WRITER_KEY] = ids >> parts_lib.ID_SHIFT
        return None if out is None else {k: out[k] for k in self._spec}

    def __getitem__(self, index: int) -> Any:
        i = as_record_index(index, self)
        n = len(self)
        if not -n <= i < n:
            raise RecordIndexError(
                f"{self._path}: record index {i} is out of range for a store of {n} records "
                f"(valid: -{n} <= index < {n})."
            )
        flat = self.read_flat(np.array([i % n], dtype=np.int64), check=False)
        return self._build({k: v[0] for k, v in flat.items()})

    def close(self) -> None:
        """Drops this process's snapshot; reading again restores it (or refresh())."""
        with self._lock:
            snap, self._snap = self._snap, None
            if snap is not None and self._pid == os.getpid():
                for part in snap.parts:
                    for src in part.segments.values():
                        with contextlib.suppress(Exception):
                            src.close()
            self._pid = None
