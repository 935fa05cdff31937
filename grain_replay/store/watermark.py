"""Commit watermarks: how far each writer of a store had committed at a replay checkpoint.

A replay iterator's checkpoint (``get_state()``, saved by grain's Orbax handler)
records the rows its sampler drew from: for a plain store the committed length
it had seen, for a bounded many-writer store each writer's committed sequence
number. A whole run (actors and learner) restarts from one checkpoint without
mixing in rows written after it: the learner restores the checkpoint (it draws
below the watermark), and each actor reopens its writer with
``gr.ReplayWriter(path, resume_from=gr.read_watermark(checkpoint))``, which drops
the rows committed after the watermark before appending again.

Writers and readers both import this module; it imports neither.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from grain_replay.errors import CheckpointMismatchError
from grain_replay.store import parts as parts_lib
from grain_replay.store.formats import (
    detect_format,
    import_h5py,
    import_zarr,
    is_url,
    metadata_from_attrs,
    read_npy_metadata,
)

__all__ = [
    "Watermark",
    "identity_mismatch",
    "read_watermark",
    "same_path",
    "same_store",
    "store_id_at",
]

_PROCESS_FILE_RE = re.compile(r"process_\d+-of-\d+\.json")


@dataclasses.dataclass(frozen=True)
class Watermark:
    """The rows of a store that a replay checkpoint covers.

    A checkpoint names its store by ``store_id``, not by ``store``: it restores over a
    symlink, a relative path, a moved folder or a copy of the store (:func:`same_store`).

    Attributes:
      store: the store's absolute path (or URL) as its source named it when saved.
      rows: a plain (single-writer) store's committed length; None for a bounded one.
      writers: a bounded many-writer store's committed sequence number per writer id
        (rows ever committed by that writer); None for a plain store.
      store_id: the store's id (made once when a writer created the store: a many-writer
        store's ``replay_store.json``, a plain store's metadata): a copy has the same, a
        store deleted and made again at the same path another. None for a store made
        before stores had ids (or a foreign one): then it is matched by its real path.
    """

    store: str
    rows: int | None = None
    writers: Mapping[str, int] | None = None
    store_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"store": self.store}
        if self.rows is not None:
            out["rows"] = self.rows
        if self.writers is not None:
            out["writers"] = dict(self.writers)
        if self.store_id is not None:
            out["store_id"] = self.store_id
        return out

    @classmethod
    def from_json(cls, value: Any, where: str = "the checkpoint") -> Watermark:
        try:
            store = value["store"]
            rows = value.get("rows")
            writers = value.get("writers")
            store_id = value.get("store_id")
            if not isinstance(store, str):
                raise TypeError(f"store {store!r}")
            if store_id is not None and not isinstance(store_id, str):
                raise TypeError(f"store_id {store_id!r}")
            if rows is not None and (not isinstance(rows, int) or rows < 0):
                raise ValueError(f"rows {rows!r}")
            if writers is not None:
                writers = {str(k): int(v) for k, v in dict(writers).items()}
            if (rows is None) == (writers is None):
                raise ValueError("exactly one of rows and writers")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointMismatchError(
                f"{where} holds no valid commit watermark ({type(e).__name__}: {e}). Fix: pass "
                "the state of a replay iterator (sampling=gr.UniformReplay() or "
                "gr.PrioritizedReplay()), or the Orbax item directory it was saved to."
            ) from None
        return cls(store, rows, writers, store_id)

    def rows_for(self, writer_id: str | None = None) -> int:
        """The committed rows of ``writer_id`` (None: a plain store) the checkpoint covers.

        A writer the watermark does not name started after the checkpoint: 0.
        """
        if self.writers is None:
            assert self.rows is not None
            return self.rows
        return int(self.writers.get("" if writer_id is None else writer_id, 0))

    def merge(self, other: Watermark) -> Watermark:
        """The rows either covers (processes of one learner each record their own view)."""
        if not same_store(self, other.store, other.store_id) or (other.rows is None) != (
            self.rows is None
        ):
            raise CheckpointMismatchError(
                f"The checkpoint's processes name different stores ({self.store} and "
                f"{other.store}). Fix: pass the checkpoint of one replay iterator."
            )
        if self.rows is not None and other.rows is not None:
            return Watermark(
                self.store,
                rows=max(self.rows, other.rows),
                store_id=self.store_id or other.store_id,
            )
        assert self.writers is not None and other.writers is not None
        ids = set(self.writers) | set(other.writers)
        merged = {i: max(self.writers.get(i, 0), other.writers.get(i, 0)) for i in ids}
        return Watermark(self.store, writers=merged, store_id=self.store_id or other.store_id)


def _from_state(state: Any, where: str, store: Any = None) -> Watermark:
    if hasattr(state, "get_state") and callable(state.get_state):
        state = state.get_state()
    if isinstance(state, (bytes, bytearray, str)):
        try:
            state = json.loads(state)
        except ValueError as e:
            raise CheckpointMismatchError(
                f"{where} is not a replay iterator's state ({e}). Fix: pass what get_state() "
                "returned, or the Orbax item directory it was saved to."
            ) from None
    if isinstance(state, Mapping) and "watermarks" in state:  # a replay mixture's
        return _pick(state["watermarks"], where, store)
    if not isinstance(state, Mapping) or "watermark" not in state:
        raise CheckpointMismatchError(
            f"{where} records no commit watermark: it is not the state of a replay iterator "
            "(sampling=gr.UniformReplay() or gr.PrioritizedReplay(), or a mixture with "
            "sampling=gr.UniformReplay()) saved by this version. Fix: checkpoint the "
            "iterator of a replay loader."
        )
    mark = Watermark.from_json(state["watermark"], where)
    if store is not None and not _names(mark, store):
        raise CheckpointMismatchError(
            f"{where} replayed {mark.store}, not {os.fspath(store)}. Fix: pass the store the "
            "checkpoint replayed, or store=None."
        )
    return mark


def same_path(a: str, b: str) -> bool:
    """Whether two paths reach one store: the same real path (symlinks and relative paths
    resolved); URLs as written."""
    if is_url(a) or is_url(b):
        return a == b
    return os.path.realpath(a) == os.path.realpath(b)


def same_store(mark: Watermark, store: str, store_id: str | None) -> bool:
    """Whether the store at ``store`` with id ``store_id`` is the one ``mark`` names: by id
    when both have one (whatever the paths: a symlink, a moved folder, a copy), else by
    real path (a store or checkpoint from before ids)."""
    if mark.store_id is not None and store_id is not None:
        return mark.store_id == store_id
    return same_path(mark.store, store)


def identity_mismatch(mark: Watermark, store: str, store_id: str | None) -> str:
    """Why the store at ``store`` (id ``store_id``) is not the one ``mark`` names: both
    ids and both paths, and what to do."""
    if mark.store_id is not None and store_id is not None:
        if same_path(mark.store, store):
            return (
                f"the store {mark.store_id} that was at {mark.store} is gone; the store there "
                f"now is another ({store_id}): it was deleted and made again, and its rows are "
                "not the ones the checkpoint covers"
            )
        return (
            f"the checkpoint names the store {mark.store_id} (saved at {mark.store}); {store} "
            f"is another store ({store_id}). A symlink, a relative path, a moved folder or a "
            "copy of the saved store would have its id"
        )
    return (
        f"the checkpoint names the store at {mark.store} (id "
        f"{mark.store_id or 'none: saved before stores had ids'}); {store} (id "
        f"{store_id or 'none: made before stores had ids'}) is not it. Without both ids a "
        "store is matched by its real path (a symlink or a relative path to it works), so a "
        "copy or a moved folder of it cannot be: reach the store at its saved path, or give "
        "it an id (reopen a gr.ReplayWriter on it and flush, or rewrite it with gr.write) "
        "and take a new checkpoint"
    )


def store_id_at(path: str) -> str | None:
    """The id of the store at ``path`` (a many-writer store's ``replay_store.json``, a
    plain store's metadata); None for a URL, a store without one, or nothing readable."""
    if is_url(path):
        return None
    if parts_lib.is_parts_store(path):
        return parts_lib.read_store_id(path)
    try:
        fmt = detect_format(path)
        if fmt == "npy" and os.path.isdir(path):
            meta = read_npy_metadata(path)
        elif fmt == "hdf5":
            with import_h5py().File(path, "r", locking=False) as f:
                meta = metadata_from_attrs(f.attrs, path)
        elif fmt == "zarr":
            meta = metadata_from_attrs(import_zarr().open_group(path, mode="r").attrs, path)
        else:
            return None
    except Exception:  # unreadable, foreign, missing: no id to match
        return None
    return None if meta is None else meta.store_id


def _names(mark: Watermark, store: Any) -> bool:
    """Whether ``mark`` is the watermark of the store the user named (``store=``)."""
    store = os.fspath(store)
    return same_path(mark.store, store) or (
        mark.store_id is not None and store_id_at(store) == mark.store_id
    )


def _pick(marks: Any, where: str, store: Any) -> Watermark:
    """The watermark of ``store`` among a mixture's (by source name); with no ``store``,
    that of its one many-writer store, or of its one store."""
    try:
        found = {str(name): Watermark.from_json(m, where) for name, m in dict(marks).items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointMismatchError(
            f"{where} holds no valid commit watermarks ({type(e).__name__}: {e}). Fix: pass "
            "the state of a replay mixture, or the Orbax item directory it was saved to."
        ) from None
    stores = {name: m.store for name, m in found.items()}
    if store is not None:
        hits = [m for m in found.values() if _names(m, store)]
        if not hits:
            raise CheckpointMismatchError(
                f"{where} is a mixture's checkpoint over {stores}; none is {os.fspath(store)}. "
                "Fix: pass store= one of those."
            )
        return hits[0]
    online = [m for m in found.values() if m.writers is not None]
    if len(online) == 1:
        return online[0]
    if len(found) == 1:
        return next(iter(found.values()))
    raise CheckpointMismatchError(
        f"{where} is a mixture's checkpoint over {stores}: say whose watermark you want. "
        "Fix: gr.read_watermark(checkpoint, store=<the store's path>)."
    )


def read_watermark(checkpoint: Any, store: str | os.PathLike[str] | None = None) -> Watermark:
    """The commit watermark a replay checkpoint records, for restarting the writers there.

    Args:
      checkpoint: the Orbax item directory grain's ``CheckpointSave`` wrote (e.g.
        ``ckpt/1000/data``; with several learner processes the rows any of them
        drew from are covered), one of its ``process_<i>-of-<n>.json`` files, the
        bytes or dict ``get_state()`` returned, or the iterator itself.
      store: the store whose watermark to return, for a replay mixture's checkpoint
        (it records one per source). None: the mixture's one many-writer store (or
        its one store); for one store's checkpoint, that store.

    Returns:
      A :class:`Watermark`; pass it to ``gr.ReplayWriter(path, resume_from=...)``.

    Raises:
      CheckpointMismatchError: (a ``ValueError``) the checkpoint holds no replay state,
        or none of ``store``; or it is a mixture's over several many-writer stores
        and ``store`` is None.
      FileNotFoundError: the path does not exist.

    Examples:
      >>> mark = gr.read_watermark("ckpt/1000/data")  # doctest: +SKIP
      >>> writer = gr.ReplayWriter("replay.npy", resume_from=mark)  # doctest: +SKIP
    """
    if not isinstance(checkpoint, (str, os.PathLike)):
        return _from_state(checkpoint, "the state", store)
    path = os.fspath(checkpoint)
    if os.path.isfile(path):
        with open(path) as f:
            return _from_state(f.read(), path, store)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No checkpoint at {path}. Fix: pass the Orbax item directory.")
    files = sorted(n for n in os.listdir(path) if _PROCESS_FILE_RE.fullmatch(n))
    if not files:
        raise CheckpointMismatchError(
            f"{path} holds no process_<i>-of-<n>.json file of grain's checkpoint handler. Fix: "
            "pass the item directory (the step directory joined with the item's name)."
        )
    mark = None
    for name in files:
        with open(os.path.join(path, name)) as f:
            one = _from_state(f.read(), os.path.join(path, name), store)
        mark = one if mark is None else mark.merge(one)
    assert mark is not None
    return mark
