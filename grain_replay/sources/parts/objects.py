"""The reader of a bounded, many-writer store on object storage: every writer's live rows.

A snapshot (taken at construction and at each :meth:`ObjectPartsDataSource.refresh`) is
each writer's newest manifest version; its rows are read from the piece objects it
names: whole pieces, fetched once (one GET each, a batch's all at once) into a bounded
LRU of piece bytes (``cache_bytes``) and copied from memory after; a piece larger than
the cache (or ``cache_bytes=0``) is read with ranged GETs, all of a batch's at once.
Writers delete a piece only ``evict_grace_s`` after the last manifest version naming it
was superseded, so a snapshot younger than that reads every row of it (objects have no
open-after-unlink); rows of the snapshot before it stay readable by id the same way.
Positions, ids and stand-ins follow :class:`~grain_replay.sources.parts.PartsDataSource`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import (
    EvictedRowError,
    InvalidStoreError,
    StoreNotFoundError,
    UnknownLeafError,
)
from grain_replay.remote.options import redact_url
from grain_replay.sources.checks import as_record_index, check_indices, record_in_range
from grain_replay.sources.parts import ids as parts_ids
from grain_replay.sources.parts import snapshot as snapshots
from grain_replay.sources.parts.object_snapshot import ObjectPart, ObjectSnapshot
from grain_replay.sources.parts.piece_cache import (
    DEFAULT_PIECE_CACHE_BYTES,
    PieceCache,
    check_cache_bytes,
)
from grain_replay.sources.parts.snapshot import WRITER_KEY
from grain_replay.sources.surface import SourceSurface
from grain_replay.store import parts as parts_lib
from grain_replay.store.layout import LeafSpec, StoreMetadata
from grain_replay.store.object_folder import ObjectFolder, ObjectInsertedCount
from grain_replay.store.object_manifest import ObjectManifest, leaf_offsets
from grain_replay.store.objects import ObjectStore

__all__ = ["ObjectPartsDataSource"]

# Rows of one piece closer than this many bytes apart are fetched by one ranged GET.
_MERGE_GAP_BYTES = 64 * 1024


class ObjectPartsDataSource(SourceSurface):
    """The union of every writer's live rows of a many-writer store on object storage.

    Made by :func:`grain_replay.open_source` for an ``s3://`` URL written with
    ``gr.ReplayWriter(url, capacity=..., writer_id=..., storage_options=...)``. As
    :class:`~grain_replay.sources.parts.PartsDataSource` (``len``, ``refresh()``, ids,
    ``read_ids``, the ``"_writer"`` leaf, views and replay), over objects: a batch fetches
    each piece it touches that is not cached yet whole (one GET each, all sent at once)
    into an LRU of piece bytes bounded by ``cache_bytes``, and copies rows of cached
    pieces from memory (pieces never change: nothing to invalidate). A piece larger than
    the cache, or ``cache_bytes=0``, is read with one ranged GET per leaf per run of rows.
    See docs/replay_store.md#on-object-storage.

    Args:
      url: the store (``s3://bucket/path``).
      keys: leaves to read, plus ``"_writer"`` for each row's writer ordinal.
      storage_options: fsspec options (endpoint, credentials).
      cache_bytes: bound of the cache of whole pieces, per process (default 256 MiB; a
        pickled copy, e.g. a loader worker's, starts empty); 0 disables it.
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {"_objects": None, "_pid": None, "_pieces": None}

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
        self._pieces: PieceCache | None = None
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

    def _piece_cache(self) -> PieceCache | None:
        """This process's cache of whole pieces (None: disabled). A cache made in another
        process (inherited across a fork) is replaced by an empty one."""
        if not self._cache_bytes:
            return None
        cache = self._pieces
        if cache is None or cache.pid != os.getpid():
            with self._lock:
                cache = self._pieces
                if cache is None or cache.pid != os.getpid():
                    cache = self._pieces = PieceCache(self._cache_bytes)
        return cache

    @property
    def cached_bytes(self) -> int:
        """Bytes of whole pieces this process holds in memory now (at most
        ``cache_bytes``)."""
        cache = self._pieces
        return 0 if cache is None or cache.pid != os.getpid() else cache.nbytes

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
        cache = self._pieces
        if cache is not None:  # pieces no longer in the snapshot are never read again
            cache.keep_only({(p.manifest.writer_id, n) for p in self._snap.parts for n in p.names})
        return self._snap.n

    def _schema(self, manifests: list[ObjectManifest]) -> None:
        found = snapshots.read_schema(redact_url(self._url), [m.as_manifest() for m in manifests])
        if found is None or found[0] == self._schema_text:
            return
        self._schema_text, meta = found
        self._full = meta
        self._spec, self._treedef = snapshots.select_leaves(
            redact_url(self._url), meta, self._requested, with_writer=self._with_writer,
            only_writer=self._only_writer,
        )  # fmt: skip
        self._build = tree_lib.compile_unflatten(self._treedef)

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
        pos = (
            check_indices(positions, snap.n, self.path)
            if check
            else np.asarray(positions, dtype=np.int64)
        )
        p, seq = snap.locate(pos)
        return parts_lib.make_ids(snap.ordinals[p], seq)

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
        self,
        snap: ObjectSnapshot,
        p: np.ndarray,
        seq: np.ndarray,
        keys: Sequence[str] | None = None,
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Rows ``seq`` of parts ``p`` and which of them were read (False: its piece is not
        in the snapshot, or gone from the bucket)."""
        names = list(self._spec) if keys is None else list(keys)
        b = len(p)
        out = {k: np.empty((b, *self._spec[k].shape), self._spec[k].dtype) for k in names}
        if WRITER_KEY in out:
            out[WRITER_KEY][...] = snap.ordinals[p] if b else 0
        seg_keys = [k for k in names if k != WRITER_KEY]
        piece, ok = snap.piece_of(p, seq) if b else (np.zeros(0, np.int64), np.ones(0, bool))
        if not seg_keys or not b or not ok.any():
            return out, ok
        assert self._full is not None
        store = self._store()
        cache = self._piece_cache()
        keys_, starts, ends, plan = [], [], [], []
        whole: list[tuple[tuple[str, str], int, int, np.ndarray]] = []
        one = leaf_offsets(self._full.leaves, 1)  # a piece of n rows: offsets n times these
        row_bytes = sum(row for _, row in one.values())
        rows_at = np.flatnonzero(ok)
        group = parts_lib.make_ids(p[rows_at], piece[rows_at])  # (part, piece) packed
        order = np.argsort(group, kind="stable")
        srt = rows_at[order]  # rows grouped by piece
        edges = [0, *(np.flatnonzero(np.diff(group[order])) + 1).tolist(), len(srt)]
        heads = srt[edges[:-1]]
        g_part, g_piece = p[heads].tolist(), piece[heads].tolist()
        # Rows copied from cached pieces land in ``staged`` in grouped order (one take per
        # leaf per piece into a slice), then in ``out`` by one scatter per leaf.
        staged = {k: np.empty((len(srt), *self._spec[k].shape), self._spec[k].dtype)
                  for k in (seg_keys if cache is not None else ())}  # fmt: skip
        filled = np.zeros(len(srt), dtype=bool)
        for g in range(len(heads)):
            lo_g, hi_g = edges[g], edges[g + 1]
            part, j = snap.parts[g_part[g]], g_piece[g]
            first, count = int(part.firsts[j]), int(part.rows[j])
            sel = srt[lo_g:hi_g]
            local = seq[sel] - first
            if cache is not None and cache.fits(row_bytes * count):
                views = cache.get((part.manifest.writer_id, part.names[j]))
                if views is None:
                    whole.append(((part.manifest.writer_id, part.names[j]), count, g, local))
                    continue
                for name in seg_keys:  # one take per leaf
                    views[name].take(local, axis=0, out=staged[name][lo_g:hi_g], mode="clip")
                filled[lo_g:hi_g] = True
                continue
            key = f"{store.writer_key(part.manifest.writer_id, 'pieces')}/{part.names[j]}"
            offs = leaf_offsets(self._full.leaves, count)
            by_row = np.argsort(local, kind="stable")
            sel, local = sel[by_row], local[by_row]
            for name in seg_keys:
                at, row = offs[name]
                gap = max(1, _MERGE_GAP_BYTES // max(row, 1))
                cuts = np.flatnonzero(np.diff(local) > gap) + 1
                for run_sel, run in zip(np.split(sel, cuts), np.split(local, cuts), strict=True):
                    lo, hi = int(run[0]), int(run[-1]) + 1
                    keys_.append(key)
                    starts.append(at + lo * row)
                    ends.append(at + hi * row)
                    plan.append((name, run_sel, run - lo))
        # One request list: the whole pieces to cache, then the ranges (network I/O
        # outside every lock).
        piece_keys = [f"{store.writer_key(w, 'pieces')}/{n}" for (w, n), *_ in whole]
        got = store.cat_ranges(
            piece_keys + keys_,
            [0] * len(whole) + starts,
            [row_bytes * count for _, count, _, _ in whole] + ends,
        )
        for (name_key, count, g, local), key, data in zip(
            whole, piece_keys, got[: len(whole)], strict=True
        ):
            lo_g, hi_g = edges[g], edges[g + 1]
            if isinstance(data, FileNotFoundError):
                ok[srt[lo_g:hi_g]] = False  # deleted: past the grace period
                continue
            if isinstance(data, BaseException):
                raise data
            if len(data) != row_bytes * count:
                raise InvalidStoreError(
                    f"{self.path}: piece {key!r} holds {len(data)} bytes, its manifest "
                    f"promises {row_bytes * count}. Fix: the store was changed by something "
                    "other than its writers; write it again."
                )
            views = self._views(data, count)
            assert cache is not None
            cache.put(name_key, views, len(data))
            for name in seg_keys:
                views[name].take(local, axis=0, out=staged[name][lo_g:hi_g], mode="clip")
            filled[lo_g:hi_g] = True
        if filled.any():
            every = bool(filled.all())
            for name in seg_keys:
                if every:
                    out[name][srt] = staged[name]
                else:
                    out[name][srt[filled]] = staged[name][filled]
        for (name, run_sel, rel), data in zip(plan, got[len(whole) :], strict=True):
            if isinstance(data, FileNotFoundError):
                ok[run_sel] = False  # deleted: past the grace period
                continue
            if isinstance(data, BaseException):
                raise data
            leaf = self._spec[name]
            block = np.frombuffer(data, dtype=leaf.dtype).reshape(-1, *leaf.shape)
            out[name][run_sel] = block[rel]
        return out, ok

    def _views(self, data: bytes, count: int) -> dict[str, np.ndarray]:
        """Every stored leaf of a whole piece of ``count`` rows, as arrays over its bytes."""
        assert self._full is not None
        buf = np.frombuffer(data, dtype=np.uint8)
        views = {}
        for name, (at, row) in leaf_offsets(self._full.leaves, count).items():
            leaf = self._full.leaves[name]
            views[name] = buf[at : at + row * count].view(leaf.dtype).reshape(count, *leaf.shape)
        return views

    def _evicted(
        self, snap: ObjectSnapshot, p: np.ndarray, seq: np.ndarray, ok: np.ndarray
    ) -> None:
        bad = int(np.argmin(ok))
        raise EvictedRowError(
            f"{self.path}: writer {snap.parts[int(p[bad])].manifest.writer_id!r}: row "
            f"{int(seq[bad])} cannot be read any more (its piece was deleted, past the "
            "writers' evict_grace_s, or is not in this snapshot). Fix: refresh() more often "
            "than evict_grace_s, raise the writers' evict_grace_s or capacity, or read by id "
            "with evicted='replace'."
        )

    def read_flat(
        self, indices: Sequence[int] | np.ndarray, *, check: bool = True
    ) -> dict[str, np.ndarray]:
        snap = self._snap
        if check:
            idx = check_indices(indices, snap.n, self.path)
        else:
            idx = np.asarray(indices, dtype=np.int64)
        idx = np.where(idx < 0, idx + snap.n, idx)
        p, seq = snap.locate(idx)
        out, ok = self._gather(snap, p, seq)
        if not ok.all():
            self._evicted(snap, p, seq, ok)
        return out

    def read_leaf(self, key: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        if key not in self._spec:
            raise UnknownLeafError(
                f"{self.path}: no leaf {key!r}; leaves: {list(self._spec)}. Fix: pass one of "
                "those (or open the source with keys= naming it)."
            )
        snap = self._snap
        idx = check_indices(indices, snap.n, self.path)
        p, seq = snap.locate(idx)
        out, ok = self._gather(snap, p, seq, [key])
        if not ok.all():
            self._evicted(snap, p, seq, ok)
        return out[key]

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
        p, seq, ahead = snap.locate_ids(ids)
        if ahead.any():
            self.refresh()
            snap = self._snap
            p, seq, ahead = snap.locate_ids(ids)
        if (p < 0).any():
            raise EvictedRowError(
                f"{self.path}: no writer with ordinal "
                f"{parts_lib.id_ordinals(int(ids[p < 0][0]))} in the store. Fix: pass ids "
                "returned by src.ids() of this store."
            )
        out, ok = self._gather(snap, p, seq)
        if ok.all():
            return out, ok
        if evicted != "replace":
            self._evicted(snap, p, seq, ok)
        # Stand-ins: a live row of the same writer, read from a snapshot taken now (the
        # pieces of an old one may be gone).
        self.refresh()
        snap = self._snap
        q, _, _ = snap.locate_ids(ids)
        if (q < 0).any() or (snap.committed[q] - snap.live_start[q] <= 0).any():
            self._evicted(snap, p, seq, ok)
        start, live = snap.live_start[q], snap.committed[q] - snap.live_start[q]
        stand = np.where(ok, seq, start + (seq - start) % np.maximum(live, 1))
        bad = np.flatnonzero(~ok)
        again, read = self._gather(snap, q[bad], stand[bad])
        if not read.all():
            self._evicted(snap, q[bad], stand[bad], read)
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
