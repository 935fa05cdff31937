"""``resume_from=``: the committed rows a writer reopened at a replay checkpoint keeps.

See :mod:`grain_replay.store.watermark` for what a checkpoint records and
docs/checkpointing.md for restarting a whole run (actors and learner) from one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from grain_replay.errors import InvalidArgumentError
from grain_replay.store.watermark import Watermark, identity_mismatch, same_store, store_id_at

__all__ = ["resume_rows"]


def resume_rows(
    mark: Any, store: str, writer_id: str | None, *, store_id: str | None = None
) -> int:
    """The rows of ``writer_id`` (None: a plain store) that ``resume_from=mark`` keeps.

    Args:
      mark: a :class:`~grain_replay.Watermark` (``gr.read_watermark(checkpoint)``), or a
        row count (for a writer part: its committed sequence number).
      store: the store's absolute path (or its URL, credentials redacted).
      writer_id: the writer part being reopened, or None for a plain store.
      store_id: the store's id where the caller read it (a store on object storage);
        None: read at ``store``.

    Raises:
      InvalidArgumentError: ``mark`` is of another store (another id, or another real
        path where the store or the watermark has no id; a store made again at the path
        since has another id), of the other kind of store (plain vs many-writer), or
        neither a watermark nor a row count >= 0.
    """
    who = store if writer_id is None else f"{store} (writer {writer_id!r})"
    if isinstance(mark, Watermark):
        if writer_id is None and mark.writers is not None:
            raise InvalidArgumentError(
                f"resume_from names the writers {sorted(mark.writers)} of a bounded "
                f"many-writer store, but {store} is opened as a plain store. Fix: "
                "reopen each writer with its writer_id= and the same resume_from."
            )
        if writer_id is not None and mark.writers is None:
            raise InvalidArgumentError(
                f"{who}: resume_from is the watermark of the plain store {mark.store} "
                f"({mark.rows} rows), not of a many-writer store. Fix: pass the checkpoint "
                "of a loader over this store (gr.read_watermark(checkpoint)), or drop "
                "writer_id/capacity to reopen a plain store."
            )
        sid = store_id if store_id is not None else store_id_at(store)
        if not same_store(mark, store, sid):
            raise InvalidArgumentError(
                f"{who}: resume_from is the watermark of another store: "
                f"{identity_mismatch(mark, store, sid)}. Fix: reopen the store the checkpoint "
                "replayed (by any path: a symlink, a moved folder or a copy of it has its id), "
                "or pass resume_from=mark.rows_for(...) to cut this one at the same row count."
            )
        return mark.rows_for(writer_id)
    if isinstance(mark, (bool, np.bool_)) or not isinstance(mark, (int, np.integer)):
        raise InvalidArgumentError(
            f"{who}: resume_from must be a gr.Watermark (gr.read_watermark(checkpoint)) or a "
            f"row count, got {mark!r}. Fix: resume_from=gr.read_watermark(<checkpoint "
            "directory>), or the row count to keep."
        )
    if mark < 0:
        raise InvalidArgumentError(
            f"{who}: resume_from must be >= 0 rows, got {mark}. Fix: the rows to keep "
            "(0 keeps none), or a gr.Watermark."
        )
    return int(mark)
