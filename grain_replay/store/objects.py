"""A bounded, many-writer store on object storage: its layout, conditional creates, versions.

Objects cannot be renamed, appended to, locked or read after deletion, so the POSIX
protocol (``store/parts.py``) becomes one of immutable objects and conditional creates
(S3 ``If-None-Match: *``, fsspec's ``pipe_file(mode="create")``)::

    url/
      replay_store.json                 {"format": "npy", "layout": 1, "storage": "object",
                                         "store_id": ...}, created once (conditional)
      ordinals/<k>                      writer id holding row-id ordinal k (conditional)
      writers/<writer_id>/
        lease/<epoch:012d>.json         who holds the id (store/lease.py)
        manifests/<version:012d>.json   the commit points, one object a commit (conditional)
        pieces/<first>-<epoch>-<attempt>.raw   one flush's rows (sequence numbers from
                                        first; 12 digits each): every leaf's bytes, leaf
                                        after leaf, C order (immutable, never rewritten)

A writer's newest manifest version is its commit point: a flush creates version
``v + 1`` only if no object has that name, so of two writers of one id (a zombie after a
takeover) exactly one commits each version and the other learns it lost. Readers list
``manifests/`` (LIST is strongly consistent on S3) and read the newest.
"""

from __future__ import annotations

import datetime
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from grain_replay.errors import (
    InvalidArgumentError,
    InvalidStoreError,
    MissingDependencyError,
    StoreNotFoundError,
)
from grain_replay.remote.options import effective_storage_options, protocol_of, redact_url
from grain_replay.store import parts as parts_lib
from grain_replay.store.object_manifest import LAYOUT_VERSION, ObjectManifest, Piece

__all__ = [
    "DEFAULT_EVICT_GRACE_S",
    "DEFAULT_LEASE_S",
    "OBJECT_PROTOCOLS",
    "ObjectStore",
    "check_object_url",
    "is_object_store",
    "what_is_at",
]

logger = logging.getLogger(__name__)

# Protocols whose fsspec file system gives a conditional create that a test here runs
# against a real server (moto's S3). gcsfs has one too (pipe_file(mode="create") sends
# ifGenerationMatch=0, since gcsfs 2024.12), marked experimental there and run by no
# server of these tests: docs/replay_store.md#on-object-storage says what is missing.
OBJECT_PROTOCOLS = ("s3", "s3a")
DEFAULT_LEASE_S = 30.0
# Evicted pieces and superseded manifest versions stay this long: a reader whose
# snapshot is younger reads every row of it (objects have no open-after-unlink).
DEFAULT_EVICT_GRACE_S = 300.0
# S3's LastModified has whole seconds: ages compared with it get this much slack.
CLOCK_SLACK_S = 1.0
STORAGE = "object"


def check_object_url(url: str, writer_id: str | None) -> None:
    """Refuses a URL whose storage has no conditional create tested here, naming why."""
    proto = protocol_of(url)
    if proto in OBJECT_PROTOCOLS:
        return
    who = "" if writer_id is None else f" (writer {writer_id!r})"
    if proto in ("gs", "gcs"):
        why = (
            "gcsfs offers a conditional create (pipe_file(mode='create'), ifGenerationMatch=0, "
            "since gcsfs 2024.12) but marks it experimental, and no GCS server runs in this "
            "package's tests, so a many-writer store is not made on gs:// yet"
        )
    else:
        why = f"{proto}:// is no object storage whose conditional create is tested here"
    raise InvalidArgumentError(
        f"{redact_url(url)}{who}: a many-writer store on object storage needs s3:// "
        f"(S3 or an S3-compatible server honouring If-None-Match: *); {why}. Fix: write "
        "to s3://bucket/path with storage_options=..., or to a POSIX path."
    )


def _open_fs(url: str, storage_options: Mapping[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec is a dependency
        raise MissingDependencyError(f"{url}: needs fsspec. Fix: pip install fsspec s3fs") from e
    opts = effective_storage_options(url, storage_options)
    try:
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except ImportError as e:
        raise MissingDependencyError(
            f"{redact_url(url)}: {e}. Fix: pip install s3fs (for s3:// URLs)."
        ) from e
    return fs, root.rstrip("/")


class ObjectStore:
    """The objects of one many-writer store at ``url`` and the calls made on them.

    Every listing asks the server (``refresh=True``): fsspec caches listings, and a
    commit another process made must be seen. Not picklable on purpose: sources keep the
    URL and options and make one per process.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.shown = redact_url(self.url)
        self.options = dict(storage_options or {})
        self.fs, self.root = _open_fs(self.url, self.options)

    def key(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def writer_key(self, writer_id: str, *parts: str) -> str:
        return self.key(parts_lib.WRITERS_DIR, writer_id, *parts)

    # -- plain calls ---------------------------------------------------------------

    def create(self, key: str, data: bytes) -> bool:
        """Creates ``key`` holding ``data`` unless an object has that name: True if this
        call created it. The conditional create every commit rests on."""
        try:
            self.fs.pipe_file(key, data, mode="create")
        except FileExistsError:
            return False
        return True

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(key, data)

    def get(self, key: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(key))
        except FileNotFoundError:
            return None

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The objects ``keys`` that exist, read concurrently (fsspec's ``cat``)."""
        if not keys:
            return {}
        found = self.fs.cat(list(keys), on_error="omit")
        return {k: bytes(v) for k, v in found.items()}

    def listing(self, prefix: str) -> list[dict[str, Any]]:
        """The objects (and folders) right under ``prefix``, asked of the server."""
        try:
            return list(self.fs.ls(prefix, detail=True, refresh=True))
        except FileNotFoundError:
            return []

    def names(self, prefix: str) -> list[str]:
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in self.listing(prefix))

    def remove(self, keys: Sequence[str]) -> None:
        if keys:
            try:
                self.fs.rm(list(keys))
            except FileNotFoundError:
                pass  # another remover was first

    def cat_ranges(
        self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]
    ) -> list[bytes | BaseException]:
        """Byte ranges of objects, requested concurrently (one GET each); an exception in
        the place of a range that failed (``FileNotFoundError``: the object is gone)."""
        if not keys:
            return []
        return list(self.fs.cat_ranges(list(keys), list(starts), list(ends), on_error="return"))

    def server_now(self) -> float:
        """The server's clock now (seconds since the epoch), from the LastModified of an
        object written for the purpose: lease ages never compare two hosts' clocks."""
        key = self.key("clock", f"{uuid.uuid4().hex}")
        self.put(key, b"")
        try:
            return self.modified(self.fs.info(key))
        finally:
            self.remove([key])

    @staticmethod
    def modified(entry: Mapping[str, Any]) -> float:
        stamp = entry.get("LastModified") or entry.get("mtime") or entry.get("updated")
        if isinstance(stamp, datetime.datetime):
            return float(stamp.timestamp())
        if isinstance(stamp, (int, float)):
            return float(stamp)
        raise InvalidStoreError(
            f"no modification time in the listing entry {dict(entry)!r}: leases and the grace "
            "period need the server's LastModified. Fix: use S3 (or a server that lists "
            "LastModified)."
        )

    # -- the store file ------------------------------------------------------------

    def check_bucket(self) -> None:
        """Refuses a bucket that does not exist (or cannot be listed), naming the fix."""
        bucket = self.root.split("/", 1)[0]
        try:
            ok = self.fs.exists(bucket)
        except (OSError, ValueError) as e:  # permission, endpoint
            raise StoreNotFoundError(
                f"{self.shown}: the bucket {bucket!r} cannot be reached ({type(e).__name__}: "
                f"{e}). Fix: check storage_options (endpoint, credentials)."
            ) from e
        if not ok:
            raise StoreNotFoundError(
                f"{self.shown}: the bucket {bucket!r} does not exist. Fix: create it first "
                "(a writer creates objects, not buckets), or check the URL."
            )

    def read_store_file(self) -> dict[str, Any] | None:
        """The store file's content, None when there is none; refuses a foreign one."""
        raw = self.get(self.key(parts_lib.STORE_FILE))
        if raw is None:
            return None
        try:
            found = json.loads(raw)
            ok = found.get("storage") == STORAGE and int(found["layout"]) <= LAYOUT_VERSION
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            raise InvalidStoreError(
                f"{self.shown}/{parts_lib.STORE_FILE}: not the store file of a many-writer "
                "store on object storage (an uploaded POSIX parts folder, or another tool's). "
                "Fix: write the store with gr.ReplayWriter(url, capacity=..., "
                "writer_id=...), or convert a POSIX store with grain-replay convert."
            )
        return dict(found)

    def create_store_file(self, fmt: str) -> dict[str, Any]:
        """The store file, created now (conditionally) if there is none."""
        body = {
            "format": fmt,
            "layout": LAYOUT_VERSION,
            "storage": STORAGE,
            "store_id": uuid.uuid4().hex,
        }
        self.create(self.key(parts_lib.STORE_FILE), json.dumps(body).encode())
        found = self.read_store_file()
        assert found is not None
        return found

    # -- ordinals ------------------------------------------------------------------

    def claim_ordinal(self, writer_id: str) -> int:
        """The ordinal of ``writer_id``, claimed now by a conditional create if it has none."""
        folder = self.key(parts_lib.ORDINALS_DIR)
        taken = [int(n) for n in self.names(folder) if n.isdigit()]
        for k in sorted(taken):
            if self.get(f"{folder}/{k}") == writer_id.encode():
                return k
        k = max(taken, default=-1) + 1
        while k <= parts_lib.MAX_ORDINAL:
            if self.create(f"{folder}/{k}", writer_id.encode()):
                return k
            if self.get(f"{folder}/{k}") == writer_id.encode():
                return k  # a takeover racing this one claimed it for the same id
            k += 1
        raise InvalidStoreError(
            f"{self.shown}: no row-id ordinal left for writer {writer_id!r} (2**23 writer ids "
            "were claimed). Fix: write to a new store URL."
        )

    # -- writers and manifests -----------------------------------------------------

    def list_writers(self) -> list[str]:
        ids = self.names(self.key(parts_lib.WRITERS_DIR))
        return [w for w in ids if parts_lib.is_safe_writer_id(w)]

    def manifest_versions(self, writer_id: str) -> list[tuple[int, float]]:
        """``(version, LastModified)`` of each manifest version of ``writer_id``, oldest first."""
        out = []
        for e in self.listing(self.writer_key(writer_id, "manifests")):
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit():
                out.append((int(name[:-5]), self.modified(e)))
        return sorted(out)

    def manifest_key(self, writer_id: str, version: int) -> str:
        return self.writer_key(writer_id, "manifests", f"{version:012d}.json")

    def read_manifest(self, writer_id: str, version: int) -> ObjectManifest | None:
        key = self.manifest_key(writer_id, version)
        raw = self.get(key)
        return None if raw is None else ObjectManifest.from_json(raw, f"{self.shown}:{key}")

    def newest_manifest(self, writer_id: str) -> ObjectManifest | None:
        """The writer's commit point now (None before its first commit). A version
        deleted between the listing and the read (superseded long ago) is listed again."""
        for _ in range(5):
            versions = self.manifest_versions(writer_id)
            if not versions:
                return None
            found = self.read_manifest(writer_id, versions[-1][0])
            if found is not None:
                return found
        raise InvalidStoreError(
            f"{self.shown}: writer {writer_id!r}'s newest manifest keeps vanishing while "
            "read. Fix: check that nothing but grain_replay deletes objects of the store."
        )

    def publish(self, manifest: ObjectManifest) -> bool:
        """Creates manifest version ``manifest.version``: True if it is now the commit
        point, False if another writer of the id created that version first. A version
        found already there holding exactly this manifest is this call's own (a create
        retried after its answer was lost), so True."""
        key = self.manifest_key(manifest.writer_id, manifest.version)
        text = manifest.to_json().encode()
        if self.create(key, text):
            return True
        return self.get(key) == text

    def piece_key(self, writer_id: str, piece: Piece) -> str:
        return self.writer_key(writer_id, "pieces", piece.name)

    def list_pieces(self, writer_id: str) -> list[tuple[str, float]]:
        """``(object key, LastModified)`` of each piece object of ``writer_id``."""
        return [
            (e["name"], self.modified(e))
            for e in self.listing(self.writer_key(writer_id, "pieces"))
            if e["name"].endswith(".raw")
        ]

    def committed_rows(self) -> dict[str, int]:
        out = {}
        for wid in self.list_writers():
            m = self.newest_manifest(wid)
            if m is not None and m.schema is not None:
                out[wid] = m.committed
        return out


def is_object_store(url: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether ``url`` holds a many-writer store on object storage (its store file)."""
    return what_is_at(url, storage_options) == "store"


def what_is_at(url: str, storage_options: Mapping[str, Any] | None) -> str:
    """``"store"``: a many-writer store on object storage is at ``url``; ``"nothing"``: no
    object is under it (a learner may wait for its writers); ``"other"``: something else,
    or not an object-storage URL this package writes."""
    if protocol_of(url) not in OBJECT_PROTOCOLS:
        return "other"
    try:
        store = ObjectStore(url, storage_options)
        # Looked at before the store file: a writer creates that first, so "something,
        # and no store file after it" is never a store being made.
        something = store.fs.exists(store.root)
        raw = store.get(store.key(parts_lib.STORE_FILE))
        if raw is None:
            return "other" if something else "nothing"
    except (OSError, ValueError):
        return "other"
    try:
        return "store" if json.loads(raw).get("storage") == STORAGE else "other"
    except (ValueError, AttributeError):
        return "other"
