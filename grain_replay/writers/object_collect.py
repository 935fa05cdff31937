"""What a writer part on object storage deletes: versions and pieces past the grace period."""

from __future__ import annotations

import itertools
import time

from grain_replay.store.object_manifest import ObjectManifest
from grain_replay.store.objects import CLOCK_SLACK_S, ObjectStore

__all__ = ["Collector"]


class Collector:
    """Deletes a writer part's manifest versions superseded for longer than ``grace_s``, then
    the pieces no remaining version names that are older than it (evicted, or left by a
    writer killed before its commit): a reader whose snapshot is younger reads all its rows.

    Args:
      store: the store's objects.
      writer_id: the part's writer id.
      grace_s: seconds what is superseded is kept (``evict_grace_s``).
    """

    def __init__(self, store: ObjectStore, writer_id: str, grace_s: float):
        self._store, self._id, self._grace_s = store, writer_id, grace_s
        self._pieces_of: dict[int, frozenset[str]] = {}  # manifest version -> its pieces
        self._last = -float("inf")

    def note(self, manifest: ObjectManifest) -> None:
        """Remembers the pieces of a version this writer published or read."""
        self._pieces_of[manifest.version] = frozenset(p.name for p in manifest.pieces)

    def due(self) -> bool:
        """Whether a flush collects: a tenth of the grace period (10 s at most) since last."""
        return time.monotonic() - self._last >= min(10.0, self._grace_s / 10)

    def collect(self) -> None:
        """Deletes what has been superseded for longer than the grace period (see above)."""
        self._last = time.monotonic()
        store, writer_id = self._store, self._id
        versions = store.manifest_versions(writer_id)
        if not versions:
            return
        now = versions[-1][1]  # the newest version, created moments ago: the server's now
        grace = self._grace_s + CLOCK_SLACK_S
        drop = [
            v for (v, _), (_, after) in itertools.pairwise(versions)
            if now - after > grace
        ]  # fmt: skip
        kept = [v for v, _ in versions if v not in set(drop)]
        # The versions this writer did not publish itself (a takeover's), read at once.
        keys = {store.manifest_key(writer_id, v): v for v in kept if v not in self._pieces_of}
        for key, raw in store.get_many(list(keys)).items():
            v = keys.get(key, keys.get(key.split("://", 1)[-1]))
            if v is not None:
                m = ObjectManifest.from_json(raw, f"{store.shown}:{key}")
                self._pieces_of[v] = frozenset(p.name for p in m.pieces)
        if any(v not in self._pieces_of for v in kept):
            return  # a version unread: which pieces it names is unknown, so none goes now
        named: set[str] = set()
        for v in kept:
            named |= self._pieces_of[v]
        store.remove([store.manifest_key(writer_id, v) for v in drop])
        for v in drop:
            self._pieces_of.pop(v, None)
        gone = [
            key
            for key, modified in store.list_pieces(writer_id)
            if key.rsplit("/", 1)[-1] not in named and now - modified > grace
        ]
        store.remove(gone)
