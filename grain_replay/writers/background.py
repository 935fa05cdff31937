"""Writes from the device: appends of jax.Array leaves copied to host and written by one thread.

``ReplayWriter.append`` starts each device leaf's copy (``copy_to_host_async``)
and queues the tree; one background thread takes the trees in append order, waits
for their host copies (``np.asarray``) and writes them through the writer's own
write path, several appends at a time: it sleeps until ``WRITE_BATCH_BYTES`` are
queued (or a caller waits for it), then writes what is queued as one block, one
write per leaf. ``drain()`` (called by ``flush``/``close``) waits for the queue;
the bytes queued are bounded, and ``submit`` waits beyond the bound. A failure in
the thread stops it, drops what was queued after it, and is raised by the
caller's next ``submit``/``drain`` naming the leaf. jax is never imported here
(see :mod:`grain_replay.writers.device_leaves`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.errors import BackgroundWriteError, InvalidArgumentError
from grain_replay.writers.device_leaves import (
    TreeSignature,
    device_leaf_test,
    leaf_name,
    leaf_nbytes,
    start_copies,
)

__all__ = [
    "COALESCE_BYTES",
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "WRITE_BATCH_BYTES",
    "BackgroundWriter",
    "LeafWriteError",
    "check_max_inflight_bytes",
    "device_leaf_test",
    "to_host",
]

logger = logging.getLogger(__name__)

# Bytes of appended rows waiting for their copy or write before append waits: a few
# hundred steps of 1,024 envs' transitions, small next to a host's memory.
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
# Queued bytes that wake the thread (at most a quarter of the bound): it writes many
# small appends at once, so its per-write costs (a wake-up, a write and a checksum
# per leaf, the store's bookkeeping) are paid once per batch, not once per append.
WRITE_BATCH_BYTES = 2 << 20
# Queued trees written as one block: up to this many bytes.
COALESCE_BYTES = 8 << 20


class LeafWriteError(Exception):
    """Raised by a write path to say which leaf failed (the cause is chained)."""

    def __init__(self, leaf: str):
        super().__init__(leaf)
        self.leaf = leaf


def check_max_inflight_bytes(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise InvalidArgumentError(
            f"{where}: max_inflight_bytes must be a positive int (bytes), got {value!r}. "
            f"Fix: leave the default ({DEFAULT_MAX_INFLIGHT_BYTES >> 20} MiB) or pass e.g. "
            "64 << 20."
        )
    return int(value)


def to_host(leaf: Any) -> np.ndarray:
    """A queued leaf on the host: waits for the copy that ``copy_to_host_async`` started."""
    return np.asarray(leaf)


Write = Callable[[dict[str, np.ndarray], int], None]


@dataclasses.dataclass(slots=True)
class _Item:
    arrays: dict[str, Any]  # device arrays (copy under way) and host copies
    rows: int
    first: int  # the writer's row number of the first row, for messages
    nbytes: int
    write: Write


class BackgroundWriter:
    """One thread that converts queued trees to host arrays and writes them, in order."""

    def __init__(self, where: str, max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES):
        self._where = where
        self._max_bytes = max_inflight_bytes
        self._wake_bytes = max(1, min(WRITE_BATCH_BYTES, max_inflight_bytes // 4))
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[_Item | None] = collections.deque()
        self._bytes = 0  # queued or being written
        self._unclaimed = 0  # queued, not yet taken by the thread
        self._rows = 0
        self._items = 0
        self._urgent = 0  # callers waiting for the thread (drain, the bound)
        self._error: BackgroundWriteError | None = None
        self._raised = False
        self._thread: threading.Thread | None = None
        # The last tree queued, when a flat dict of device arrays: the next one like it
        # is checked from its leaves' attributes (submit_like_last).
        self._signature: TreeSignature | None = None
        self._last_write: Write | None = None

    # -- the caller's side -------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether anything is queued or being written (or a failure is not yet raised)."""
        return self._items > 0 or (self._error is not None and not self._raised)

    @property
    def rows(self) -> int:
        """Rows queued or being written."""
        return self._rows

    @property
    def failed(self) -> bool:
        return self._error is not None

    def submit(
        self,
        arrays: dict[str, Any],
        rows: int,
        first: int,
        write: Write,
        is_device: Callable[[Any], bool],
        tree: Any = None,
    ) -> None:
        """Queues a checked tree (``arrays``: its leaves) after the ones before it; waits
        while the bytes queued exceed the bound (one tree larger than the bound is queued
        alone). ``tree``, when given, may be remembered for :meth:`submit_like_last`."""
        nbytes = sum(leaf_nbytes(a) for a in arrays.values())
        self._signature = None
        self._wait_for_room(nbytes)
        start_copies(arrays, is_device, self._where)
        if tree is not None:
            self._signature = TreeSignature.of(tree, arrays, is_device, self._where)
            self._last_write = write
        self._enqueue(_Item(arrays, rows, first, nbytes, write))

    def submit_like_last(self, tree: Any, first: int) -> bool:
        """Queues ``tree`` if it is a flat dict of device arrays like the last tree
        submitted (same keys, array types, dtypes, per-row shapes and shardings): that
        tree passed the store's checks, so this one does too. False (nothing queued)
        for any other tree: the caller checks it in full and calls :meth:`submit`."""
        signature, write = self._signature, self._last_write
        if signature is None or write is None:
            return False
        checked = signature.check(tree)
        if checked is None:
            return False
        rows, nbytes = checked
        self._wait_for_room(nbytes)
        signature.start_copies(tree)
        self._enqueue(_Item(dict(tree), rows, first, nbytes, write))
        return True

    def _wait_for_room(self, nbytes: int) -> None:
        with self._cond:
            if self._error is None and self._items and self._bytes + nbytes > self._max_bytes:
                self._urgent += 1
                self._cond.notify_all()
                try:
                    while (
                        self._error is None
                        and self._items
                        and self._bytes + nbytes > self._max_bytes
                    ):
                        self._cond.wait()
                finally:
                    self._urgent -= 1
            self._raise_locked()

    def _enqueue(self, item: _Item) -> None:
        with self._cond:
            self._raise_locked()
            self._queue.append(item)
            self._bytes += item.nbytes
            self._unclaimed += item.nbytes
            self._rows += item.rows
            self._items += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="grain_replay-device-writes", daemon=True
                )
                self._thread.start()
            if self._unclaimed >= self._wake_bytes:
                self._cond.notify_all()

    def drain(self) -> None:
        """Waits until every queued tree is written; raises a failure of the thread."""
        with self._cond:
            if self._error is None and self._items:
                self._urgent += 1
                self._cond.notify_all()
                try:
                    while self._error is None and self._items:
                        self._cond.wait()
                finally:
                    self._urgent -= 1
            self._raise_locked()

    def raise_pending(self) -> None:
        """Raises a failure not yet raised (once)."""
        with self._cond:
            self._raise_locked()

    def _raise_locked(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def stop(self) -> None:
        """Ends the thread once the queue is written (after ``drain`` or a failure)."""
        self._signature = None  # a closed writer takes no tree past its checks
        with self._cond:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._queue.append(None)
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join()

    # -- the thread ----------------------------------------------------------------------

    def _ready_locked(self) -> bool:
        """Whether to write now: a batch is queued, someone waits, or the thread stops."""
        queue = self._queue
        return bool(queue) and (
            self._urgent > 0 or self._unclaimed >= self._wake_bytes or queue[-1] is None
        )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ready_locked():
                    self._cond.wait()
                batch = self._take_locked()
            if not batch:
                return
            error = self._write(batch)
            with self._cond:
                for item in batch:
                    self._bytes -= item.nbytes
                    self._rows -= item.rows
                    self._items -= 1
                if error is not None:
                    self._fail_locked(error)
                self._cond.notify_all()
            # Dropped outside the lock: the last reference to the writer may go with it.
            del batch
            if error is not None:
                return

    def _take_locked(self) -> list[_Item]:
        """The queued trees, oldest first, up to ``COALESCE_BYTES`` (at least one):
        written as one block (one write per leaf, not per tree)."""
        batch: list[_Item] = []
        size = 0
        while self._queue:
            item = self._queue[0]
            if item is None:
                if not batch:
                    self._queue.popleft()
                break
            if batch and (item.write != batch[0].write or size + item.nbytes > COALESCE_BYTES):
                break
            self._queue.popleft()
            batch.append(item)
            size += item.nbytes
        self._unclaimed -= size
        return batch

    def _write(self, batch: list[_Item]) -> BackgroundWriteError | None:
        key, copying = "", True
        rows = sum(item.rows for item in batch)
        try:
            host: dict[str, np.ndarray] = {}
            for key in batch[0].arrays:
                if len(batch) == 1:
                    host[key] = to_host(batch[0].arrays[key])
                else:
                    host[key] = np.concatenate([to_host(item.arrays[key]) for item in batch])
            copying, key = False, ""
            batch[0].write(host, rows)
            return None
        except Exception as e:
            cause: BaseException = e
            if isinstance(e, LeafWriteError):
                failed: str | None = e.leaf
                cause = e.__cause__ or e
                what = f"writing it failed for leaf {leaf_name(e.leaf)!r} of"
            elif copying:
                failed = key
                what = f"copying it to host failed for leaf {leaf_name(key)!r} of"
            else:  # the store's own step (a new segment, syncing filled ones): every leaf
                failed = None
                what = "writing them failed for"
            first = batch[0].first
            error = BackgroundWriteError(
                f"{self._where}: {what} rows [{first}, {first + rows}) appended earlier: "
                f"{type(cause).__name__}: {cause}. The rows committed before (by the last "
                "flush) are intact; the rows appended since are dropped, as in a crash. Fix: "
                "remove the cause (disk space, permissions; arrays must not be donated or "
                "deleted before flush()), then reopen the store with gr.ReplayWriter to "
                "append after its committed rows.",
                leaf="" if failed is None else leaf_name(failed),
            )
            error.__cause__ = cause
            return error

    def _fail_locked(self, error: BackgroundWriteError) -> None:
        self._error = error
        dropped = [i for i in self._queue if i is not None]
        self._queue.clear()
        self._unclaimed = 0
        for i in dropped:
            self._bytes -= i.nbytes
            self._rows -= i.rows
            self._items -= 1
        logger.error("%s", error)
        self._thread = None
