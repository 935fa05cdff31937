"""The on-disk shape of a bounded, many-writer store, shared by its writers and its readers.

A store made by ``ReplayWriter(path, capacity=..., writer_id=...)`` is a
directory::

    path/
      replay_store.json            {"format": "npy" | "hdf5" | "zarr", "layout": 1,
                                    "store_id": <random hex, made once at creation>}
      ordinals/<k>                 writer id holding row-id ordinal k (created O_EXCL)
      writers/<writer_id>/
        lock                       flock'ed by the live writer (store/ownership.py)
        owner.json                 host, pid, start time of the writer holding the lock
        manifest.json              the commit point (replaced atomically at each flush)
        seg-000000000000[.h5|.zarr]  a plain single-writer store of segment_rows rows

Segment ``j`` of a writer holds its rows ``[j * segment_rows, (j + 1) * segment_rows)``
(the writer's sequence numbers), so a row's segment follows from its number. A
row's id is ``ordinal << ID_SHIFT | seq``: unique while the row lives, and
never reused (sequence numbers only grow).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import uuid
from typing import Any

import numpy as np

from grain_replay.errors import (
    InvalidArgumentError,
    InvalidStoreError,
)
from grain_replay.store.filesync import (
    StagedText,
    fsync_path,
    replace_text,
    stage_text,
    temp_path,
)

__all__ = [
    "ID_SHIFT",
    "SEQ_MASK",
    "STORE_FILE",
    "Manifest",
    "RowIds",
    "Segment",
    "check_capacity",
    "check_writer_id",
    "claim_ordinal",
    "committed_rows",
    "create_store_file",
    "id_ordinals",
    "being_made",
    "is_parts_store",
    "is_safe_writer_id",
    "list_writers",
    "make_ids",
    "read_manifest",
    "read_store_file",
    "read_store_id",
    "segment_name",
    "split_ids",
    "stage_manifest",
    "write_manifest",
    "writer_dir",
]

STORE_FILE = "replay_store.json"
WRITERS_DIR = "writers"
ORDINALS_DIR = "ordinals"
MANIFEST_FILE = "manifest.json"
LAYOUT_VERSION = 1
ID_SHIFT = 40  # 2**40 rows per writer, 2**23 writers
SEQ_MASK = (1 << ID_SHIFT) - 1
MAX_ORDINAL = (1 << (63 - ID_SHIFT)) - 1
# Evicted segments kept on disk (and listed as retired) so that a reader whose
# rows were drawn against a slightly older snapshot still finds them by id.
RETAIN_SEGMENTS = 1


class RowIds(np.ndarray):
    """Row ids (int64, ``ordinal << ID_SHIFT | seq``) as a prioritized batch's ``index``.

    ``sharded_device_put`` keeps them on the host: they need 64 bits, and jax keeps
    32 without ``jax_enable_x64``. Otherwise a plain numpy array.
    """


def make_ids(ordinal: Any, seq: Any) -> Any:
    """The ids ``ordinal << ID_SHIFT | seq`` of writer ``ordinal``'s rows ``seq``.

    With :func:`split_ids`, the one place that packs them. Ints give an int; numpy arrays
    (either side, broadcast) an array of their dtype (int64 from int64), no copy made.
    Unchecked, as per-batch reads call it: ``0 <= seq <= SEQ_MASK`` and ``0 <= ordinal <=
    MAX_ORDINAL`` (:func:`claim_ordinal` keeps it) are the caller's.
    """
    return ordinal << ID_SHIFT | seq


def split_ids(ids: Any) -> tuple[Any, Any]:
    """``(ordinal, seq)`` of ``ids`` (ints or int64): :func:`make_ids` undone. A negative
    id (-1: no row) splits to a negative ordinal, which no writer has."""
    return ids >> ID_SHIFT, ids & SEQ_MASK


def id_ordinals(ids: Any) -> Any:
    """The ordinal of :func:`split_ids` alone (per-batch reads: one array made, not two)."""
    return ids >> ID_SHIFT


_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SUFFIX = {"npy": "", "hdf5": ".h5", "zarr": ".zarr"}


def is_parts_store(path: str) -> bool:
    """Whether ``path`` is the directory of a bounded, many-writer store."""
    return os.path.isfile(os.path.join(path, STORE_FILE))


def being_made(path: str) -> bool:
    """Whether ``path`` is a many-writer store a writer is creating right now: a directory
    holding nothing but what :func:`create_store_file` makes before its store file (an
    empty directory included)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    made = {WRITERS_DIR, ORDINALS_DIR}
    return all(n in made or n.startswith(STORE_FILE) for n in names)


def is_safe_writer_id(name: str) -> bool:
    """Whether ``name`` is a writer id :func:`check_writer_id` accepts."""
    return bool(_SAFE_ID.match(name)) and name != ".."


def check_writer_id(writer_id: Any, store: str) -> str:
    """``writer_id`` if it is a safe file name, else the error naming the fix."""
    if not isinstance(writer_id, str) or not _SAFE_ID.match(writer_id) or writer_id == "..":
        raise InvalidArgumentError(
            f"{store}: writer_id must be a safe file name (letters, digits, '.', '_', '-', "
            f"starting with a letter or digit, at most 128 characters), got {writer_id!r}. "
            "Fix: pass e.g. writer_id='actor-3'."
        )
    return writer_id


def check_capacity(capacity: Any, store: str, writer_id: str) -> int | None:
    """``capacity`` as a positive int (or None: unbounded), else the error naming the fix."""
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise InvalidArgumentError(
            f"{store}: writer {writer_id!r}: capacity must be a positive int (rows kept per "
            f"writer) or None (unbounded), got {capacity!r}. Fix: pass e.g. capacity=1_000_000."
        )
    return int(capacity)


def writer_dir(store: str, writer_id: str) -> str:
    return os.path.join(store, WRITERS_DIR, writer_id)


def segment_name(first: int, fmt: str) -> str:
    """The file (or directory) name of the segment whose first row is ``first``."""
    return f"seg-{first:012d}{_SUFFIX[fmt]}"


# -- the store file ----------------------------------------------------------------


def create_store_file(store: str, fmt: str) -> None:
    """Creates ``store/replay_store.json`` once (``link`` fails if it exists: no overwrite).

    Its ``store_id``, random and made here, tells this store from one made later at
    the same path with the same writer ids (a checkpoint's watermark records it).
    """
    os.makedirs(os.path.join(store, WRITERS_DIR), exist_ok=True)
    os.makedirs(os.path.join(store, ORDINALS_DIR), exist_ok=True)
    final = os.path.join(store, STORE_FILE)
    # Linked, not replaced (filesync.atomic_replace): an existing store file must stay.
    # The temp name starts with STORE_FILE, as being_made expects.
    tmp = temp_path(final)
    with open(tmp, "w") as f:
        f.write(json.dumps({"format": fmt, "layout": LAYOUT_VERSION, "store_id": uuid.uuid4().hex}))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, final)
    except FileExistsError:
        pass  # another writer created it first; the caller reads and checks it
    finally:
        os.unlink(tmp)
    fsync_path(store)


def _store_json(store: str) -> Any:
    with open(os.path.join(store, STORE_FILE)) as f:
        return json.load(f)


def read_store_file(store: str) -> str:
    """The format of the store at ``store``."""
    file = os.path.join(store, STORE_FILE)
    try:
        raw = _store_json(store)
        fmt = raw["format"]
        if fmt not in _SUFFIX or int(raw["layout"]) > LAYOUT_VERSION:
            raise ValueError(f"format {fmt!r}, layout {raw['layout']!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidStoreError(
            f"{file}: not a readable grain_replay store file ({type(e).__name__}: {e}). "
            "Fix: upgrade grain_replay, or restore the file."
        ) from e
    return str(fmt)


def read_store_id(store: str) -> str | None:
    """The ``store_id`` of the store at ``store``; None for a store made before there
    was one (or no store file there: :func:`read_store_file` says why)."""
    try:
        found = _store_json(store).get("store_id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


# -- ordinals: the writer part of a row id --------------------------------------------


def claim_ordinal(store: str, writer_id: str) -> int:
    """The ordinal of ``writer_id`` (claimed now with ``O_EXCL`` if it has none)."""
    folder = os.path.join(store, ORDINALS_DIR)
    os.makedirs(folder, exist_ok=True)
    taken = []
    for name in os.listdir(folder):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError), open(os.path.join(folder, name)) as f:
            if f.read().strip() == writer_id:
                return int(name)
        taken.append(int(name))
    k = max(taken, default=-1) + 1
    while k <= MAX_ORDINAL:
        try:
            fd = os.open(os.path.join(folder, str(k)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            k += 1
            continue
        try:
            os.write(fd, writer_id.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(folder)
        return k
    raise InvalidStoreError(f"{store}: no row-id ordinal left for writer {writer_id!r}.")


# -- the manifest: a writer's commit point ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Segment:
    first: int  # sequence number of its first row (a multiple of segment_rows)
    rows: int  # committed rows in it


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A writer's committed state: what readers of the store see of it."""

    writer_id: str
    ordinal: int
    format: str
    capacity: int | None
    segment_rows: int
    committed: int  # rows ever committed (the next row's sequence number)
    segments: tuple[Segment, ...]  # segments holding live rows, oldest first
    retired: tuple[Segment, ...] = ()  # evicted, still on disk (RETAIN_SEGMENTS)
    schema: str | None = None  # the store's StoreMetadata JSON (leaves, treedef), N = 0

    @property
    def live_start(self) -> int:
        """The first live row's sequence number."""
        if self.capacity is None:
            return 0
        return max(0, self.committed - self.capacity)

    @property
    def live(self) -> int:
        return self.committed - self.live_start

    @property
    def evicted(self) -> int:
        return self.live_start

    def to_json(self) -> str:
        return json.dumps(
            {
                "layout": LAYOUT_VERSION,
                "writer_id": self.writer_id,
                "ordinal": self.ordinal,
                "format": self.format,
                "capacity": self.capacity,
                "segment_rows": self.segment_rows,
                "committed": self.committed,
                "segments": [[s.first, s.rows] for s in self.segments],
                "retired": [[s.first, s.rows] for s in self.retired],
                "schema": self.schema,
            }
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            raw = json.loads(text)
            if int(raw["layout"]) > LAYOUT_VERSION:
                raise ValueError(f"layout {raw['layout']} is newer than this grain_replay")
            m = cls(
                writer_id=str(raw["writer_id"]),
                ordinal=int(raw["ordinal"]),
                format=str(raw["format"]),
                capacity=None if raw["capacity"] is None else int(raw["capacity"]),
                segment_rows=int(raw["segment_rows"]),
                committed=int(raw["committed"]),
                segments=tuple(Segment(int(a), int(b)) for a, b in raw["segments"]),
                retired=tuple(Segment(int(a), int(b)) for a, b in raw.get("retired", [])),
                schema=raw.get("schema"),
            )
            if m.format not in _SUFFIX or m.segment_rows <= 0:
                raise ValueError(f"format {m.format!r}, segment_rows {m.segment_rows}")
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidStoreError(
                f"{where}: the writer manifest is malformed ({type(e).__name__}: {e}). "
                "Fix: restore it, or remove that writer's folder to drop its rows."
            ) from e
        return m


def write_manifest(wdir: str, manifest: Manifest) -> None:
    """Commits ``manifest`` atomically: readers see the old one or this one, never a mix."""
    replace_text(os.path.join(wdir, MANIFEST_FILE), manifest.to_json())


def stage_manifest(wdir: str, manifest: Manifest) -> StagedText:
    """:func:`write_manifest` in two steps: written beside the old one now; the commit
    (``publish_text`` after an ``fsync`` of its ``fd``) is the caller's."""
    return stage_text(os.path.join(wdir, MANIFEST_FILE), manifest.to_json())


def read_manifest(wdir: str) -> Manifest | None:
    """The writer's manifest, or None before its first commit."""
    file = os.path.join(wdir, MANIFEST_FILE)
    try:
        with open(file) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return Manifest.from_json(text, file)


def list_writers(store: str) -> list[str]:
    """Writer ids with a folder under ``store/writers``, sorted."""
    try:
        return sorted(
            e.name
            for e in os.scandir(os.path.join(store, WRITERS_DIR))
            if e.is_dir() and _SAFE_ID.match(e.name)
        )
    except FileNotFoundError:
        return []


def committed_rows(store: str) -> dict[str, int]:
    """Each writer's committed rows (evicted ones included) as its manifest says now.

    A writer without a commit yet is left out. One small file read per writer.
    """
    out = {}
    for wid in list_writers(store):
        m = read_manifest(writer_dir(store, wid))
        if m is not None:
            out[wid] = m.committed
    return out
