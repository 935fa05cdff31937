"""Writes from the device: appends of jax.Array leaves copied to host and written by one thread.

``ReplayWriter.append`` checks a tree's device leaves and queues the tree; one
background thread sleeps until ``WRITE_BATCH_BYTES`` of trees are queued (or a
caller waits, or the writer stops; the queue and its counts: :mod:`queue`), then
takes them in append order, copies them to host (:mod:`host_copies`: a CPU
device's arrays read in place; an accelerator's like trees stacked on the device
and copied as one buffer a group, :mod:`device_pack`) and writes
them as one block, one write per leaf, joined in buffers it keeps
(no new memory per batch). One wake-up per batch, not per append: on a CPU
backend, where the thread's CPU time is taken from the caller's steps, that is
what the per-append cost comes down to. ``drain()`` (called by
``flush``/``close``) waits for the queue; the bytes queued are bounded, and
``submit`` waits beyond the bound. ``submit_commit`` queues a commit
(``flush(wait=False)``) behind the trees appended before it: the thread writes
them, then runs the commit, fsync waits included, while the caller goes on
appending. A many-writer store's sync after writes runs on a second thread
(:mod:`sync_thread`). A failure in either thread stops both, drops what was queued
after it, and is raised by the caller's next ``submit``/``drain`` naming the leaf.
jax is never imported here (see :mod:`grain_replay.writers.device.leaves`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.errors import BackgroundWriteError, InvalidArgumentError
from grain_replay.pipeline import shutdown
from grain_replay.writers.device import pack as device_pack
from grain_replay.writers.device.host_copies import batch_error, batch_to_host
from grain_replay.writers.device.leaves import device_leaf_test, leaf_nbytes, start_copies
from grain_replay.writers.device.like_trees import LastTree
from grain_replay.writers.device.queue import Commit, Item, JoinBuffers, Write, WriteQueue
from grain_replay.writers.device.sync_thread import SyncThread
from grain_replay.writers.write_errors import LeafWriteError, commit_error, thread_error

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "WRITE_BATCH_BYTES",
    "BackgroundWriter",
    "LeafWriteError",
    "check_max_inflight_bytes",
    "commit_error",
    "device_leaf_test",
]

logger = logging.getLogger(__name__)

# Bytes of appended rows waiting for their copy or write before append waits: a few
# hundred steps of 1,024 envs' transitions, small next to a host's memory.
DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
# Bytes of trees on the host that the thread writes as one block (at most a quarter
# of the bound): its per-write costs (a write and a checksum per leaf, the store's
# bookkeeping) are paid once per batch, not once per append.
WRITE_BATCH_BYTES = 4 << 20
# Trees in a batch at the most: an accelerator's batch is then one group of like trees
# stacked on the device (pack.MAX_GROUP), one transfer a leaf and one block to write.
WRITE_BATCH_TREES = device_pack.MAX_GROUP


def check_max_inflight_bytes(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise InvalidArgumentError(
            f"{where}: max_inflight_bytes must be a positive int (bytes), got {value!r}. Fix: "
            f"leave the default ({DEFAULT_MAX_INFLIGHT_BYTES >> 20} MiB) or pass e.g. 64 << 20."
        )
    return int(value)


class BackgroundWriter:
    """One thread that converts queued trees to host arrays and writes them, in order."""

    def __init__(
        self,
        where: str,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        sync: Callable[[Callable[[], bool]], None] | None = None,
    ):
        """``sync``: the store's step after writes (committing the segments they filled),
        run by a second thread while the next trees are copied and written, so its
        ``fsync`` waits hold up neither the caller nor the writes. It is passed a
        callable saying whether a caller waits (then it may leave the rest to the flush)."""
        self._where = where
        self._max_bytes = max_inflight_bytes
        lock = self._lock = threading.Lock()
        self._work = threading.Condition(lock)  # the thread waits here for trees
        self._done = threading.Condition(lock)  # callers wait here for the thread
        # The trees and commits queued, and their counts (queue.py).
        batch_bytes = max(1, min(WRITE_BATCH_BYTES, max_inflight_bytes // 4))
        self._queue = WriteQueue(batch_bytes, WRITE_BATCH_TREES)
        self._committing = False  # the thread runs a commit (the sync thread holds off)
        self._urgent = 0  # callers waiting for the thread (drain, the bound)
        self._idle = False  # the thread waits for work
        self._error: BackgroundWriteError | None = None
        self._raised = False
        self._thread: threading.Thread | None = None
        # The store's sync after writes, on a thread of its own (sync_thread.py).
        self._syncs: SyncThread | None = None
        if sync is not None:
            self._syncs = SyncThread(
                sync,
                where,
                self._work,
                self._done,
                held=lambda: self._committing,
                failed=lambda: self._error is not None,
                fail_locked=self._fail_locked,
                caller_waits=self._caller_waits,
            )
        self._stopped = False
        # The last tree queued, when a tree of device arrays: the next one like it
        # is checked from its leaves' attributes (submit_like_last).
        self._last = LastTree()
        # The thread's buffers joining a batch's rows, per leaf (reused batch after batch).
        self._joins = JoinBuffers()

    # -- the caller's side -------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether anything is queued or being written (or a failure is not yet raised)."""
        return self._pending_locked() or (self._error is not None and not self._raised)

    def _pending_locked(self) -> bool:
        """Trees queued or being written, or a sync asked for or running."""
        return self._queue.items > 0 or (self._syncs is not None and self._syncs.pending_locked())

    @property
    def rows(self) -> int:
        """Rows queued or being written."""
        return self._queue.rows

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
        self._last.forget()
        self._wait_for_room(nbytes)
        start_copies(arrays, is_device, self._where)
        pack = self._last.remember(tree, arrays, rows, write, is_device, self._where)
        self._enqueue(Item(arrays, rows, first, nbytes, write, pack))

    def submit_like_last(self, tree: Any, first: int) -> int:
        """Queues ``tree`` if it is a tree of device arrays like the last tree submitted
        (same containers, array types, dtypes, per-row shapes and shardings): that tree
        passed the store's checks, so this one does too; returns its rows. 0 (nothing
        queued) for any other tree, which the caller checks in full and passes to
        :meth:`submit`, and after a failure, which the caller raises (:attr:`failed`)."""
        if self._error is not None:
            return 0  # a failure: the caller raises it
        item = self._last.take(tree, first)
        if item is None:
            return 0
        queue = self._queue
        if queue.items and queue.bytes + item.nbytes > self._max_bytes:
            self._wait_for_room(item.nbytes)
        self._enqueue(item)
        return item.rows

    def submit_commit(
        self, commit: Callable[[], object], upto: int, committed: Callable[[], int]
    ) -> None:
        """Queues ``commit`` (the store's flush) behind every tree queued so far: the
        thread writes them, then commits, without a caller waiting. ``upto``: the
        writer's rows once it completes; ``committed``: the rows committed before it
        (both for the error's message). A later ``drain`` waits for it too."""
        self._enqueue(Commit(commit, upto, committed))

    def _wait_for_room(self, nbytes: int) -> None:
        # Unlocked first: only this side adds bytes (the thread only takes them away), so
        # a tree that fits now still fits; a failure set meanwhile is raised at _enqueue.
        queue = self._queue
        if self._error is None and (not queue.items or queue.bytes + nbytes <= self._max_bytes):
            return
        with self._done:
            if self._error is None and queue.items and queue.bytes + nbytes > self._max_bytes:
                self._urgent += 1
                self._work.notify_all()
                try:
                    while (
                        self._error is None
                        and queue.items
                        and queue.bytes + nbytes > self._max_bytes
                    ):
                        self._done.wait()
                finally:
                    self._urgent -= 1
            self._raise_locked()

    def _enqueue(self, item: Item | Commit) -> None:
        with self._lock:  # the conditions' lock, taken without their Python wrappers
            if self._error is not None:
                self._raise_locked()
            if self._thread is None:
                # Started before the item is queued: a thread that cannot start (RuntimeError)
                # is raised by this call, with nothing queued that a drain would wait for.
                thread = threading.Thread(
                    target=self._run, name="grain_replay-device-writes", daemon=True
                )
                shutdown.register(self, BackgroundWriter.close_at_exit)
                try:
                    thread.start()
                except BaseException:
                    shutdown.unregister(self)
                    raise
                self._thread = thread
                self._queue.add(item)
                return
            # A batch (or a commit) queued wakes the thread; below a batch, it sleeps on.
            if self._queue.add(item) and self._idle:
                self._work.notify_all()

    def drain(self) -> None:
        """Waits until every queued tree is written; raises a failure of the thread."""
        with self._done:
            if self._error is None and self._pending_locked():
                self._urgent += 1
                self._work.notify_all()
                try:
                    while self._error is None and self._pending_locked():
                        self._done.wait()
                finally:
                    self._urgent -= 1
            self._raise_locked()

    def close_at_exit(self) -> None:
        """At exit, before jax's teardown (pipeline/shutdown.py): writes the queue, no commit."""
        with contextlib.suppress(BackgroundWriteError):  # logged by the failed thread
            self.drain()
        self.stop()

    def request_sync(self) -> None:
        """Has the sync thread run ``sync`` once more, soon (e.g. after a flush, for what
        it left to the thread); nothing after the stop or a failure."""
        with self._work:
            if self._syncs is None or self._stopped or self._error is not None:
                return
            self._syncs.start_locked()

    def raise_pending(self) -> None:
        """Raises a failure not yet raised (once)."""
        with self._done:
            self._raise_locked()

    def _raise_locked(self) -> None:
        if self._error is not None and not self._raised:
            self._raised = True
            raise self._error

    def stop(self) -> None:
        """Ends the thread once the queue is written (after ``drain`` or a failure)."""
        self._last.forget()  # a closed writer takes no tree past its checks
        shutdown.unregister(self)
        with self._work:
            self._stopped = True
            thread, self._thread = self._thread, None
            syncer = None if self._syncs is None else self._syncs.detach_locked()
            if thread is not None:
                self._queue.add_stop()
            self._work.notify_all()  # the sync thread waits on it too
        for t in (thread, syncer):
            if t is not None and t is not threading.current_thread():
                t.join()

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        """Sleeps until a batch is queued (``batch_bytes`` of trees), a commit is, a caller
        waits or the writer stops; then takes up to a batch of trees in order, waits for
        their host copies and writes them as one block, then runs the commit queued right
        behind them if one is, until the queue is below a batch again. Anything raised
        outside those steps (a bug, a sync thread that could not start, no memory) fails
        the writer: callers waiting for the thread raise it instead of waiting forever."""
        try:
            self._loop()
        except BaseException as e:
            with self._done:
                self._fail_locked(thread_error(self._where, "write", e))
                self._done.notify_all()
            if not isinstance(e, Exception):
                raise
        finally:
            self._joins.clear()

    def _loop(self) -> None:
        while True:
            with self._work:
                while self._error is None and not self._queue.ready(self._urgent > 0):
                    self._idle = True
                    self._work.wait()
                self._idle = False
                if self._error is not None:  # the sync thread failed
                    return
                batch, commit, stop = self._queue.take()
            parts, error = batch_to_host(batch, self._where) if batch else ([], None)
            if error is None and batch:
                error = self._write(batch, parts)
            del parts
            if batch or error is not None:
                # The commit behind the batch syncs its segments: no sync of them before.
                self._done_with(batch, error, sync=commit is None)
            # Dropped outside the lock: the last reference to the writer may go with it.
            del batch
            if error is None and commit is not None:
                error = self._run_commit(commit)
            del commit
            if error is not None or stop:
                return

    def _run_commit(self, commit: Commit) -> BackgroundWriteError | None:
        """Runs a queued commit once the sync thread is idle (it touches the segments the
        commit closes; it leaves its other segments to the commit, as to a flush)."""
        error = None
        with self._done:
            self._committing = True
            while self._syncs is not None and self._syncs.running and self._error is None:
                self._done.wait()
            proceed = self._error is None
        try:
            if proceed:
                commit.commit()
        except Exception as e:
            error = commit_error(self._where, commit.committed(), commit.upto, e)
        with self._done:
            self._committing = False
            self._queue.commit_done()
            if error is not None:
                self._fail_locked(error)
            elif self._syncs is not None and not self._stopped and self._error is None:
                self._syncs.start_locked()  # removes the segments the commit evicted
            else:
                self._work.notify_all()  # a sync held off by the commit may go on
            self._done.notify_all()
        return error

    def _done_with(
        self, batch: list[Item], error: BackgroundWriteError | None, *, sync: bool = True
    ) -> None:
        """Counts a written (or, with ``error``, dropped) batch out; starts a sync
        (``sync``: unless a commit follows, which syncs what the batch filled)."""
        with self._done:
            self._queue.count_out(batch)
            if error is not None:
                self._fail_locked(error)
            elif sync and batch and self._syncs is not None and not self._stopped:
                self._syncs.start_locked()
            self._done.notify_all()

    def _caller_waits(self) -> bool:
        """Whether a caller waits for the threads (flush, close, the bound) or a queued
        commit does: the sync leaves what is left to the flush or the commit then (see
        PartWriter.commit_filled)."""
        return self._urgent > 0 or self._committing or self._queue.commits > 0

    def _write(
        self, batch: list[Item], parts: list[tuple[dict[str, np.ndarray], int]]
    ) -> BackgroundWriteError | None:
        """Writes the batch's host blocks as one block: one write per leaf."""
        try:
            host, rows = self._joins.host_block(parts)
            batch[0].write(host, rows)
        except Exception as e:
            return batch_error(self._where, batch, e)
        return None

    def _fail_locked(self, error: BackgroundWriteError) -> None:
        if self._error is not None:  # the other thread failed first: that one is raised
            return
        self._error = error
        self._queue.drop()
        logger.error("%s", error)
        self._thread = None
        if self._syncs is not None:
            self._syncs.detach_locked()
        self._work.notify_all()  # the other thread stops too
