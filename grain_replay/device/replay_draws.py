"""Jittable draws of a device replay ring: uniform over the live slots, or proportional to
priority; fixed shapes, no host sync, O(capacity) vectorized work at most."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["prioritized", "uniform", "updated_priorities"]


def uniform(
    key: jax.Array, live_slots: jax.Array, n_live: jax.Array, batch_size: int
) -> tuple[jax.Array, jax.Array]:
    """``batch_size`` slots drawn uniformly with replacement from the first ``n_live``
    entries of ``live_slots``, and their weights (1.0). With no live slot: slot -1, weight 0.

    Returns:
      ``(slots int32[B], weights float32[B])``.
    """
    j = jax.random.randint(key, (batch_size,), 0, jnp.maximum(n_live, 1), dtype=jnp.int32)
    slots = jnp.take(live_slots, j, mode="clip")
    some = n_live > 0
    return (
        jnp.where(some, slots, -1).astype(jnp.int32),
        jnp.where(some, jnp.ones(batch_size, jnp.float32), 0.0),
    )


def prioritized(
    key: jax.Array,
    priority: jax.Array,
    live: jax.Array,
    batch_size: int,
    alpha: float,
    eps: float,
    beta: float | jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``batch_size`` slots drawn with probability ``p_i / sum(p)``, ``p_i = (priority_i + eps)
    ** alpha`` over the live slots, stratified (one draw in each of ``batch_size`` equal
    slices of the total, as the host :class:`~grain_replay.PrioritizedReplay` draws), and
    their importance weights ``(p_min / p_i) ** beta`` (float32, ``p_min`` over the live
    slots). With no live slot (or every ``p`` 0): slot -1, weight 0.

    A cumulative sum and a binary search: O(capacity + B log capacity).

    Returns:
      ``(slots int32[B], weights float32[B])``.
    """
    p = jnp.where(live, (priority.astype(jnp.float32) + eps) ** alpha, 0.0)
    cum = jnp.cumsum(p)
    total = cum[-1]
    u = jnp.arange(batch_size, dtype=jnp.float32) + jax.random.uniform(key, (batch_size,))
    u = u / batch_size * total
    # Below the total always (float rounding): the first slot whose cum exceeds u has p > 0.
    u = jnp.minimum(u, jnp.nextafter(total, jnp.float32(0)))
    slots = jnp.searchsorted(cum, u, side="right").astype(jnp.int32)
    slots = jnp.minimum(slots, priority.shape[0] - 1)
    p_i = jnp.take(p, slots)
    p_min = jnp.min(jnp.where(live, p, jnp.inf))
    weight = (p_min / p_i) ** beta
    some = total > 0
    return (
        jnp.where(some, slots, -1).astype(jnp.int32),
        jnp.where(some, weight, 0.0).astype(jnp.float32),
    )


def updated_priorities(
    priority: jax.Array,
    max_priority: jax.Array,
    live: jax.Array,
    index: jax.Array,
    given: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``priority`` with slots ``index`` set to ``given``, and the new largest priority.

    Entries that cannot apply are skipped (inside jit nothing can raise): a slot outside
    ``[0, C)`` (-1: an empty ring's draw), a slot not live, a priority negative, NaN or
    infinite. With a slot twice, one of its priorities is kept.
    """
    c = priority.shape[0]
    index = index.reshape(-1).astype(jnp.int32)
    given = given.reshape(-1).astype(jnp.float32)
    ok = (index >= 0) & (index < c) & jnp.isfinite(given) & (given >= 0)
    ok &= jnp.take(live, jnp.clip(index, 0, c - 1))
    priority = priority.at[jnp.where(ok, index, c)].set(given, mode="drop")
    top = jnp.max(jnp.where(ok, given, 0.0), initial=0.0)
    return priority, jnp.maximum(max_priority, top)
