"""The device writer's host copies: a batch of queued trees on the host, as blocks to write.

An accelerator's like trees are stacked on the device and copied as one buffer a
group (:mod:`grain_replay.writers.device.pack`); every other leaf is waited for
one by one (:func:`to_host`). A failed copy or write is named by
:func:`batch_error`. Run by :class:`~grain_replay.writers.device.background.BackgroundWriter`'s
thread; jax is never imported here.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import numpy as np

from grain_replay.errors import BackgroundWriteError
from grain_replay.writers.device import pack as device_pack
from grain_replay.writers.device.queue import Item
from grain_replay.writers.write_errors import write_error

__all__ = ["batch_error", "batch_to_host", "to_host"]

_ROWS = operator.attrgetter("rows")

logger = logging.getLogger(__name__)


def to_host(leaf: Any) -> np.ndarray:
    """A queued leaf on the host (a device leaf's copy, waited for)."""
    return np.asarray(leaf)


def batch_to_host(
    batch: list[Item], where: str
) -> tuple[list[tuple[dict[str, np.ndarray], int]], BackgroundWriteError | None]:
    """The batch's rows on the host, as blocks in order (``(arrays, rows)``): the
    accelerator leaves of like trees stacked on the device and copied as one buffer a
    group (device_pack), a group one block; the rest copied leaf by leaf, newest first
    (the steps finish in append order, so the first wait is the only one); a failure
    is the leaf's whose copy failed (``where``: the store, for its message)."""
    try:
        packed = device_pack.pack_batch(batch)
    except Exception as e:  # the copies below meet the failure again and name the leaf
        logger.debug("%s: stacked copies failed (%s); copying leaf by leaf", where, e)
        packed = []
    if len(packed) == 1 and packed[0].count == len(batch):
        # One group, the whole batch (an actor's steps): one block, when the group holds
        # every leaf (no CPU leaf beside the accelerator's).
        block = packed[0].arrays
        if len(block) == len(batch[0].arrays):
            return [(block, sum(map(_ROWS, batch)))], None
    groups = {p.start: p for p in packed}
    stacked = {i: p.arrays for p in packed for i in range(p.start, p.start + p.count)}
    key = ""
    for i in range(len(batch) - 1, -1, -1):
        item = batch[i]
        arrays = item.arrays
        done = stacked.get(i, {})
        if len(done) == len(arrays):
            continue  # every leaf is in its group's block
        try:
            for key in arrays:
                if key not in done:
                    arrays[key] = to_host(arrays[key])
        except Exception as e:
            return [], batch_error(where, [item], e, copying=key)
    parts: list[tuple[dict[str, np.ndarray], int]] = []
    i = 0
    while i < len(batch):
        group = groups.get(i)
        if group is None:
            parts.append((batch[i].arrays, batch[i].rows))
            i += 1
            continue
        items = batch[i : i + group.count]
        block = {
            k: group.arrays[k]
            if k in group.arrays
            else np.concatenate([item.arrays[k] for item in items])
            for k in items[0].arrays
        }
        parts.append((block, sum(item.rows for item in items)))
        i += group.count
    return parts, None


def batch_error(
    where: str, batch: list[Item], e: Exception, copying: str | None = None
) -> BackgroundWriteError:
    """The error of a failed copy (``copying``: the leaf) or write of ``batch``."""
    rows = sum(item.rows for item in batch)
    return write_error(where, batch[0].first, rows, e, copying)
