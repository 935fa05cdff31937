"""What the background writer queues, and how its thread takes and joins a batch of it.

The queue holds appended trees (:class:`Item`) and commits queued behind them
(:class:`Commit`, ``flush(wait=False)``), in append order, and ``None`` for the
stop. The thread takes up to a batch of trees of one store, or the commit right
behind them (:func:`take_batch`), and writes a batch's trees as one block, each
leaf's rows joined in a buffer kept for the next batch (:class:`JoinBuffers`).
:class:`WriteQueue` holds them and their counts (bytes, rows, trees and commits
queued or under way); the threads and the lock around it are
:class:`grain_replay.writers.device.background.BackgroundWriter`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Commit", "Item", "JoinBuffers", "Write", "WriteQueue", "take_batch"]

Write = Callable[[dict[str, np.ndarray], int], None]


@dataclasses.dataclass(slots=True)
class Item:
    """An appended tree, queued."""

    arrays: dict[str, Any]  # device arrays (copy under way) and host copies
    rows: int
    first: int  # the writer's row number of the first row, for messages
    nbytes: int
    write: Write
    # Accelerator trees: what like trees share (consecutive items with an equal key are
    # stacked on the device, device_pack) and the names of the leaves to stack.
    pack: tuple[Any, tuple[str, ...]] | None = None


@dataclasses.dataclass(slots=True)
class Commit:
    """A commit queued behind the trees appended before it (``flush(wait=False)``)."""

    commit: Callable[[], object]  # the store's flush: commits every row written so far
    upto: int  # the writer's rows once it completes
    committed: Callable[[], int]  # the rows committed before it, for messages
    rows: int = 0
    nbytes: int = 0


_NBYTES = operator.attrgetter("nbytes")
_ROWS = operator.attrgetter("rows")


def take_batch(
    queue: collections.deque[Item | Commit | None], batch_bytes: int, batch_trees: int
) -> tuple[list[Item], Commit | None, bool, int]:
    """Takes up to ``batch_bytes`` (and ``batch_trees``) of queued trees of one store, in
    order, then the commit queued right behind them if one is (at least one of the two),
    off ``queue``.

    Returns the trees, the commit or None, whether the stop is next
    (``([], None, True, 0)`` once it is the queue's head), and the trees' bytes.
    """
    batch: list[Item] = []
    commit = None
    size = 0
    write = None
    pop, add = queue.popleft, batch.append
    while queue and size < batch_bytes and len(batch) < batch_trees:
        head = queue[0]
        if type(head) is not Item:
            if head is None:
                if not batch:
                    pop()
                    return batch, None, True, 0
                break
            pop()
            assert isinstance(head, Commit)
            commit = head
            break
        if write is None:
            write = head.write
        elif head.write != write:  # another store's: a batch of its own
            break
        pop()
        add(head)
        size += head.nbytes
    return batch, commit, False, size


class WriteQueue:
    """The queued trees and commits, in order (``None``: the stop), and their counts.

    Not locked: its owner holds its lock around every call. ``bytes``, ``rows`` and
    ``items`` may be read without it (only the caller's side adds to them).
    """

    def __init__(self, batch_bytes: int, batch_trees: int) -> None:
        self.batch_bytes = batch_bytes  # a batch of trees for the thread: its bytes,
        self.batch_trees = batch_trees  # or its trees
        self._queue: collections.deque[Item | Commit | None] = collections.deque()
        self.bytes = 0  # queued, on host or being written
        self.rows = 0  # rows queued or being written
        self.items = 0  # trees and commits queued or under way
        self.commits = 0  # commits queued, not yet taken by the thread
        self._queued_bytes = 0  # queued, not yet taken by the thread
        self._queued_trees = 0  # trees queued, not yet taken by the thread

    def add(self, item: Item | Commit) -> bool:
        """Queues a tree or a commit behind the ones before it; says whether the thread
        has work now (a batch of trees, or a commit, queued)."""
        self._queue.append(item)
        nbytes = item.nbytes
        self.bytes += nbytes
        self.rows += item.rows
        self.items += 1
        if type(item) is Item:
            self._queued_bytes += nbytes
            self._queued_trees += 1
            return self._queued_bytes >= self.batch_bytes or self._queued_trees >= self.batch_trees
        self.commits += 1
        return True

    def add_stop(self) -> None:
        """Queues the stop: the thread ends once it reaches it."""
        self._queue.append(None)

    def batch_queued(self) -> bool:
        """Whether a batch of trees is queued (its bytes, or its trees)."""
        return self._queued_bytes >= self.batch_bytes or self._queued_trees >= self.batch_trees

    def ready(self, urgent: bool) -> bool:
        """Whether the thread has trees to take now: a batch of them, a caller waiting
        for them (``urgent``), a commit, or the stop behind them."""
        q = self._queue
        return bool(q) and (self.batch_queued() or urgent or self.commits > 0 or q[-1] is None)

    def take(self) -> tuple[list[Item], Commit | None, bool]:
        """Up to a batch of queued trees, then the commit right behind them (see
        :func:`take_batch`), counted out of the queue's bytes and commits."""
        batch, commit, stop, size = take_batch(self._queue, self.batch_bytes, self.batch_trees)
        self._queued_bytes -= size
        self._queued_trees -= len(batch)
        self.commits -= commit is not None
        return batch, commit, stop

    def count_out(self, batch: list[Item]) -> None:
        """Counts a batch taken out of the queue (written, or dropped) out of the counts."""
        self.bytes -= sum(map(_NBYTES, batch))
        self.rows -= sum(map(_ROWS, batch))
        self.items -= len(batch)

    def commit_done(self) -> None:
        """Counts a commit taken out of the queue (run, or failed) out."""
        self.items -= 1

    def drop(self) -> None:
        """Drops what is queued, the stop included (after a failure)."""
        dropped = [i for i in self._queue if i is not None]
        self._queue.clear()
        for i in dropped:
            self.bytes -= i.nbytes
            self.rows -= i.rows
            self.items -= 1
        self.commits = 0


class JoinBuffers:
    """The thread's buffers joining a batch's rows, one per leaf, reused batch after batch
    (the writes copy what they are given): no fresh pages to fault in per batch."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def host_block(
        self, parts: list[tuple[dict[str, np.ndarray], int]]
    ) -> tuple[dict[str, np.ndarray], int]:
        """A batch's host blocks (``(arrays, rows)``: a tree, or a group of trees stacked
        on the device) as one block (a lone part as it is) and its rows."""
        rows = sum(r for _, r in parts)
        if len(parts) == 1:
            return parts[0][0], rows
        keys = parts[0][0]
        return {k: self._join(k, [p[k] for p, _ in parts], rows) for k in keys}, rows

    def _join(self, key: str, parts: list[np.ndarray], rows: int) -> np.ndarray:
        first = parts[0]
        buf = self._buffers.get(key)
        if (
            buf is None
            or buf.dtype != first.dtype
            or buf.shape[1:] != first.shape[1:]
            or (len(buf) < rows)
        ):
            buf = self._buffers[key] = np.empty((rows, *first.shape[1:]), first.dtype)
        out = buf[:rows]
        np.concatenate(parts, out=out)
        return out

    def clear(self) -> None:
        self._buffers = {}
