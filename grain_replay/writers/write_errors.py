"""The errors of background device writes: which rows failed, which leaf, and the fix.

A failed copy or write drops the rows appended since the last flush (as a crash
would); the rows committed before stay intact. The messages say so, name the leaf
where one is known, and say how to go on (reopen the store)."""

from __future__ import annotations

from grain_replay.errors import BackgroundWriteError
from grain_replay.writers.device.leaves import leaf_name

__all__ = ["LeafWriteError", "commit_error", "sync_error", "thread_error", "write_error"]

_LOST = (
    "The rows committed before (by the last flush) are intact; the rows appended since "
    "are dropped, as in a crash."
)
_REOPEN = "then reopen the store with gr.ReplayWriter to append after its committed rows."


class LeafWriteError(Exception):
    """Raised by a write path to say which leaf failed (the cause is chained)."""

    def __init__(self, leaf: str):
        super().__init__(leaf)
        self.leaf = leaf


def write_error(
    where: str, first: int, rows: int, e: Exception, copying: str | None = None
) -> BackgroundWriteError:
    """The error of a failed host copy (``copying``: the leaf) or write of rows
    ``[first, first + rows)``; a :class:`LeafWriteError` names the leaf written."""
    cause: BaseException = e
    failed: str | None = None
    if copying is not None:
        failed = copying
        what = f"copying it to host failed for leaf {leaf_name(copying)!r} of"
    elif isinstance(e, LeafWriteError):
        failed = e.leaf
        cause = e.__cause__ or e
        what = f"writing it failed for leaf {leaf_name(e.leaf)!r} of"
    else:  # the store's own step (a new segment, syncing filled ones): every leaf
        what = "writing them failed for"
    error = BackgroundWriteError(
        f"{where}: {what} rows [{first}, {first + rows}) appended earlier: "
        f"{type(cause).__name__}: {cause}. {_LOST} Fix: remove the cause (disk space, "
        "permissions; arrays must not be donated or deleted before flush()), " + _REOPEN,
        leaf="" if failed is None else leaf_name(failed),
    )
    error.__cause__ = cause
    return error


def sync_error(where: str, e: Exception) -> BackgroundWriteError:
    """The error of a failed commit of the segments the writes filled (the sync thread)."""
    error = BackgroundWriteError(
        f"{where}: committing the segments filled by rows appended earlier failed: "
        f"{type(e).__name__}: {e}. {_LOST} Fix: remove the cause (disk space, "
        "permissions), " + _REOPEN
    )
    error.__cause__ = e
    return error


def thread_error(where: str, thread: str, e: BaseException) -> BackgroundWriteError:
    """The error of a writer ``thread`` that failed outside a copy, write, commit or sync
    (a bug, a thread that could not start, no memory): callers raise it, not wait."""
    error = BackgroundWriteError(
        f"{where}: the device writer's {thread} thread failed: {type(e).__name__}: {e}. "
        f"{_LOST} Fix: close() the writer and report the error with its traceback (chained "
        "below) as a bug, " + _REOPEN
    )
    error.__cause__ = e
    return error


def commit_error(where: str, before: int, upto: int, e: Exception) -> BackgroundWriteError:
    """The error of a failed background commit of rows ``[before, upto)``."""
    failed = e.leaf if isinstance(e, LeafWriteError) else None
    cause: BaseException = (e.__cause__ or e) if failed is not None else e
    what = "every leaf" if failed is None else f"leaf {leaf_name(failed)!r}"
    error = BackgroundWriteError(
        f"{where}: the background commit (flush(wait=False)) of rows [{before}, {upto}) "
        f"failed for {what}: {type(cause).__name__}: {cause}. What the last completed "
        f"commit made durable ({before} rows) is intact; the rows appended since are "
        "dropped, as in a crash. Fix: remove the cause (disk space, permissions), then "
        "reopen the store with gr.ReplayWriter to append after its committed rows.",
        leaf="" if failed is None else leaf_name(failed),
    )
    error.__cause__ = cause
    return error
