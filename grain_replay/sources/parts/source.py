"""The reader of a bounded, many-writer store: the union of every writer's live rows.

A snapshot (taken at construction and at each :meth:`PartsDataSource.refresh`)
is every writer's manifest plus the segment stores they name, opened (mapped)
at once: evictions after it unlink files this process keeps open, so the
snapshot's rows stay readable, each exactly as committed, until the next
refresh. Writers are in sorted id order, each oldest row first; position ``i``
of a snapshot is one writer's row ``seq``, whose id is ``ordinal << 40 | seq``.
The snapshot itself (opening, mapping, schema) is :mod:`~grain_replay.sources.parts.snapshot`;
the id arithmetic behind reads by id is :mod:`~grain_replay.sources.parts.ids`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import (
    EvictedRowError,
    GrainReplayError,
    UnknownLeafError,
)
from grain_replay.sources.checks import as_record_index, check_indices, check_out, record_in_range
from grain_replay.sources.parts import catch_up, gather
from grain_replay.sources.parts import ids as parts_ids
from grain_replay.sources.parts import snapshot as snapshots
from grain_replay.sources.parts.schema import WRITER_KEY, read_schema, select_leaves
from grain_replay.sources.parts.snapshot import Snapshot
from grain_replay.sources.surface import SourceSurface, current_pid
from grain_replay.store import parts as parts_lib
from grain_replay.store.layout import LeafSpec

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
        self._store_id = parts_lib.read_store_id(self._path)
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

    def _schema(self, manifests: list[parts_lib.Manifest]) -> dict[str, LeafSpec]:
        """Spec and treedef from the writers' schemas (which must agree); returns the spec."""
        found = read_schema(self._path, manifests)
        if found is None or found[0] == self._schema_text:
            return self._spec  # nothing new: spec and treedef as they are
        self._schema_text, meta = found
        spec, treedef = select_leaves(
            self._path, meta, self._requested, with_writer=self._with_writer,
            only_writer=self._only_writer,
        )  # fmt: skip
        self._spec, self._treedef = spec, treedef
        self._build = tree_lib.compile_unflatten(treedef)
        self._seg_keys = [k for k in spec if k != WRITER_KEY]
        return spec

    def _take(self, previous: Snapshot | None) -> Snapshot:
        """A snapshot of the store now, reusing what did not change since ``previous``
        (:func:`~grain_replay.sources.parts.catch_up.take_snapshot`)."""
        snap = catch_up.take_snapshot(self._path, previous, self._schema, self._kwargs)
        self._manifests = [(p.manifest, p.stamp) for p in snap.parts]
        return snap

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
        pid = current_pid()
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

    def committed_rows(self) -> dict[str, int]:
        """Each writer's committed rows (evicted ones included) in the store now.

        Re-reads the manifests on disk, not the snapshot (which stays as it is): what a
        restored checkpoint's watermark is checked against.
        """
        return parts_lib.committed_rows(self._path)

    @property
    def store_id(self) -> str | None:
        """The id the store had when this source opened it (None: made before ids)."""
        return self._store_id

    def current_store_id(self) -> str | None:
        """The id of the store at :attr:`path` now: another one than :attr:`store_id`
        once the store was deleted and made again there."""
        return parts_lib.read_store_id(self._path)

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
        return parts_ids.ids_at(self._snapshot(), positions, check=check, where=self._path)

    def positions(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The position of each id in the snapshot, -1 where the row is not live in it."""
        return parts_ids.positions_of(self._snapshot(), ids)

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
        snap.gather_segments(p, seq, rest, seg_keys, out, self._path)
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
        evicted = parts_ids.check_evicted(evicted, self._path)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        try:
            snap = self._snapshot()
        except EvictedRowError:  # a pickled snapshot whose segments went: take a new one
            self.refresh()
            snap = self._snapshot()
        fast = parts_ids.read_mapped(snap, ids, self._seg_keys, list(self._spec))
        if fast is None and len(snap.parts) > 1 and len(ids):
            fast = self._read_mapped(snap, ids)  # several writers, each mapped
        if fast is not None:
            return fast, np.ones(len(ids), dtype=bool)
        for attempt in range(2):
            p, seq, ahead = parts_ids.locate_ids(snap, ids)
            if not ahead.any() or attempt:
                break
            self.refresh()
            snap = self._snapshot()
        seq, ok = parts_ids.stand_ins(snap, ids, p, seq, evicted, self._path)
        self.replaced += int((~ok).sum())
        return self._gather(snap, p, seq), ok

    def _read_mapped(self, snap: Snapshot, ids: np.ndarray) -> dict[str, np.ndarray] | None:
        """Rows ``ids`` when each lies in its writer's back-to-back map (see
        :mod:`~grain_replay.sources.parts.gather`; its tables kept per snapshot)."""
        cached = self._by_ordinal
        if cached is None or cached[0] is not snap:
            cached = self._by_ordinal = (snap, gather.ordinal_maps(snap))
        if cached[1] is None:
            return None
        out = gather.read_mapped(cached[1], ids, self._spec, self._seg_keys)
        if out is not None and WRITER_KEY in self._spec:
            out[WRITER_KEY] = parts_lib.id_ordinals(ids)
        return None if out is None else {k: out[k] for k in self._spec}

    def __getitem__(self, index: int) -> Any:
        i = record_in_range(as_record_index(index, self), len(self), self._path)
        flat = self.read_flat(np.array([i], dtype=np.int64), check=False)
        return self._build({k: v[0] for k, v in flat.items()})

    def close(self) -> None:
        """Drops this process's snapshot; reading again restores it (or refresh())."""
        with self._lock:
            snap, self._snap = self._snap, None
            if snap is not None and self._pid == current_pid():
                for part in snap.parts:
                    for src in part.segments.values():
                        with contextlib.suppress(Exception):
                            src.close()
            self._pid = None
