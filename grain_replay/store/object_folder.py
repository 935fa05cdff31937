"""The learners' folder of a many-writer store on object storage, and its inserted rows.

Rate limits over ``s3://`` work as on POSIX (:mod:`grain_replay.store.progress`,
:mod:`grain_replay.store.rate_limit`): each learner process publishes its progress as
``learners/process-<p>-of-<P>.json`` (one PUT replaces it whole, as a rename does), the
store's declared limit is ``learners/limit.json`` created by a conditional create (the
hard link's "first one stays"), and the writers count every writer's committed rows
from the newest manifest versions. Those modules take an :class:`ObjectFolder` where they
take a directory.
"""

from __future__ import annotations

from typing import Any

from grain_replay.store import parts as parts_lib
from grain_replay.store.object_manifest import ObjectManifest
from grain_replay.store.objects import ObjectStore

__all__ = ["ObjectFolder", "ObjectInsertedCount"]

# Polls of a waiting writer or learner against object storage: each is a LIST (and a GET
# a changed file), so they are spaced wider than a local folder's stat() polls.
POLL_MIN_S, POLL_MAX_S = 0.01, 0.25


class ObjectFolder:
    """A folder of small JSON objects under a store on object storage (``learners/``)."""

    def __init__(self, store: ObjectStore, name: str = "learners") -> None:
        self.store = store
        self.prefix = store.key(name)
        self.shown = f"{store.shown}/{name}"

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"ObjectFolder({self.shown!r})"

    def entries(self) -> list[tuple[str, tuple[Any, ...]]]:
        """``(name, stamp)`` of each object (the stamp changes when it is replaced)."""
        out = []
        for e in self.store.listing(self.prefix):
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            out.append((name, (e.get("ETag"), e.get("size"), self.store.modified(e))))
        return out

    def read(self, name: str) -> str | None:
        raw = self.store.get(f"{self.prefix}/{name}")
        return None if raw is None else raw.decode()

    def exists(self, name: str) -> bool:
        return self.store.get(f"{self.prefix}/{name}") is not None

    def replace(self, name: str, text: str) -> None:
        self.store.put(f"{self.prefix}/{name}", text.encode())

    def create(self, name: str, text: str) -> bool:
        return self.store.create(f"{self.prefix}/{name}", text.encode())

    def remove(self, name: str) -> None:
        self.store.remove([f"{self.prefix}/{name}"])


class ObjectInsertedCount:
    """Rows committed by every writer of a store on object storage (evicted ones included)
    and their live rows, from each writer's newest manifest version (a LIST a writer, and
    a GET when it changed)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._cache: dict[str, ObjectManifest] = {}

    def manifests(self) -> list[parts_lib.Manifest]:
        out = []
        for writer_id in self.store.list_writers():
            versions = self.store.manifest_versions(writer_id)
            if not versions:
                continue
            cached = self._cache.get(writer_id)
            if cached is None or cached.version != versions[-1][0]:
                found = self.store.newest_manifest(writer_id)
                if found is None:
                    continue
                cached = self._cache[writer_id] = found
            if cached.schema is not None:
                out.append(cached.as_manifest())
        return out

    def read(self) -> tuple[int, int]:
        """``(inserted, live)``: rows ever committed, and rows readers see now."""
        ms = self.manifests()
        return sum(m.committed for m in ms), sum(m.live for m in ms)
