"""Writes from the device: appends of jax.Array leaves copied to host and written by one thread.

``ReplayWriter.append`` starts each device leaf's copy (``copy_to_host_async``)
and queues the tree; one background thread takes the trees in append order,
waits for their host copies (``np.asarray``) and writes them through the
writer's own write path. ``drain()`` (called by ``flush``/``close``) waits
for the queue; the bytes queued are bounded, and ``submit`` waits beyond the
bound. A failure in the thread stops it, drops what was queued after it, and
is raised by the caller's next ``submit``/``drain`` naming the leaf. jax is
never imported here: a leaf is a device array when ``jax`` is already loaded
and the leaf is a ``jax.Array``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.errors import BackgroundWriteError, InvalidArgumentError, InvalidTreeError

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
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
# Queued trees written as one block when the thread is behind: up to this many bytes.
COALESCE_BYTES = 8 << 20


class LeafWriteError(Exception):
    """Raised by a write path to say which leaf failed (the cause is chained)."""

    def __init__(self, leaf: str):
        super().__init__(leaf)
        self.leaf = leaf


def device_leaf_test() -> Callable[[Any], bool] | None:
    """``isinstance(leaf, jax.Array)`` when jax is loaded, else None (no leaf can be one)."""
    jax = sys.modules.get("jax")
    array_type = getattr(jax, "Array", None)
    if array_type is None:
        return None
    return lambda leaf: isinstance(leaf, array_type)


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


def _leaf_nbytes(leaf: Any) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _name(key: str) -> str:
    return key or "<root>"


@dataclasses.dataclass
class _Item:
    arrays: dict[str, Any]  # device arrays (copy under way) and host copies
    rows: int
    first: int  # the writer's row number of the first row, for messages
    nbytes: int
    write: Callable[[dict[str, np.ndarray], int], None]


_ON_HOST: dict[Any, bool] = {}  # sharding -> whether all its devices are CPUs


def _on_host(leaf: Any) -> bool:
    sharding: Any = getattr(leaf, "sharding", None)
    try:
        return _ON_HOST[sharding]
    except (KeyError, TypeError):
        pass
    try:
        on_host = all(d.platform == "cpu" for d in sharding.device_set)
    except Exception:  # an unusual array: copy it the documented way
        return False
    if len(_ON_HOST) > 256:
        _ON_HOST.clear()
    with contextlib.suppress(TypeError):
        _ON_HOST[sharding] = on_host
    return on_host


def start_copies(arrays: dict[str, Any], is_device: Callable[[Any], bool], where: str) -> None:
    """Starts every device leaf's copy to host (none for a CPU device's array, which is
    host memory already); host leaves are copied now (the caller may reuse its buffers
    once ``append`` returns)."""
    for key, leaf in arrays.items():
        if not is_device(leaf):
            arrays[key] = np.array(leaf, copy=True)
            continue
        if not getattr(leaf, "is_fully_addressable", True):
            raise InvalidTreeError(
                f"{where}: leaf {_name(key)!r} is a jax.Array with shards on other processes' "
                "devices (not fully addressable), so this process cannot copy it to host. "
                "Fix: append each process's own rows with its own writer_id= (e.g. "
                "leaf.addressable_shards), or gather it first with "
                "jax.experimental.multihost_utils.process_allgather."
            )
        try:
            if leaf.is_deleted():
                raise RuntimeError("Array has been deleted.")
            if _on_host(leaf):
                continue  # a CPU device's array is host memory: np.asarray in the thread reads it
            leaf.copy_to_host_async()
        except Exception as e:  # a deleted (donated) array, a broken device
            raise InvalidTreeError(
                f"{where}: leaf {_name(key)!r} cannot be copied to host ({type(e).__name__}: "
                f"{e}). Fix: append arrays that are still alive (not donated or deleted)."
            ) from e


class BackgroundWriter:
    """One thread that converts queued trees to host arrays and writes them, in order."""

    def __init__(self, where: str, max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES):
        self._where = where
        self._max_bytes = max_inflight_bytes
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[_Item | None] = collections.deque()
        self._bytes = 0  # queued or being written
        self._rows = 0
        self._items = 0
        self._error: BackgroundWriteError | None = None
        self._raised = False
        self._thread: threading.Thread | None = None

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
        write: Callable[[dict[str, np.ndarray], int], None],
        is_device: Callable[[Any], bool],
    ) -> None:
        """Queues a tree after the ones before it; waits while the bytes queued exceed the
        bound (one tree larger than the bound is queued alone)."""
        nbytes = sum(_leaf_nbytes(a) for a in arrays.values())
        with self._cond:
            while self._error is None and self._items and self._bytes + nbytes > self._max_bytes:
                self._cond.wait()
            self._raise_locked()
        start_copies(arrays, is_device, self._where)
        item = _Item(arrays, rows, first, nbytes, write)
        with self._cond:
            self._raise_locked()
            self._queue.append(item)
            self._bytes += nbytes
            self._rows += rows
            self._items += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="grain_replay-device-writes", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def drain(self) -> None:
        """Waits until every queued tree is written; raises a failure of the thread."""
        with self._cond:
            while self._error is None and self._items:
                self._cond.wait()
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
        """Ends the thread once the queue is empty (after ``drain`` or a failure)."""
        with self._cond:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._queue.append(None)
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join()

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
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
        """The next queued tree, with the ones behind it while they are small: a thread
        that fell behind writes them as one block (one write per leaf, not per tree)."""
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
        return batch

    def _write(self, batch: list[_Item]) -> BackgroundWriteError | None:
        key, copying = "", True
        rows = sum(item.rows for item in batch)
        try:
            host: dict[str, np.ndarray] = {}
            for key in batch[0].arrays:
                parts = [to_host(item.arrays[key]) for item in batch]
                host[key] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            copying = False
            batch[0].write(host, rows)
            return None
        except Exception as e:
            failed = e.leaf if isinstance(e, LeafWriteError) else key
            cause = e.__cause__ if isinstance(e, LeafWriteError) and e.__cause__ else e
            what = "copying it to host" if copying else "writing it"
            first = batch[0].first
            error = BackgroundWriteError(
                f"{self._where}: {what} failed for leaf {_name(failed)!r} of rows "
                f"[{first}, {first + rows}) appended earlier: "
                f"{type(cause).__name__}: {cause}. The rows committed before (by the last "
                "flush) are intact; the rows appended since are dropped, as in a crash. Fix: "
                "remove the cause (disk space, permissions; arrays must not be donated or "
                "deleted before flush()), then reopen the store with gr.ReplayWriter to "
                "append after its committed rows.",
                leaf=_name(failed),
            )
            error.__cause__ = cause
            return error

    def _fail_locked(self, error: BackgroundWriteError) -> None:
        self._error = error
        dropped = [i for i in self._queue if i is not None]
        self._queue.clear()
        for i in dropped:
            self._bytes -= i.nbytes
            self._rows -= i.rows
            self._items -= 1
        logger.error("%s", error)
        self._thread = None
