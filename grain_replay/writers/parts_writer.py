"""One writer's part of a bounded, many-writer store: segments, a manifest, eviction.

Rows go into fixed-size segments, each a plain single-writer store written by
the format's backend. ``flush()`` commits the segments written to, then
replaces the writer's manifest (the commit point), then unlinks segments the
new manifest no longer names. A crash at any point leaves the last manifest
and every segment it names intact; reopening drops the rest. A segment is
:mod:`~grain_replay.writers.part_segments`'s; the arguments and the store file,
:mod:`~grain_replay.writers.part_store`'s; the manifest's arithmetic,
:mod:`~grain_replay.writers.part_manifest`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.store import layout as layout_lib
from grain_replay.store import ownership
from grain_replay.store import parts as parts_lib
from grain_replay.store.filesync import publish_text
from grain_replay.writers import part_manifest, part_store
from grain_replay.writers.atomic import remove_path
from grain_replay.writers.backends import write_by_leaf
from grain_replay.writers.backends.durable import fsync_all, fsync_dirs
from grain_replay.writers.lifecycle import LockedWriter
from grain_replay.writers.part_manifest import default_segment_rows
from grain_replay.writers.part_segments import (
    Segment,
    create_segment,
    remove_segment,
    reopen_segment,
    segment_path,
)
from grain_replay.writers.row_stage import HostSignature, RowStage
from grain_replay.writers.store_writer import check_tree_matches

__all__ = ["PartWriter", "default_segment_rows"]

logger = logging.getLogger(__name__)


class PartWriter(LockedWriter):
    """Appends one writer's rows to its part of a bounded, many-writer store."""

    def __init__(
        self,
        path: str,
        format: str | None,
        *,
        writer_id: str,
        capacity: int | None,
        segment_rows: int | None,
        chunk_rows: int | None,
        compression: str | None,
        resume: int | None = None,
    ) -> None:
        self._path = path
        self._id = parts_lib.check_writer_id(writer_id, path)
        self._where = f"{path} (writer {self._id!r})"
        capacity = parts_lib.check_capacity(capacity, path, self._id)
        self._format = part_store.open_store_format(path, format, segment_rows, self._where)
        self._chunk_rows, self._compression = chunk_rows, compression
        self._dir = parts_lib.writer_dir(path, self._id)
        self._lock_fd: int | None = ownership.acquire_writer_lock(path, self._id)
        self._open: Segment | None = None
        self._full: list[Segment] = []  # filled since the last flush, not yet committed
        self._default_rows = segment_rows is None
        self._pending = 0  # rows written, not committed (the stage's not counted)
        self._stage: RowStage | None = None  # small appends, gathered (row_stage.py)
        self._host: HostSignature | None = None  # the last numpy tree checked
        # Segments a flush evicted, not yet removed; with ``defer_evictions`` (a device
        # writer's sync thread) they are removed by commit_filled, off the flush.
        self._evicted: list[str] = []
        self.defer_evictions = False
        # Folders of segments commit_filled committed, not synced yet: the next flush
        # syncs them with its own, before its commit point names the segments.
        self._unsynced_dirs: list[str] = []
        try:
            manifest = parts_lib.read_manifest(self._dir)
            if manifest is None:
                ordinal = parts_lib.claim_ordinal(path, self._id)
                manifest = parts_lib.Manifest(
                    self._id,
                    ordinal,
                    self._format,
                    capacity,
                    segment_rows or default_segment_rows(capacity),
                    0,
                    (),
                )
            else:
                self._check_reopen(manifest, capacity, segment_rows)
            if resume is not None:
                manifest = self._cut(manifest, resume)
            self._manifest = manifest
            self._meta = (
                None
                if manifest.schema is None
                else layout_lib.StoreMetadata.from_json(manifest.schema, where=self._where)
            )
            self._drop_orphans()
            self._reopen_tail()
        except BaseException:
            self._release_lock()
            raise

    # -- reopening -----------------------------------------------------------------

    def _check_reopen(
        self, m: parts_lib.Manifest, capacity: int | None, segment_rows: int | None
    ) -> None:
        part_manifest.check_reopen(m, capacity, segment_rows, self._format, self._where)

    def _cut(self, m: parts_lib.Manifest, rows: int) -> parts_lib.Manifest:
        """Commits this part cut back to its first ``rows`` rows (a checkpoint's watermark):
        the manifest first (the commit point), then reopening drops the later segments'
        files and cuts the tail segment (:meth:`_drop_orphans`, :meth:`_reopen_tail`)."""
        cut = part_manifest.cut(m, rows, self._where)
        if cut is m:
            return m
        parts_lib.write_manifest(self._dir, cut)
        logger.warning(
            "%s: dropped rows [%d, %d), committed after the checkpoint resumed from",
            self._where, rows, m.committed,
        )  # fmt: skip
        return cut

    def _segment_path(self, first: int) -> str:
        return segment_path(self._dir, first, self._format)

    def _drop_orphans(self) -> None:
        """Removes what the manifest does not name: uncommitted segments, unfinished evictions."""
        keep = {ownership.LOCK_FILE, ownership.OWNER_FILE, parts_lib.MANIFEST_FILE}
        m = self._manifest
        keep |= {parts_lib.segment_name(s.first, self._format) for s in m.segments + m.retired}
        for name in os.listdir(self._dir):
            if name not in keep:
                logger.info("%s: removing %s (not committed)", self._where, name)
                remove_path(os.path.join(self._dir, name))

    def _reopen_tail(self) -> None:
        """Continues in the newest segment after its last committed row."""
        m = self._manifest
        if not m.segments or self._meta is None:
            return
        tail = m.segments[-1]
        if tail.rows >= m.segment_rows:
            return
        meta = self._segment_meta(tail.rows)
        seg, cut = reopen_segment(
            self._segment_path(tail.first), self._format, meta, tail.first, m.segment_rows
        )
        if cut:
            # The segment says the manifest's rows again, so readers map what they will read.
            logger.info(
                "%s: segment %s held rows past the manifest; dropped them",
                self._where, tail.first,
            )  # fmt: skip
            seg.backend.commit(tail.rows, None if seg.summer is None else seg.summer.state())
        self._open = seg

    def _segment_meta(self, n: int) -> layout_lib.StoreMetadata:
        assert self._meta is not None
        return layout_lib.StoreMetadata(n, self._meta.leaves, self._meta.treedef)

    # -- state -------------------------------------------------------------------------

    @property
    def committed(self) -> int:
        return self._manifest.committed

    @property
    def pending(self) -> int:
        """Rows appended, not committed (gathered ones included)."""
        return self._pending + (0 if self._stage is None else self._stage.rows)

    @property
    def manifest(self) -> parts_lib.Manifest:
        return self._manifest

    @property
    def format(self) -> str:
        return self._format

    # -- appending ---------------------------------------------------------------------

    def append(self, tree: Any) -> int:
        """Writes a block of rows (not yet committed); returns the rows appended."""
        arrays, n = self.check(tree)
        self.write(arrays, n)
        return n

    def check(
        self, tree: Any, keep: Callable[[Any], bool] | None = None
    ) -> tuple[dict[str, Any], int]:
        """The tree's leaves and rows, checked against the store's (binding it on the first
        append); leaves ``keep`` accepts (device arrays) are checked without a copy."""
        self._check_open(self._where)
        if self._host is not None and (taken := self._host.take(tree)) is not None:
            return taken  # a numpy tree like the last: it passes the same checks
        arrays, treedef, n = layout_lib.check_leaves(tree, where=self._where, keep=keep)
        leaves = {k: layout_lib.LeafSpec(a.dtype, tuple(a.shape[1:])) for k, a in arrays.items()}
        if self._meta is None:
            self._meta = self._schema_of_store(layout_lib.StoreMetadata(0, leaves, treedef))
            m = self._manifest
            if self._default_rows and m.committed == 0 and not m.segments:
                rows = default_segment_rows(m.capacity, self._format, self._meta.leaves)
                self._manifest = dataclasses.replace(m, segment_rows=rows)
        assert self._meta is not None
        check_tree_matches(self._where, arrays, treedef, self._meta)
        self._host = HostSignature.of(tree, arrays)
        return arrays, n

    def write(self, arrays: dict[str, np.ndarray], n: int, *, by_leaf: bool = False) -> None:
        """Writes checked host rows (not yet committed): small blocks are gathered and
        written together (:class:`RowStage`), at the latest by the next ``flush``.
        ``by_leaf`` (the device writer's thread, whose blocks are batches already): written
        now, one write per leaf, a failure raised as :class:`LeafWriteError` naming it."""
        if n == 0:
            return
        if self._stage is None:
            assert self._meta is not None
            self._stage = RowStage(self._meta.leaves)
        self._stage.write(arrays, n, by_leaf, self._write_block)

    def _write_block(self, arrays: dict[str, np.ndarray], n: int, *, by_leaf: bool) -> None:
        done = 0
        while done < n:
            seg = self._segment_for_next()
            take = min(n - done, self._manifest.segment_rows - seg.rows)
            block = {k: a[done : done + take] for k, a in arrays.items()}
            if by_leaf:
                write_by_leaf(seg.backend, block, seg.rows)
            else:
                seg.backend.write(block, seg.rows)
            if seg.summer is not None:
                seg.summer.update(block)
            seg.rows += take
            seg.dirty = True
            done += take
        self._pending += n

    def commit_filled(self, stop: Callable[[], bool] | None = None) -> None:
        """Commits the filled segments that the manifest does not name yet (not the
        manifest, the commit point), leaving less for the next ``flush`` to sync, then
        removes the segments the last flush evicted. Readers do not see them before that
        flush; a crash leaves files reopening removes. ``stop``: asked before each
        segment; True (a flush waits) leaves the rest to the flush or the next call. A
        segment's commit is one ``fsync`` round (its rows, headers and new metadata
        together, as a flush's: no reader reads a segment before a manifest names it);
        its folder is synced by the next flush, in that flush's round of folders, before
        its commit point. The removals are not stopped (frequent flushes would leave the
        disk space taken)."""
        named = {s.first for s in self._manifest.segments}
        for seg in [*self._full, self._open]:
            if seg is None or not seg.dirty or seg.first in named:
                continue
            if seg.rows >= self._manifest.segment_rows:
                if stop is not None and stop():
                    break
                fds = seg.backend.stage_commit(seg.rows, seg.summer.state() if seg.summer else None)
                fsync_all(fds)
                if (d := seg.backend.finish_commit()) is not None:
                    self._unsynced_dirs.append(d)
                seg.dirty = False
        self.remove_evicted(quiet=True)

    def remove_evicted(self, *, quiet: bool = False) -> None:
        """Removes the segments the last flushes evicted (their rows are out of the
        manifest already: a crash before leaves files reopening removes). ``quiet``:
        a failure is logged, not raised (the next reopen removes what is left)."""
        while self._evicted:
            path = self._evicted.pop(0)
            try:
                remove_segment(path, self._format, self._meta)
            except OSError as e:
                if not quiet:
                    raise
                logger.warning(
                    "%s: could not remove evicted segment %s (%s); reopening the writer "
                    "removes it. Fix: check the directory's permissions.",
                    self._where, path, e,
                )  # fmt: skip

    def _schema_of_store(self, mine: layout_lib.StoreMetadata) -> layout_lib.StoreMetadata:
        """The first writer's leaves bind the store: a later writer must match them."""
        for other in parts_lib.list_writers(self._path):
            if other == self._id:
                continue
            m = parts_lib.read_manifest(parts_lib.writer_dir(self._path, other))
            if m is None or m.schema is None:
                continue
            theirs = layout_lib.StoreMetadata.from_json(m.schema, where=self._path)
            mine.check_like(theirs, where=self._where, other=other, place="path")
            return theirs
        return mine

    def _segment_for_next(self) -> Segment:
        seg = self._open
        if seg is not None and seg.rows < self._manifest.segment_rows:
            return seg
        if seg is not None:
            self._full.append(seg)
        first = self._manifest.committed if seg is None else seg.first + seg.rows
        assert first % self._manifest.segment_rows == 0
        self._open = create_segment(  # a leftover there is removed (create_segment)
            self._segment_path(first),
            self._format,
            self._segment_meta(0),
            first,
            self._manifest.segment_rows,
            self._chunk_rows,
            self._compression,
        )
        return self._open

    def flush(self) -> int:
        """Commits the segments, then the manifest (the commit point), then evicts.

        Three rounds of ``fsync``: the segments' rows and headers with the new manifest
        beside the old one (all files at once), the segments' directories, then the
        manifest's rename. A crash before the last leaves the old manifest in force;
        segments ahead of it are cut back on reopen (:meth:`_reopen_tail`)."""
        if self._lock_fd is None:
            return self.committed
        if self._stage is not None:
            self._stage.drain(self._write_block)
        if not self._pending:
            return self.committed
        m = self._manifest
        staged = [s for s in [*self._full, self._open] if s is not None and s.dirty]
        fds: list[int] = []
        for seg in staged:
            fds += seg.backend.stage_commit(seg.rows, seg.summer.state() if seg.summer else None)
        rows = {s.first: s.rows for s in m.segments}
        for o in [*self._full, self._open]:
            if o is not None:
                rows[o.first] = o.rows
        assert self._meta is not None
        committed = m.committed + self._pending
        manifest, dropped = part_manifest.committed(m, committed, rows, self._meta.to_json())
        text = parts_lib.stage_manifest(self._dir, manifest)
        try:
            fsync_all([*fds, text.fd])
            dirs = [d for seg in staged if (d := seg.backend.finish_commit()) is not None]
            for seg in staged:
                seg.dirty = False
            fsync_dirs([*self._unsynced_dirs, *dirs])
            self._unsynced_dirs = []
            publish_text(text)  # the commit point
        except BaseException:
            text.discard()
            raise
        self._manifest, self._pending = manifest, 0
        for seg in self._full:
            seg.backend.close()
        self._full = []
        # After the commit point: a crash here leaves files reopening removes. Removing
        # a segment gives its page cache back, milliseconds a file: a device writer's
        # sync thread does it (commit_filled), so flush() holds up the caller less.
        self._evicted += [self._segment_path(s.first) for s in dropped]
        if not self.defer_evictions:
            self.remove_evicted()
        return committed

    # -- lifecycle ---------------------------------------------------------------------

    def _finish(self) -> None:
        self.flush()
        self.remove_evicted()

    def _let_go(self) -> None:
        for seg in [*self._full, self._open]:
            if seg is not None:
                seg.backend.close()
        self._full, self._open = [], None

    def abandon(self) -> None:
        """Releases the id without committing (the rows since the last flush are lost)."""
        self._stage = None
        self._let_go()
        self._release_lock()
