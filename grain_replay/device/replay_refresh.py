"""A :class:`~grain_replay.DeviceReplay` ring's buffers on the device: allocated empty (``init``
loads the store's rows into them with a refresh), then written by each refresh on the host
(the new rows read in one batch, padded to a size class, put, and scattered into the donated
ring by one jitted update)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grain_replay.device.lines import RowLayout
from grain_replay.device.replay_state import DeviceReplayState, Ring, StateLayout, news
from grain_replay.errors import InvalidStoreError

__all__ = ["allocate", "bucket", "refresh", "write"]

Trees = Callable[[jax.Array, jax.Array], tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]]
"""Traced: the sum and min trees of a priority vector over the live slots (empty for uniform)."""


def bucket(k: int, capacity: int) -> int:
    """Rows a refresh transfers for ``k`` new rows: the next power of two (at most the
    capacity), so the ring update compiles once per size class, never per refresh."""
    return min(capacity, 1 << max(0, k - 1).bit_length()) if k else 1


def allocate(layout: RowLayout, at: StateLayout, trees: Trees) -> DeviceReplayState:
    """Traced: an empty ring of ``layout.capacity`` slots, its other parts where ``at``
    says."""
    c = layout.capacity
    live, priority = jnp.zeros(c, bool), jnp.zeros(c, jnp.float32)
    sums, mins = trees(priority, live)
    empty = {
        "slot_hi": jnp.full(c, -1, jnp.int32),
        "slot_lo": jnp.zeros(c, jnp.int32),
        "order": jnp.full(c, -1, jnp.int32),
        "live": live,
        "live_slots": jnp.zeros(0, jnp.int32),
        "n_live": jnp.int32(0),
        "mark_hi": jnp.zeros(at.writers, jnp.int32),
        "mark_lo": jnp.zeros(at.writers, jnp.int32),
        "refreshes": jnp.int32(0),
    }
    return DeviceReplayState(
        rows=tuple(layout.allocate()),
        book=at.book(jnp, empty),
        mass=at.mass(priority, jnp.float32(1.0), sums, mins),
    )


def refresh(
    state: DeviceReplayState,
    source: Any,
    layout: RowLayout,
    at: StateLayout,
    *,
    bounded: bool,
    where: str,
    device: jax.Device,
    write: Callable[[DeviceReplayState, Any, Any, Any], DeviceReplayState],
) -> DeviceReplayState:
    """On the host: ``state`` with the rows ``source`` committed since in free (or the
    oldest) slots and the evicted rows' slots emptied, written by ``write`` (the jitted,
    donated :func:`write`); ``state`` itself when nothing changed.

    Raises:
      InvalidStoreError: a leaf's rows changed shape since the ring was set up (and what
        :func:`~grain_replay.device.replay_state.news` raises).
    """
    ring = Ring.of(state, at)
    positions, new_ids, gone = news(source, ring, bounded, where)
    evicted = ring.evict(gone) if gone is not None else 0
    targets = ring.place(new_ids)
    if len(targets) == 0 and not evicted:
        return state
    k = len(targets)
    kb = bucket(k, layout.capacity)
    read = jax.tree_util.tree_leaves(source.read_batch(positions)) if k else None
    chunk = []
    for i, (shape, dtype) in enumerate(zip(layout.probe.shapes, layout.probe.dtypes, strict=True)):
        buf = np.zeros((kb, *shape), dtype)
        if read is not None:
            if tuple(np.shape(read[i])) != (k, *shape):
                raise InvalidStoreError(
                    f"DeviceReplay: leaf {i} of {where} gave rows of shape "
                    f"{np.shape(read[i])[1:]}, but {shape} when the ring was set up. "
                    "Fix: keep every row of a leaf one shape."
                )
            buf[:k] = read[i]
        chunk.append(buf)
    padded = np.full(kb, layout.capacity, np.int32)
    padded[:k] = targets
    book = ring.book(at)
    chunk, padded, book = jax.device_put((chunk, padded, book), device)
    return write(state, chunk, padded, book)


def write(
    state: DeviceReplayState,
    chunk: list[jax.Array],
    targets: jax.Array,
    book: jax.Array,
    layout: RowLayout,
    at: StateLayout,
    trees: Trees,
) -> DeviceReplayState:
    """Traced: ``chunk``'s rows scattered into slots ``targets`` (the capacity: padding,
    dropped) at the top priority, the host's bookkeeping ``book`` taken over."""
    rows = layout.scatter(state.rows, chunk, targets)
    old = at.view(state)
    live = at.book_parts(book)["live"]
    priority = old.priority.at[targets].set(old.max_priority, mode="drop")
    priority = jnp.where(live, priority, 0.0)
    sums, mins = trees(priority, live)
    return DeviceReplayState(
        rows=tuple(rows),
        book=book,
        mass=at.mass(priority, old.max_priority, sums, mins),
    )
