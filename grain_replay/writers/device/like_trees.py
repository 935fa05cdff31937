"""The last device tree a writer queued: the next tree like it is queued from its attributes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grain_replay.writers.device import pack as device_pack
from grain_replay.writers.device.leaves import TreeSignature
from grain_replay.writers.device.queue import Item, Write

__all__ = ["LastTree"]


class LastTree:
    """What :meth:`~grain_replay.writers.device.background.BackgroundWriter.submit_like_last`
    keeps of the tree queued before: its signature (:class:`TreeSignature`: containers, array
    types, dtypes, per-row shapes, shardings), the write it was queued with, and the group key
    of a run of like trees of its rows (one object for the run: the thread groups them on
    identity, :mod:`~grain_replay.writers.device.pack`). Used by the caller's thread only."""

    def __init__(self) -> None:
        self._signature: TreeSignature | None = None
        self._write: Write | None = None
        self._pack: tuple[Any, tuple[str, ...]] | None = None

    def forget(self) -> None:
        """No tree is taken as like the last one until the next :meth:`remember`."""
        self._signature = None

    def remember(
        self,
        tree: Any,
        arrays: dict[str, Any],
        rows: int,
        write: Write,
        is_device: Callable[[Any], bool],
        where: str,
    ) -> tuple[Any, tuple[str, ...]] | None:
        """Keeps a checked tree (``tree`` None: none is kept, ``arrays`` its leaves) queued
        with ``write``; returns its item's group key."""
        signature = None if tree is None else TreeSignature.of(tree, arrays, is_device, where)
        self._signature = signature
        if tree is not None:
            self._write = write
        self._pack = None
        if signature is None:
            return device_pack.group_of(arrays, is_device)
        if signature.accel:  # like trees after it are keyed by it (take)
            self._pack = ((signature, rows), signature.accel)
        return self._pack

    def take(self, tree: Any, first: int) -> Item | None:
        """The queue's item of ``tree`` (the writer's rows ``first`` on) if it is a tree of
        device arrays like the last one kept, else None."""
        signature, write = self._signature, self._write
        if signature is None or write is None:
            return None
        taken = signature.take(tree)
        if taken is None:
            return None
        arrays, rows, nbytes = taken
        pack = self._pack
        if (pack is None or pack[0][1] != rows) and signature.accel:
            pack = self._pack = ((signature, rows), signature.accel)
        return Item(arrays, rows, first, nbytes, write, pack)
