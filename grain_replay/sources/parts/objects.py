"""The reader of a bounded, many-writer store on object storage: every writer's live rows.

A snapshot (taken at construction and at each :meth:`ObjectPartsDataSource.refresh`) is
each writer's newest manifest version; its rows are read from the piece objects it
names (:mod:`~grain_replay.sources.parts.piece_reader`): whole pieces, fetched once (one
GET each, a batch's all at once) into a bounded LRU (``cache_bytes``) that packs their
rows one array per leaf, so a warm batch is one take per leaf; a piece larger than the
cache (or ``cache_bytes=0``) is read with ranged GETs, all of a batch's at once.
Writers delete a piece only ``evict_grace_s`` after the last manifest version naming it
was superseded, so a snapshot younger than that reads every row of it (objects have no
open-after-unlink); rows of the snapshot before it stay readable by id the same way.
Positions, ids and stand-ins follow :class:`~grain_replay.sources.parts.PartsDataSource`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import (
    EvictedRowError,
    StoreNotFoundError,
    UnknownLeafError,
)
from grain_replay.remote.options import redact_url
from grain_replay.sources.checks import as_record_index, check_indices, record_in_range
from grain_replay.sources.parts import ids as parts_ids
from grain_replay.sources.parts.object_snapshot import ObjectPart, ObjectSnapshot
from grain_replay.sources.parts.piece_cache import DEFAULT_PIECE_CACHE_BYTES, check_cache_bytes
from grain_replay.sources.parts.piece_reader import PieceReader
from grain_replay.sources.parts.schema import WRITER_KEY, read_schema, select_leaves
from grain_replay.sources.surface import SourceSurface, current_pid
from grain_replay.store import parts as parts_lib
from grain_replay.store.layout import LeafSpec, StoreMetadata
from grain_replay.store.object_folder import ObjectFolder, ObjectInsertedCount
from grain_replay.store.object_manifest import ObjectManifest
from grain_replay.store.objects import ObjectStore

__all__ = ["ObjectPartsDataSource"]


class ObjectPartsDataSource(SourceSurface):
    """The union of every writer's live rows of a many-writer store on object storage.

    Made by :func:`grain_replay.open_source` for an ``s3://`` URL written with
    ``gr.ReplayWriter(url, capacity=..., writer_id=..., storage_options=...)``. As
    :class:`~grain_replay.sources.parts.PartsDataSource` (``len``, ``refresh()``, ids,
    ``read_ids``, the ``"_writer"`` leaf, views and replay), over objects: a batch fetches
    each piece it touches that is not cached yet whole (one GET each, all sent at once)
    into an LRU bounded by ``cache_bytes`` that holds the rows of the leaves read packed
    one array per leaf, and reads cached rows with one take per leaf (pieces never
    change: nothing to invalidate). A piece larger than the cache, or ``cache_bytes=0``,
    is read with one ranged GET per leaf per run of rows.
    See docs/replay_store.md#on-object-storage.

    Args:
      url: the store (``s3://bucket/path``).
      keys: leaves to read, plus ``"_writer"`` for each row's writer ordinal.
      storage_options: fsspec options (endpoint, credentials).
      cache_bytes: bound of the cache of whole pieces (the rows of the leaves read and
        their row index), per process (default 256 MiB; a pickled copy, e.g. a loader
        worker's, starts empty); 0 disables it.
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {"_objects": None, "_pid": None, "_reader": None}

    def __init__(
        self,
        url: str,
        keys: Sequence[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache_bytes: int = DEFAULT_PIECE_CACHE_BYTES,
    ) -> None:
        import threading

        self._url = str(url).rstrip("/")
        self._cache_bytes = check_cache_bytes(cache_bytes, redact_url(self._url))
        self._reader: PieceReader | None = None
        self._options = dict(storage_options or {})
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._objects: ObjectStore | None = None
        requested = None if keys is None else [keys] if isinstance(keys, str) else list(keys)
        self._with_writer = requested is not None and WRITER_KEY in requested
        self._requested = None if requested is None else [k for k in requested if k != WRITER_KEY]
        if self._requested == [] and self._with_writer:
            self._requested = None
        self._only_writer = requested == [WRITER_KEY]
        found = self._store().read_store_file()
        if found is None:
            raise StoreNotFoundError(
                f"{redact_url(self._url)}: no many-writer store there (no replay_store.json). "
                "Fix: check the URL, or start a writer of it first (open_source(..., wait=60))."
            )
        self._store_id = found.get("store_id")
        self._spec: dict[str, LeafSpec] = {}
        self._treedef: dict[str, Any] = {"type": "dict", "keys": [], "children": []}
        self._build = tree_lib.compile_unflatten(self._treedef)
        self._full: StoreMetadata | None = None  # every stored leaf, in piece order
        self._schema_text: str | None = None
        self._snap = ObjectSnapshot.of([])
        self.replaced = 0
        self.refresh()

    def _store(self) -> ObjectStore:
        return self._per_process("_objects", lambda: ObjectStore(self._url, self._options))

    def _piece_reader(self) -> PieceReader:
        """This process's reader of pieces (and its cache): one made in another process
        (inherited across a fork) is replaced by an empty one."""
        reader = self._reader
        if reader is None or reader.pid != current_pid():
            with self._lock:
                reader = self._reader
                if reader is None or reader.pid != current_pid():
                    assert self._full is not None
                    leaves = {k: v for k, v in self._spec.items() if k != WRITER_KEY}
                    reader = PieceReader(self.path, self._full.leaves, leaves, self._cache_bytes)
                    self._reader = reader
        return reader

    @property
    def cached_bytes(self) -> int:
        """Bytes of whole pieces this process holds in memory now (their rows packed one
        array per leaf, with the row index; at most ``cache_bytes``)."""
        reader = self._reader
        return 0 if reader is None or reader.pid != current_pid() else reader.nbytes

    # -- snapshot -----------------------------------------------------------------------

    def refresh(self) -> int:
        """Takes a new snapshot (each writer's newest manifest version); returns its length.

        Rows of the previous snapshot stay readable by id until the refresh after this one
        (for ``evict_grace_s`` at least: the writers keep the pieces that long).
        """
        store = self._store()
        with self._lock:
            old = {p.manifest.writer_id: p for p in self._snap.parts}
            parts = []
            for wid in store.list_writers():
                versions = store.manifest_versions(wid)
                prev = old.get(wid)
                if prev is not None and versions and versions[-1][0] == prev.manifest.version:
                    parts.append(prev)
                    continue
                m = store.newest_manifest(wid)
                if m is None or m.schema is None:
                    continue  # no row committed yet
                parts.append(ObjectPart.of(m, prev))
            self._schema([p.manifest for p in parts])
            self._snap = ObjectSnapshot.of(parts)
        reader = self._reader
        if reader is not None and reader.pid == current_pid():
            reader.keep_only(self._snap)  # pieces no longer named are never read again
        return self._snap.n

    def _schema(self, manifests: list[ObjectManifest]) -> None:
        found = read_schema(redact_url(self._url), [m.as_manifest() for m in manifests])
        if found is None or found[0] == self._schema_text:
            return
        self._schema_text, meta = found
        self._full = meta
        self._spec, self._treedef = select_leaves(
            redact_url(self._url), meta, self._requested, with_writer=self._with_writer,
            only_writer=self._only_writer,
        )  # fmt: skip
        self._build = tree_lib.compile_unflatten(self._treedef)
        self._reader = None  # its cache holds the leaves of the schema before

    # -- identity -----------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The store's URL (as given, credentials in it redacted)."""
        return redact_url(self._url)

    @property
    def format(self) -> str:
        return "npy"

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
        """Each writer's manifest in the snapshot (as a POSIX part's), in reading order."""
        return [p.manifest.as_manifest() for p in self._snap.parts]

    @property
    def writer_ordinals(self) -> dict[str, int]:
        return {p.manifest.writer_id: p.manifest.ordinal for p in self._snap.parts}

    @property
    def manifest_versions(self) -> dict[str, int]:
        """Writer id -> the manifest version of the snapshot (its commit count, takeovers
        included)."""
        return {p.manifest.writer_id: p.manifest.version for p in self._snap.parts}

    @property
    def store_id(self) -> str | None:
        return None if self._store_id is None else str(self._store_id)

    def current_store_id(self) -> str | None:
        found = self._store().read_store_file()
        return None if found is None else found.get("store_id")

    def learners_folder(self) -> ObjectFolder:
        """Where rate-limited learners of this store publish (``learners/`` in the bucket)."""
        return ObjectFolder(self._store())

    def inserted_count(self) -> ObjectInsertedCount:
        """Every writer's committed and live rows, from the newest manifest versions."""
        return ObjectInsertedCount(self._store())

    def committed_rows(self) -> dict[str, int]:
        """Each writer's committed rows in the store now (its newest manifest version)."""
        return self._store().committed_rows()

    def __len__(self) -> int:
        return self._snap.n

    def __repr__(self) -> str:
        return (
            f"ObjectPartsDataSource(url={self.path!r}, keys={list(self._spec)!r}, "
            f"num_records={len(self)})"
        )

    def ids(self, positions: Sequence[int] | np.ndarray, *, check: bool = True) -> np.ndarray:
        snap = self._snap
        if check:
            return snap.ids_at(check_indices(positions, snap.n, self.path))
        return snap.ids_at(np.asarray(positions, dtype=np.int64))

    def positions(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        snap = self._snap
        ids = np.asarray(ids, dtype=np.int64)
        if not snap.parts:
            return np.full(ids.shape, -1, dtype=np.int64)
        p, seq, _ = snap.locate_ids(ids)
        pc = np.maximum(p, 0)
        live = (p >= 0) & (seq >= snap.live_start[pc]) & (seq < snap.committed[pc])
        return np.where(live, snap.starts[pc] + seq - snap.live_start[pc], -1)

    def writer_starts(self) -> np.ndarray:
        return self._snap.starts[:-1].copy()

    def segments(self) -> list[tuple[str, int, int, str]]:
        """``(writer_id, first row, rows, object URL)`` of each live piece of the snapshot."""
        store = self._store()
        return [
            (p.manifest.writer_id, piece.first, piece.rows,
             store.piece_key(p.manifest.writer_id, piece))
            for p in self._snap.parts
            for piece in p.manifest.pieces
        ]  # fmt: skip

    # -- reads ----------------------------------------------------------------------------

    def _gather(
        self, snap: ObjectSnapshot, ids: np.ndarray, keys: Sequence[str] | None = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The rows ``ids`` and which of them were read (False: no piece of the snapshot
        holds it, or its piece is gone from the bucket)."""
        names = list(self._spec) if keys is None else list(keys)
        b = len(ids)
        out = {k: np.empty((b, *self._spec[k].shape), self._spec[k].dtype) for k in names}
        if WRITER_KEY in out:
            out[WRITER_KEY][...] = parts_lib.id_ordinals(ids)
        stored = {k: v for k, v in out.items() if k != WRITER_KEY}
        if not stored:
            return out, snap.pieces_of(ids)[2]
        return out, self._piece_reader().read(self._store(), snap, ids, stored)

    def _evicted(self, snap: ObjectSnapshot, ids: np.ndarray, ok: np.ndarray) -> None:
        ordinal, seq = parts_lib.split_ids(int(ids[int(np.argmin(ok))]))
        p = snap.part_of_ordinal[ordinal] if 0 <= ordinal < len(snap.part_of_ordinal) else -1
        writer = f"ordinal {ordinal}" if p < 0 else repr(snap.parts[p].manifest.writer_id)
        raise EvictedRowError(
            f"{self.path}: writer {writer}: row {seq} cannot be read any more (its piece was "
            "deleted, past the writers' evict_grace_s, or is not in this snapshot). Fix: "
            "refresh() more often than evict_grace_s, raise the writers' evict_grace_s or "
            "capacity, or read by id with evicted='replace'."
        )

    def _read_positions(
        self, indices: Sequence[int] | np.ndarray, keys: Sequence[str] | None, check: bool
    ) -> dict[str, np.ndarray]:
        snap = self._snap
        if check:
            idx = check_indices(indices, snap.n, self.path)
        else:
            idx = np.asarray(indices, dtype=np.int64)
        ids = snap.ids_at(idx)
        out, ok = self._gather(snap, ids, keys)
        if not ok.all():
            self._evicted(snap, ids, ok)
        return out

    def read_flat(
        self, indices: Sequence[int] | np.ndarray, *, check: bool = True
    ) -> dict[str, np.ndarray]:
        return self._read_positions(indices, None, check)

    def read_leaf(self, key: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        if key not in self._spec:
            raise UnknownLeafError(
                f"{self.path}: no leaf {key!r}; leaves: {list(self._spec)}. Fix: pass one of "
                "those (or open the source with keys= naming it)."
            )
        return self._read_positions(indices, [key], True)[key]

    def read_ids(self, ids: Sequence[int] | np.ndarray, *, evicted: str = "raise") -> Any:
        return self._build(self.read_ids_flat(ids, evicted=evicted))

    def read_ids_flat(
        self, ids: Sequence[int] | np.ndarray, *, evicted: str = "raise"
    ) -> dict[str, np.ndarray]:
        """Records by row id, from this snapshot or the one before it (see
        :meth:`grain_replay.sources.parts.PartsDataSource.read_ids_flat`)."""
        return self._read_ids(ids, evicted)[0]

    def read_ids_checked(self, ids: Sequence[int] | np.ndarray) -> tuple[Any, np.ndarray]:
        flat, ok = self._read_ids(ids, "replace")
        return self._build(flat), ok

    def _read_ids(
        self, ids: Sequence[int] | np.ndarray, evicted: str
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        evicted = parts_ids.check_evicted(evicted, self.path)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        snap = self._snap
        out, ok = self._gather(snap, ids)  # every row in a piece of the snapshot: done
        if ok.all():
            return out, ok
        p, _, ahead = snap.locate_ids(ids)
        if ahead.any():  # rows newer than the snapshot: a new one may hold them
            self.refresh()
            snap = self._snap
            p, _, _ = snap.locate_ids(ids)
            if not (p < 0).any():
                out, ok = self._gather(snap, ids)
        if (p < 0).any():
            raise EvictedRowError(
                f"{self.path}: no writer with ordinal "
                f"{parts_lib.id_ordinals(int(ids[p < 0][0]))} in the store. Fix: pass ids "
                "returned by src.ids() of this store."
            )
        if ok.all():
            return out, ok
        if evicted != "replace":
            self._evicted(snap, ids, ok)
        # Stand-ins: a live row of the same writer, read from a snapshot taken now (the
        # pieces of an old one may be gone).
        self.refresh()
        snap = self._snap
        q, seq, _ = snap.locate_ids(ids)
        if (q < 0).any() or (snap.committed[q] - snap.live_start[q] <= 0).any():
            self._evicted(snap, ids, ok)
        start, live = snap.live_start[q], snap.committed[q] - snap.live_start[q]
        bad = np.flatnonzero(~ok)
        stand = start[bad] + (seq[bad] - start[bad]) % np.maximum(live[bad], 1)
        stand_ids = parts_lib.make_ids(snap.ordinals[q[bad]], stand)
        again, read = self._gather(snap, stand_ids)
        if not read.all():
            self._evicted(snap, stand_ids, read)
        for k in out:
            out[k][bad] = again[k]
        self.replaced += len(bad)
        return out, ok

    def __getitem__(self, index: int) -> Any:
        i = record_in_range(as_record_index(index, self), len(self), self.path)
        flat = self.read_flat(np.array([i], dtype=np.int64), check=False)
        return self._build({k: v[0] for k, v in flat.items()})

    def close(self) -> None:
        """Drops this process's connection objects (reading again makes new ones)."""
        with self._lock:
            self._objects = None
            self._pid = None
