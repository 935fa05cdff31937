"""``gr.truncate_to_watermark``: cut every writer of a store back to a replay checkpoint.

The one call a whole-run restart makes before any actor reopens its writer (see
docs/checkpointing.md): each writer the watermark names keeps the rows it had
committed at the checkpoint, a writer it does not name (one that started after
it) keeps none. Every cut is checked before any is made.
"""

from __future__ import annotations

import os
from typing import Any

from grain_replay.errors import (
    InvalidArgumentError,
    InvalidStoreError,
    StoreNotFoundError,
    WriterBusyError,
)
from grain_replay.store import ownership
from grain_replay.store import parts as parts_lib
from grain_replay.store.formats import is_url
from grain_replay.store.lease import Lease
from grain_replay.store.objects import DEFAULT_LEASE_S, ObjectStore, check_object_url
from grain_replay.store.watermark import Watermark
from grain_replay.writers import part_manifest
from grain_replay.writers.object_cut import read_plan
from grain_replay.writers.replay_writer import ReplayWriter
from grain_replay.writers.resume import resume_rows

__all__ = ["truncate_to_watermark"]


def truncate_to_watermark(
    path: str | os.PathLike[str],
    watermark: Watermark | int,
    *,
    storage_options: dict[str, Any] | None = None,
) -> dict[str | None, int]:
    """Drops every row committed to ``path`` after the checkpoint ``watermark`` records.

    For a plain store the same as ``gr.ReplayWriter(path, resume_from=watermark).close()``;
    for a many-writer store, each writer part is cut as its writer's
    ``resume_from=watermark`` would cut it, the parts of writers that started after the
    checkpoint included. Call it before the actors restart: a live writer of the store
    is refused, and nothing is cut unless every writer can be.

    Args:
      path: the store the checkpoint's learner replayed, by any path: a symlink, a moved
        folder or a copy of it is the same store (its store id; by real path for a store
        made before ids).
      watermark: ``gr.read_watermark(checkpoint)`` (or a plain store's row count).
      storage_options: fsspec options of an ``s3://`` URL: ``path`` may be a many-writer
        store on object storage (matched by its store id), whose writers' leases must
        have been released or run out (docs/replay_store.md#on-object-storage).

    Returns:
      The committed rows each writer keeps: ``{writer_id: rows}``, ``{None: rows}`` for a
      plain store.

    Raises:
      WriterBusyError: a live writer holds one of the store's writer ids.
      InvalidStoreError: a writer holds fewer rows than the watermark, or rows the cut
        would keep live were evicted already (nothing is changed).
      InvalidArgumentError: the watermark is of another store (another store id, both
        named) or another kind of store.

    Examples:
      >>> mark = gr.read_watermark("ckpt/1000/data")  # doctest: +SKIP
      >>> gr.truncate_to_watermark("replay", mark)  # doctest: +SKIP
      {'actor-0': 52000, 'actor-1': 51987}
    """
    text = os.fspath(path)
    if is_url(text):
        return _truncate_objects(text, watermark, storage_options)
    if storage_options is not None:
        raise InvalidArgumentError(
            f"{text}: storage_options apply to a store on object storage (an s3:// URL) "
            "only. Fix: drop storage_options."
        )
    store = os.path.abspath(text)
    if not parts_lib.is_parts_store(store):
        with ReplayWriter(store, resume_from=watermark) as w:
            return {None: w.committed}
    ids = set(parts_lib.list_writers(store))
    if isinstance(watermark, Watermark) and watermark.writers is not None:
        ids |= set(watermark.writers)
    plans = {}
    for wid in sorted(ids):
        where = f"{store} (writer {wid!r})"
        rows = resume_rows(watermark, store, wid)
        wdir = parts_lib.writer_dir(store, wid)
        holder = ownership.live_holder(wdir)
        if holder is not None:
            raise WriterBusyError(
                f"{where}: a live writer (pid {holder.get('pid')} on host "
                f"{holder.get('host')!r}) holds this id, so the store cannot be cut back to "
                "the checkpoint. Fix: stop every actor of the run first (nothing was cut)."
            )
        m = parts_lib.read_manifest(wdir)
        if m is None:
            if rows:
                raise InvalidStoreError(
                    f"{where}: the checkpoint covers {rows} rows of this writer, which has "
                    "committed none here. Fix: pass the store the checkpoint replayed "
                    "(nothing was cut)."
                )
            continue
        part_manifest.cut(m, rows, where)  # raises before anything changes
        plans[wid] = (m.capacity, rows)
    kept: dict[str | None, int] = {}
    for wid, (capacity, rows) in plans.items():
        with ReplayWriter(store, capacity=capacity, writer_id=wid, resume_from=rows) as w:
            kept[wid] = w.committed
    return kept


def _truncate_objects(
    url: str, watermark: Watermark | int, storage_options: dict[str, Any] | None
) -> dict[str | None, int]:
    """:func:`truncate_to_watermark` of a many-writer store on object storage: every
    writer's cut checked (its lease free, its rows still on the bucket) before any is made."""
    check_object_url(url, None)
    objects = ObjectStore(url, storage_options)
    found = objects.read_store_file()
    if found is None:
        raise StoreNotFoundError(
            f"{objects.shown}: no many-writer store there (no {parts_lib.STORE_FILE}). Fix: "
            "pass the URL of the store the checkpoint replayed, with its storage_options."
        )
    ids = set(objects.list_writers())
    if isinstance(watermark, Watermark) and watermark.writers is not None:
        ids |= set(watermark.writers)
    plans = {}
    for wid in sorted(ids):
        where = f"{objects.shown} (writer {wid!r})"
        rows = resume_rows(watermark, objects.shown, wid, store_id=found.get("store_id"))
        holder = Lease(objects, wid, DEFAULT_LEASE_S, where).live_holder()
        if holder is not None:
            raise WriterBusyError(
                f"{where}: a live writer (pid {holder.get('pid')} on host "
                f"{holder.get('host')!r}, lease epoch {holder.get('epoch')}) holds this id, so "
                "the store cannot be cut back to the checkpoint. Fix: stop every actor of the "
                "run first, or wait for the lease of one that died to run out (nothing was cut)."
            )
        m = objects.newest_manifest(wid)
        if m is None:
            if rows:
                raise InvalidStoreError(
                    f"{where}: the checkpoint covers {rows} rows of this writer, which has "
                    "committed none here. Fix: pass the store the checkpoint replayed "
                    "(nothing was cut)."
                )
            continue
        read_plan(objects, wid, rows, where)  # raises before anything changes
        plans[wid] = (m.capacity, rows)
    kept: dict[str | None, int] = {}
    for wid, (capacity, rows) in plans.items():
        with ReplayWriter(
            url, capacity=capacity, writer_id=wid, resume_from=rows,
            storage_options=storage_options,
        ) as w:  # fmt: skip
            kept[wid] = w.committed
    return kept
