"""Jittable draws of a device replay ring: uniform over the live slots, or proportional to
priority through the ring's sum tree (``replay_tree.py``); fixed shapes, no host sync, no
binary search, no pass over the whole ring."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grain_replay.device import replay_tree as tree
from grain_replay.device.replay_state import StateLayout

__all__ = ["last_of_each", "prioritized", "uniform", "updated_priorities"]

LANES = tree.LANES
_PAIRWISE = 2048  # batches up to this find repeated slots pairwise, bigger ones by a sort


def _select(lines: jax.Array, lane: jax.Array) -> jax.Array:
    """Entry ``lane[i]`` of line ``lines[i]`` (B, 128)."""
    ar = jnp.arange(LANES, dtype=jnp.int32)[None, :]
    return jnp.sum(jnp.where(ar == lane[:, None], lines, 0), axis=1, dtype=lines.dtype)


def uniform(
    key: jax.Array, live_slots: jax.Array, n_live: jax.Array, batch_size: int
) -> tuple[jax.Array, jax.Array]:
    """``batch_size`` slots drawn uniformly with replacement from the first ``n_live``
    entries of the table ``live_slots`` (int32 lines (C/128, 128)), and their weights
    (1.0). With no live slot: slot -1, weight 0.

    Returns:
      ``(slots int32[B], weights float32[B])``.
    """
    j = jax.random.randint(key, (batch_size,), 0, jnp.maximum(n_live, 1), dtype=jnp.int32)
    slots = _select(jnp.take(live_slots, j // LANES, axis=0, mode="clip"), j % LANES)
    some = n_live > 0
    return (
        jnp.where(some, slots, -1).astype(jnp.int32),
        jnp.where(some, jnp.ones(batch_size, jnp.float32), 0.0),
    )


def prioritized(
    key: jax.Array,
    sums: tuple[jax.Array, ...],
    mins: tuple[jax.Array, ...],
    batch_size: int,
    beta: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``batch_size`` slots drawn with probability ``p_i / sum(p)`` (``p_i = (priority_i +
    eps) ** alpha``, the tree's level 0, 0 for an empty slot), stratified (one draw in each
    of ``batch_size`` equal slices of the total, as the host
    :class:`~grain_replay.PrioritizedReplay` draws), and their importance weights ``(p_min
    / p_i) ** beta`` (float32, ``p_min`` over the live slots: the min tree's top). With no
    live slot (or every ``p`` 0): slot -1, weight 0.

    Returns:
      ``(slots int32[B], weights float32[B])``.
    """
    slots, p_i, total = tree.draw(key, sums, batch_size)
    weight = (tree.lowest(sums, mins) / p_i) ** beta
    some = total > 0
    return (
        jnp.where(some, slots, -1).astype(jnp.int32),
        jnp.where(some, weight, 0.0).astype(jnp.float32),
    )


def last_of_each(index: jax.Array, ok: jax.Array) -> jax.Array:
    """``ok`` where no later ``ok`` entry has the same index: of a slot given twice, the
    last one (the host sum tree's rule)."""
    b = index.shape[0]
    if b <= _PAIRWISE:
        same = (index[:, None] == index[None, :]) & ok[None, :]
        later = jnp.any(jnp.triu(same, k=1), axis=1)
        return ok & ~later
    pos = jnp.arange(b, dtype=jnp.int32)
    key = jnp.where(ok, index, -1 - pos)  # the skipped ones each apart
    order = jnp.lexsort((pos, key))
    k = key[order]
    last = jnp.concatenate([k[1:] != k[:-1], jnp.ones(1, bool)])
    return ok & jnp.zeros(b, bool).at[order].set(last)


def updated_priorities(
    mass: jax.Array,
    at: StateLayout,
    live: jax.Array,
    index: jax.Array,
    given: jax.Array,
    alpha: float,
    eps: float,
) -> jax.Array:
    """A state's ``mass`` lines (laid out as ``at`` says) with the priorities of slots
    ``index`` set to ``given``, the largest priority raised to match, and the trees (for a
    prioritized layout) updated; ``live`` is the state's bool[C]. In place: a donated
    state's buffer is reused.

    Entries that cannot apply are skipped (inside jit nothing can raise): a slot outside
    ``[0, C)`` (-1: an empty ring's draw), a slot not live, a priority negative, NaN or
    infinite. With a slot twice, the last of its priorities is kept (the host rule).
    """
    c = at.capacity
    index = index.reshape(-1).astype(jnp.int32)
    given = given.reshape(-1).astype(jnp.float32)
    ok = (index >= 0) & (index < c) & jnp.isfinite(given) & (given >= 0)
    ok &= jnp.take(live, jnp.clip(index, 0, c - 1))
    p = (given + eps) ** alpha
    if at.sums_at:
        ok &= jnp.isfinite(p)  # a mass past float32's range would make the total inf
    top = jnp.max(jnp.where(ok, given, 0.0), initial=0.0)
    ok = last_of_each(index, ok)
    slot = jnp.where(ok, index, 0)
    line, lane, n = slot // LANES, slot % LANES, at.lines
    first, n0 = at.sums_at[0] if at.sums_at else (0, 0)
    if at.sums_at and n0 * LANES <= tree.DENSE_SLOTS:
        # the priorities (lines [0, n)) and level 0 set together, the levels above rebuilt
        pri, level0 = tree.set_entries(
            [mass[:n], mass[first : first + n0]], line, lane, [given, p], ok
        )
        mass = jax.lax.dynamic_update_slice_in_dim(mass, pri, 0, axis=0)
        mass = tree.rebuild(mass, at.sums_at, at.mins_at, level0)
    else:
        (pri,) = tree.set_entries([mass[:n]], line, lane, [given], ok)
        mass = jax.lax.dynamic_update_slice_in_dim(mass, pri, 0, axis=0)
        if at.sums_at:  # a ring past DENSE_SLOTS: the touched lines' entries, level by level
            mass = tree.update(mass, at.sums_at, at.mins_at, slot, p, ok)
    return mass.at[at.lines, 0].max(top)  # the largest priority given so far
