"""``gr.truncate_to_watermark``: cut every writer of a store back to a replay checkpoint.

The one call a whole-run restart makes before any actor reopens its writer (see
docs/checkpointing.md): each writer the watermark names keeps the rows it had
committed at the checkpoint, a writer it does not name (one that started after
it) keeps none. Every cut is checked before any is made.
"""

from __future__ import annotations

import os

from grain_replay.errors import InvalidStoreError, WriterBusyError
from grain_replay.store import ownership
from grain_replay.store import parts as parts_lib
from grain_replay.store.watermark import Watermark
from grain_replay.writers import part_manifest
from grain_replay.writers.replay_writer import ReplayWriter
from grain_replay.writers.resume import resume_rows

__all__ = ["truncate_to_watermark"]


def truncate_to_watermark(
    path: str | os.PathLike[str], watermark: Watermark | int
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
    store = os.path.abspath(os.fspath(path))
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
