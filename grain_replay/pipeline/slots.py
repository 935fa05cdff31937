"""The consumer's side of one worker's shared-memory slots: batches handed out as views.

A batch a worker wrote into a slot is handed out as numpy arrays that view the
slot itself, not copies: copying a 25 MB batch of camera frames out of the slot
into fresh arrays took ~260 ms of page faults and ``memcpy`` on a loaded 2-core
machine, five times the read. The slot then belongs to the batch: every array
of it (and every view of one, or a ``jax.Array`` aliasing one) keeps one
per-batch base array of the slot alive, and only when the last of them is
garbage-collected does the slot go back into use. Meanwhile the worker has
been given another slot, so its read-ahead stays ``buffer_size`` batches
whatever the user holds; a slot the user released is the next one given.

Past :data:`MAX_HELD` slots held at once (a user keeping every batch), batches
are copied out of their slot instead, which goes straight back: the shared
files stay bounded. Slots released beyond ``idle_limit`` are dropped (the
worker unmaps its side, this side unmaps its own), so memory follows the most
the user held lately, not the most ever.

The arrays are writable (the map is shared and read-write): the worker never
reads a slot, and writes one only after the user let go of it.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_replay.pipeline.lanes import LaneBuffer, LaneField, record

__all__ = ["MAX_HELD", "Field", "Slots"]

MAX_HELD = 32  # slots of one worker held by the user at once before batches are copied

# (leaf key, dtype, shape, element count, byte offset in the slot, bytes from one batch row
# to the next: 0 when the leaf is C-contiguous, else its rows are padded: pipeline/lanes.py)
Field = tuple[str, np.dtype[Any], tuple[int, ...], int, int, int]


class _Lease(LaneBuffer):
    """The whole slot, as the base of one batch's leaves: collected with the last of them.

    numpy collapses a view's base to the first array of another type, so each
    leaf (a plain ``ndarray``) and every view of one keeps this object alive,
    which keeps the slot's map alive (numpy holds a buffer of it, so it cannot
    be unmapped under them either).
    """


def _on_release(
    released: collections.deque[int], slot: int
) -> Callable[[weakref.ref[_Lease]], None]:
    """The callback of a batch's lease: queues its slot (in whichever thread dropped it)."""

    def release(_: weakref.ref[_Lease]) -> None:
        released.append(slot)

    return release


def _view(buf: np.ndarray, field: Field) -> np.ndarray:
    """The leaf of ``field`` over the slot's bytes ``buf``."""
    _, dtype, shape, count, offset, stride = field
    if not count:
        return np.empty(shape, dtype)
    if stride:  # rows padded to whole lanes: axis 0 steps over the padding
        n = shape[0]
        element = count // n * dtype.itemsize
        rows = buf[offset : offset + n * stride].reshape(n, stride)[:, :element]
        return rows.view(dtype).reshape(shape)
    return buf[offset : offset + count * dtype.itemsize].view(dtype).reshape(shape)


class Slots:
    """The maps of one worker's slots and who has each: the worker, the user, or nobody.

    Ids ``0 .. granted - 1`` are the worker's from its start (its free list). A
    slot the worker wrote is either handed out as views (:meth:`take`: the user's
    until its views are collected) or copied and given back. Not thread-safe,
    except that a batch's views may be dropped in any thread (their release is a
    ``deque.append``, read by the next :meth:`collect`).
    """

    def __init__(self, granted: int, *, max_held: int = MAX_HELD, idle_limit: int | None = None):
        self.maps: dict[int, mmap.mmap] = {}
        self._next_id = granted
        self._max_held = max(0, int(max_held))
        self._idle_limit = max(1, granted if idle_limit is None else int(idle_limit))
        self._idle: list[int] = []  # released by the user, mapped, not the worker's
        self._held: dict[int, weakref.ref[_Lease]] = {}
        self._released: collections.deque[int] = collections.deque()

    @property
    def held(self) -> int:
        """Slots whose batch the user still holds (releases not yet collected count)."""
        return len(self._held)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def add_map(self, slot: int, fd: int, size: int) -> None:
        """Maps a new (or grown) slot the worker sent; its old map, if any, is unmapped."""
        old = self.maps.pop(slot, None)
        if old is not None:
            # A slot the worker writes is never the user's: nothing views the old map.
            with contextlib.suppress(BufferError):
                old.close()
        self.maps[slot] = mmap.mmap(fd, size)  # shared, read-write

    def take(
        self,
        slot: int,
        fields: Sequence[Field],
        lanes: tuple[int, Sequence[LaneField]] | None = None,
    ) -> tuple[dict[str, np.ndarray], list[int]]:
        """The leaves of the batch in ``slot``, and the slot ids to give to the worker.

        ``lanes``: ``(rows, each field's LaneField)`` when the worker laid the batch out
        as a packed transfer's buffer (``pipeline/lanes.py``): the slot records the views.

        Returns views of the slot and a replacement slot for the worker, or, with
        :data:`MAX_HELD` slots already held, copies and ``slot`` itself. Call
        :meth:`collect` first, so that released slots count as released.
        """
        mem = self.maps[slot]
        if len(self._held) >= self._max_held:
            whole = np.frombuffer(mem, np.uint8)
            copies = {f[0]: _view(whole, f).copy() for f in fields}
            del whole
            return copies, [slot]
        lease = np.frombuffer(mem, np.uint8).view(_Lease)
        leaves = {}
        for f in fields:
            key, dtype, shape, count, offset, stride = f
            if count and not stride:  # the usual leaf, inline: this runs per leaf per batch
                end = offset + count * dtype.itemsize
                leaves[key] = lease[offset:end].view(dtype).reshape(shape).view(np.ndarray)
            else:
                leaves[key] = _view(lease, f).view(np.ndarray)
        if lanes is not None:
            record(lease, lanes[0], zip(leaves.values(), lanes[1], strict=True))
        self._held[slot] = weakref.ref(lease, _on_release(self._released, slot))
        del lease
        return leaves, [self._spare()]

    def take_group(
        self, slot: int, fields: Sequence[Field], size: int, count: int
    ) -> tuple[list[dict[str, np.ndarray]], list[int]]:
        """The leaves of the ``count`` batches in ``slot`` (batch ``i`` laid out as
        ``fields`` from byte ``i * size``), and the slot ids to give to the worker.

        As :meth:`take`, with one lease for them all: the slot goes back to the worker once
        every leaf of every batch is dropped. With :data:`MAX_HELD` slots held, copies.
        """
        mem = self.maps[slot]
        if len(self._held) >= self._max_held:
            whole = np.frombuffer(mem, np.uint8)
            copies = [
                {f[0]: _view(whole[i * size :], f).copy() for f in fields} for i in range(count)
            ]
            del whole
            return copies, [slot]
        lease = np.frombuffer(mem, np.uint8).view(_Lease)
        batches = []
        for i in range(count):
            base = i * size
            leaves = {}
            for f in fields:
                key, dtype, shape, n, offset, stride = f
                if n and not stride:  # the usual leaf, inline: this runs per leaf per batch
                    start = base + offset
                    end = start + n * dtype.itemsize
                    leaves[key] = lease[start:end].view(dtype).reshape(shape).view(np.ndarray)
                else:
                    leaves[key] = _view(lease[base:], f).view(np.ndarray)
            batches.append(leaves)
        self._held[slot] = weakref.ref(lease, _on_release(self._released, slot))
        del lease
        return batches, [self._spare()]

    def _spare(self) -> int:
        if self._idle:
            return self._idle.pop()
        self._next_id += 1
        return self._next_id - 1

    def collect(self) -> list[int]:
        """Moves the slots the user released to the idle ones; returns those to drop.

        The caller tells the worker to drop each returned id (this side's map is gone).
        """
        dropped = []
        while self._released:
            slot = self._released.popleft()
            if self._held.pop(slot, None) is None:
                continue
            if len(self._idle) < self._idle_limit:
                self._idle.append(slot)
            else:
                dropped.append(slot)
                mem = self.maps.pop(slot, None)
                if mem is not None:
                    with contextlib.suppress(BufferError):
                        mem.close()
        return dropped

    def close(self) -> None:
        """Unmaps every slot no batch views; those the user holds stay mapped until dropped."""
        for mem in self.maps.values():
            with contextlib.suppress(BufferError):  # viewed: unmapped with its last view
                mem.close()
        self.maps.clear()
        self._held.clear()  # their releases have nowhere to go now
        self._idle.clear()
