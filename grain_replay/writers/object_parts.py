"""One writer's part of a bounded, many-writer store on object storage (s3://).

The protocol is ``store/objects.py``'s (layout, manifest versions) and ``store/lease.py``'s
(who holds the id). Rows appended are kept in memory (an object cannot be appended
to); ``flush()`` writes them as one new piece object, then creates the writer's next
manifest version (the commit point; a conditional create), then deletes what has been
superseded for longer than ``evict_grace_s`` (:mod:`object_collect`). A SIGKILL at any
moment leaves the newest manifest version and every piece it names intact; what it left half
done (a piece no manifest names) is deleted by the id's next holder once older than the grace
period.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from grain_replay.errors import (
    GrainReplayError,
    InvalidArgumentError,
    InvalidStoreError,
    WriterBusyError,
)
from grain_replay.pipeline import shutdown
from grain_replay.remote.options import redact_url
from grain_replay.store import layout as layout_lib
from grain_replay.store import objects as objects_lib
from grain_replay.store import parts as parts_lib
from grain_replay.store.lease import Lease, check_seconds
from grain_replay.store.object_manifest import ObjectManifest, Piece, leaf_offsets
from grain_replay.store.objects import ObjectStore
from grain_replay.writers.object_collect import Collector
from grain_replay.writers.object_cut import cut_manifest
from grain_replay.writers.resume import resume_rows
from grain_replay.writers.store_writer import check_tree_matches

__all__ = ["ObjectPartWriter", "check_url_arguments"]

logger = logging.getLogger(__name__)


class ObjectPartWriter:
    """Appends one writer's rows to its part of a many-writer store on object storage."""

    def __init__(
        self,
        url: str,
        format: str | None,
        *,
        writer_id: str,
        capacity: int | None,
        storage_options: Mapping[str, Any] | None,
        lease_s: float,
        evict_grace_s: float,
        resume_from: object = None,
    ) -> None:
        self._id = parts_lib.check_writer_id(writer_id, url)
        self._store = ObjectStore(url, storage_options)
        self._where = f"{self._store.shown} (writer {self._id!r})"
        suffix = url.rstrip("/").rsplit("/", 1)[-1].rpartition(".")[2].lower()
        if format is None and suffix in ("h5", "hdf5", "zarr", "npz"):
            format = {"h5": "hdf5", "hdf5": "hdf5"}.get(suffix, suffix)  # refused below
        if format not in (None, "npy"):
            raise InvalidArgumentError(
                f"{self._where}: format {format!r} cannot be written to object storage; "
                "a many-writer store there holds npy pieces (one immutable object a flush, "
                "read with ranged GETs): an HDF5 file cannot be appended to as an object, "
                "and a Zarr chunk filled over several flushes is rewritten, which readers "
                "of it could see torn. Fix: pass format='npy' (or None)."
            )
        self._capacity = parts_lib.check_capacity(capacity, url, self._id)
        self._lease_s = check_seconds(lease_s, "lease_s", self._where)
        self._grace_s = check_seconds(evict_grace_s, "evict_grace_s", self._where, zero_ok=True)
        self._store.check_bucket()
        found = self._store.read_store_file()
        keep = None if resume_from is None else self._resume_rows(resume_from, found)
        found = found or self._store.create_store_file("npy")
        if found.get("format") != "npy":
            raise InvalidStoreError(
                f"{self._where}: the store holds {found.get('format')!r} pieces; this "
                "grain_replay writes npy ones only. Fix: upgrade grain_replay."
            )
        self._lease = Lease(self._store, self._id, self._lease_s, self._where)
        self._lease.acquire()
        self._garbage = Collector(self._store, self._id, self._grace_s)
        self._attempts = 0
        try:
            self._manifest = self._take_over()
            if keep is not None:
                self._manifest = self._cut(keep)
            self._lease.start()
            self._garbage.collect()
        except BaseException:
            self._lease.release()
            raise
        self._meta = (
            None
            if self._manifest.schema is None
            else layout_lib.StoreMetadata.from_json(self._manifest.schema, where=self._where)
        )
        self._chunks: list[tuple[int, dict[str, bytes]]] = []  # rows, leaf -> bytes
        self._pending = 0
        self._open = True
        # Closed (pending rows committed, the id freed) before the interpreter exits: a
        # close from __del__ during finalization would wait forever on fsspec's event
        # loop thread, already gone.
        shutdown.register(self, ObjectPartWriter.close)

    # -- taking the id ---------------------------------------------------------------

    def _take_over(self) -> ObjectManifest:
        """Publishes a manifest version stamped with this writer's epoch, the commit of
        the last holder's rows as they are: a zombie of an older epoch cannot commit
        after it (the version it would create exists)."""
        epoch = self._lease.epoch
        for _ in range(100):
            newest = self._store.newest_manifest(self._id)
            if newest is None:
                ordinal = self._store.claim_ordinal(self._id)
                m = ObjectManifest(self._id, ordinal, self._capacity, 0, (), 0, epoch)
            else:
                if newest.capacity != self._capacity:
                    raise InvalidArgumentError(
                        f"{self._where}: capacity={self._capacity} but this writer was "
                        f"created with capacity={newest.capacity}; it cannot change on "
                        f"reopen. Fix: pass capacity={newest.capacity}, or another writer_id."
                    )
                m = dataclasses.replace(newest, version=newest.version + 1, epoch=epoch)
            if self._store.publish(m):
                self._garbage.note(m)
                return m
        raise WriterBusyError(
            f"{self._where}: another writer of this id keeps committing while this one "
            "takes it over. Fix: stop the other writer (start one writer per writer_id)."
        )

    def _resume_rows(self, mark: object, found: dict[str, Any] | None) -> int:
        """The committed rows ``resume_from=mark`` keeps, checked before anything is made."""
        sid = None if found is None else found.get("store_id")
        keep = resume_rows(mark, self._store.shown, self._id, store_id=sid)
        if found is None and keep:
            raise InvalidStoreError(
                f"{self._where}: no store at this URL, but the checkpoint to resume from "
                f"covers {keep} rows of this writer. Fix: pass the URL of the store the "
                "checkpoint replayed (with its storage_options), or drop resume_from."
            )
        return keep

    def _next_attempt(self) -> int:
        """A new piece's number in this epoch (a piece is never rewritten)."""
        self._attempts += 1
        return self._attempts

    def _cut(self, rows: int) -> ObjectManifest:
        """Cuts the part back to its first ``rows`` rows (``resume_from=``): the version
        after the takeover's names the pieces of those rows; the later pieces go with
        the versions naming them, after the grace period (readers of an older snapshot
        read them until then)."""
        m = self._manifest
        new = cut_manifest(self._store, m, rows, self._lease.epoch, self._next_attempt, self._where)
        if new is m:
            return m
        if not self._store.publish(new):
            holder = self._lease.taken_over() or {}
            raise WriterBusyError(
                f"{self._where}: manifest version {new.version}: another writer took this "
                f"writer's id over (host {holder.get('host')!r}, pid {holder.get('pid')}) "
                "while it was cut back to the checkpoint; nothing was cut. Fix: start one "
                "writer per writer_id."
            )
        logger.info(
            "%s: dropped rows [%d, %d), committed after the checkpoint resumed from",
            self._where, rows, m.committed,
        )  # fmt: skip
        self._garbage.note(new)
        return new

    # -- what ReplayWriter asks --------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not self._open

    @property
    def committed(self) -> int:
        return self._manifest.committed

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def manifest(self) -> parts_lib.Manifest:
        return self._manifest.as_manifest()

    @property
    def format(self) -> str:
        return "npy"

    @property
    def objects(self) -> ObjectStore:
        """The store's objects (the rate-limit gate reads the learners' folder there)."""
        return self._store

    @property
    def epoch(self) -> int:
        """The lease epoch this writer holds its id under."""
        return self._lease.epoch

    def _check_open(self) -> None:
        if not self._open:
            raise GrainReplayError(
                f"{self._where}: the ReplayWriter is closed. Fix: append before close(), or "
                "open a new gr.ReplayWriter on the same URL: it continues after the "
                "committed rows."
            )

    def check(
        self, tree: Any, keep: Callable[[Any], bool] | None = None
    ) -> tuple[dict[str, Any], int]:
        """The tree's leaves and rows, checked against the store's (binding it on the first
        append)."""
        self._check_open()
        arrays, treedef, n = layout_lib.check_leaves(tree, where=self._where, keep=keep)
        leaves = {k: layout_lib.LeafSpec(a.dtype, tuple(a.shape[1:])) for k, a in arrays.items()}
        if self._meta is None:
            self._meta = self._schema_of_store(layout_lib.StoreMetadata(0, leaves, treedef))
        check_tree_matches(self._where, arrays, treedef, self._meta)
        return arrays, n

    def _schema_of_store(self, mine: layout_lib.StoreMetadata) -> layout_lib.StoreMetadata:
        """The first writer's leaves bind the store: a later writer must match them."""
        for other in self._store.list_writers():
            if other == self._id:
                continue
            m = self._store.newest_manifest(other)
            if m is None or m.schema is None:
                continue
            theirs = layout_lib.StoreMetadata.from_json(m.schema, where=self._store.shown)
            mine.check_like(theirs, where=self._where, other=other, place="URL")
            return theirs
        return mine

    def write(self, arrays: dict[str, np.ndarray], n: int, *, by_leaf: bool = False) -> None:
        """Keeps checked host rows until the next flush (copied: the caller may reuse them)."""
        self._check_open()
        assert self._meta is not None
        self._chunks.append(
            (
                n,
                {
                    k: np.ascontiguousarray(np.asarray(arrays[k])).tobytes()
                    for k in self._meta.leaves
                },
            )
        )
        self._pending += n

    # -- committing --------------------------------------------------------------------

    def flush(self) -> int:
        """Writes the pending rows as one piece and commits them; returns the committed N.

        Raises:
          WriterBusyError: another writer took the id over (this one's lease ran out):
            this writer stops (the message says which rows may be committed).
        """
        self._check_open()
        while self._pending:
            if self._commit_pending():
                break
        if self._garbage.due():
            self._garbage.collect()
        return self._manifest.committed

    def _commit_pending(self) -> bool:
        """One attempt at committing the pending rows: True once they are committed; False
        when a flush of this writer whose answer was lost (it raised) had committed some of
        them, which are dropped from the pending rows (the rest: another attempt)."""
        assert self._meta is not None
        m = self._manifest
        # A piece is never rewritten: a retried flush writes a new one.
        piece = Piece(m.committed, self._pending, self._lease.epoch, self._next_attempt())
        data = b"".join(c[k] for k in self._meta.leaves for _, c in self._chunks)
        self._store.put(self._store.piece_key(self._id, piece), data)
        committed = m.committed + self._pending
        live_start = 0 if m.capacity is None else max(0, committed - m.capacity)
        pieces = tuple(p for p in (*m.pieces, piece) if p.first + p.rows > live_start)
        new = dataclasses.replace(
            m,
            committed=committed,
            pieces=pieces,
            version=m.version + 1,
            epoch=self._lease.epoch,
            schema=m.schema or self._meta.to_json(),
        )
        if not self._store.publish(new):
            found = self._store.read_manifest(self._id, new.version)
            if found is not None and found.epoch == self._lease.epoch:
                self._adopt(found)  # this writer's own commit: no other holds its epoch
                return not self._pending
            self._fenced(new.version, "are not committed")
        if self._lease.stale() and self._lease.taken_over() is not None:
            # Paused past the lease: the version created is the newest (the new holder
            # continues after it) or one its collection had deleted as old (readers pass
            # over it for the newest): either way this writer stops here.
            self._fenced(
                new.version,
                "are committed only if the new holder had not committed yet (it continues "
                "after the newest commit)",
            )
        self._manifest = new
        self._garbage.note(new)
        self._chunks, self._pending = [], 0
        return True

    def _adopt(self, found: ObjectManifest) -> None:
        """Takes ``found``, an earlier commit of this writer, as the commit point, and drops
        the rows it committed from the pending ones (the oldest)."""
        assert self._meta is not None
        done = found.committed - self._manifest.committed
        self._manifest = found
        self._garbage.note(found)
        width = {k: w for k, (_, w) in leaf_offsets(self._meta.leaves, 1).items()}
        self._pending -= done
        while done:
            n, chunk = self._chunks[0]
            if n <= done:
                self._chunks.pop(0)
                done -= n
                continue
            self._chunks[0] = (n - done, {k: b[done * width[k] :] for k, b in chunk.items()})
            done = 0

    def _fenced(self, version: int, rows: str) -> None:
        self._open = False
        shutdown.unregister(self)
        self._lease.stop()
        holder = self._lease.taken_over() or {}
        raise WriterBusyError(
            f"{self._where}: manifest version {version}: another writer took this writer's "
            f"id over (host {holder.get('host')!r}, pid {holder.get('pid')}, lease epoch "
            f"{holder.get('epoch')}) after this one's lease of {self._lease_s:g} s ran out "
            f"unrenewed; this writer stops, and the {self._pending} rows of this flush "
            f"{rows}. Fix: give each writer its own writer_id, and a lease_s longer than "
            "its longest pause."
        )

    def close(self) -> None:
        """Commits pending rows, collects, and frees the id."""
        if not self._open:
            return
        try:
            self.flush()
            self._garbage.collect()
        finally:
            self._open = False
            shutdown.unregister(self)
            self._lease.release()

    def abandon(self) -> None:
        """Frees the id without committing anything more."""
        if self._open:
            self._open = False
            shutdown.unregister(self)
            self._lease.release()


def check_url_arguments(url: str, writer_id: str | None, *, segment_rows: int | None) -> None:
    """Refuses what a writer on object storage does not do, naming the fix."""
    objects_lib.check_object_url(url, writer_id)
    if segment_rows is not None:
        raise InvalidArgumentError(
            f"{redact_url(url)} (writer {writer_id!r}): segment_rows= is not taken by a "
            "writer on object storage (each flush is one piece object there). Fix: drop "
            "segment_rows=, or write to a POSIX path."
        )
