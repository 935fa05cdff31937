"""A sum tree and a min tree of 128-wide lines over a device replay ring's probability masses.

Level 0 is each slot's mass ``(priority + eps) ** alpha``, ``-0.0`` for an empty slot
(its sign bit says "not live": a live slot's mass is ``>= +0.0``), as lines ``(ceil(C /
128), 128)``; level ``l + 1`` holds the sums of level ``l``'s lines, padded with zeros to
whole lines; the top level is one line (three levels up to ``C = 128**3 = 2,097,152``
slots, four up to ``2**28``). The min tree holds, from level 1 up, the least mass of the
live slots under each entry (``+inf`` where none), so ``p_min`` is a min over 128 values.

A draw descends from the top line: at each level it gathers one 128-wide line per draw,
takes the line's inclusive sums with one matmul by an upper-triangular ones matrix
(``precision=HIGHEST``: float32 sums), and counts the sums below its target (no binary
search, no sequential loop: a TPU runs a ``searchsorted`` as a while loop of gathers).
Float rounding can leave a target at or past a line's total, or on an entry of mass 0: the
pick then moves to the last entry of positive mass at or before it (the first after it if
none), so a draw never lands on an empty slot.

Both trees live in one float32 array of lines (a :class:`~grain_replay.DeviceReplayState`'s
``mass``, beside the priorities): :func:`update` writes into it in place. An update sets
level-0 masses (:func:`set_entries`: on a TPU one matmul for rings of up to
``ONE_HOT_LINES`` lines, a scatter otherwise) and then, for a ring of up to
:data:`DENSE_SLOTS` slots, rebuilds the levels above from level 0 (one pass, ``O(C)``: a
reduction over the lines, the way :func:`build` sums them); for a larger ring it recomputes,
level by level, only the entries above the touched lines (gather the touched lines, reduce,
scatter: ``O(B · levels · 128)``). Measured on a TPU v5e (``B = 256``, inside a jitted loop):
the rebuild 0.027 ms at 10^6 slots, 0.021 ms at 5·10^4; the level-by-level scatters 0.071 /
0.068 ms (a TPU's scatter writes one entry at a time, ~60 ns each). In the prioritized conv
step at 5·10^4 slots, setting the priorities and level 0 by matmul instead of two scatters
took the step from 0.30 to 0.26 ms of chip. A refresh rebuilds every level.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from grain_replay.device.lines import apart

__all__ = [
    "DENSE_SLOTS",
    "ONE_HOT_LINES",
    "build",
    "draw",
    "level_lines",
    "lowest",
    "rebuild",
    "set_entries",
    "update",
]

LANES = 128
# Rings up to this many slots rebuild the levels above level 0 at an update (see above):
# 4 Mi slots is ~16 MB a pass, ~2x the rebuild at 10^6 slots, still under the scatters.
DENSE_SLOTS = 1 << 22
# Blocks of up to this many lines have entries set by one matmul (set_entries), larger
# ones by a scatter; None: 2048 on a TPU, 0 elsewhere (a CPU's or a GPU's scatter is fast:
# on a CPU the matmul was 10x the scatters at 20,000 slots).
ONE_HOT_LINES: int | None = None


def _one_hot_lines() -> int:
    if ONE_HOT_LINES is not None:
        return ONE_HOT_LINES
    return 2048 if jax.default_backend() == "tpu" else 0


_HI = jax.lax.Precision.HIGHEST


def level_lines(capacity: int) -> list[int]:
    """Lines of each level for ``capacity`` slots, level 0 first, the top (1 line) last."""
    n = [math.ceil(capacity / LANES)]
    while n[-1] > 1:
        n.append(math.ceil(n[-1] / LANES))
    return n


def _as_lines(x: jax.Array, lines: int, fill: float) -> jax.Array:
    return jnp.pad(x, (0, lines * LANES - x.shape[0]), constant_values=fill).reshape(lines, LANES)


def _live_min(x: jax.Array) -> jax.Array:
    """Level-0 masses with the empty slots (sign bit set) at +inf."""
    return jnp.where(jnp.signbit(x), jnp.inf, x)


def build(
    priority: jax.Array, live: jax.Array, alpha: float, eps: float
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Traced: every level of the sum tree and the min tree of ``priority`` (float32[C])
    over the ``live`` (bool[C]) slots. Returns ``(sums, mins)``: ``sums[0]`` the masses,
    ``mins[l - 1]`` the min tree's level ``l``."""
    counts = level_lines(priority.shape[0])
    mass = jnp.where(live, (priority.astype(jnp.float32) + eps) ** alpha, -0.0)
    return _above(_as_lines(mass, counts[0], -0.0), counts)


def _above(
    level0: jax.Array, counts: list[int]
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Every level of both trees from the masses ``level0`` (lines)."""
    sums = [level0]
    mins: list[jax.Array] = []
    low = _live_min(level0)
    for n in counts[1:]:
        sums.append(_as_lines(sums[-1].sum(1), n, 0.0))
        low = _as_lines(low.min(1), n, jnp.inf)
        mins.append(low)
    return tuple(sums), tuple(mins)


def lowest(sums: tuple[jax.Array, ...], mins: tuple[jax.Array, ...]) -> jax.Array:
    """The least mass over the live slots (+inf: none)."""
    return jnp.min(mins[-1] if mins else _live_min(sums[0]))


def _tri() -> jax.Array:
    return jnp.asarray(np.triu(np.ones((LANES, LANES), np.float32)))


def _pick(x: jax.Array, c: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """In each line ``x`` (B, 128) with inclusive sums ``c``, the entry whose span holds
    ``u`` (B,): ``(entry, u - the sum before it, its mass)``; never an entry of mass <= 0
    while the line has a positive one."""
    ar = jnp.arange(LANES, dtype=jnp.int32)[None, :]
    count = (c < u[:, None]).sum(1, dtype=jnp.int32)[:, None]  # 0..128
    pos = x > 0
    below = jnp.max(jnp.where(pos & (ar <= count), ar, -1), axis=1)
    first = jnp.min(jnp.where(pos, ar, LANES - 1), axis=1)
    j = jnp.where(below >= 0, below, first)
    before = jnp.sum(jnp.where(ar == (j - 1)[:, None], c, 0.0), axis=1)
    mass = jnp.sum(jnp.where(ar == j[:, None], x, 0.0), axis=1)
    return j, jnp.maximum(u - before, 0.0), mass


def draw(
    key: jax.Array,
    sums: tuple[jax.Array, ...],
    batch_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Traced: ``batch_size`` slots drawn with probability ``mass / total``, stratified (one
    draw in each of ``batch_size`` equal slices of the total). Returns ``(slots int32[B],
    their masses float32[B], the total)``; the slots are meaningless when the total is 0."""
    tri = _tri()
    top = sums[-1]  # (1, 128)
    c_top = jnp.dot(top, tri, precision=_HI)
    total = c_top[0, -1]
    b = batch_size
    u = (jnp.arange(b, dtype=jnp.float32) + jax.random.uniform(key, (b,))) / b * total
    u = jnp.minimum(u, jnp.nextafter(total, jnp.float32(0)))
    slot, u, mass = _pick(jnp.broadcast_to(top, (b, LANES)), jnp.broadcast_to(c_top, (b, LANES)), u)
    for level in reversed(sums[:-1]):
        x = jnp.take(level, slot, axis=0, mode="clip")  # (B, 128) lines
        j, u, mass = _pick(x, jnp.dot(x, tri, precision=_HI), u)
        slot = slot * LANES + j
    capacity_lanes = sums[0].shape[0] * LANES
    return jnp.minimum(slot, capacity_lanes - 1).astype(jnp.int32), mass, total


def set_entries(
    blocks: list[jax.Array],
    line: jax.Array,
    lane: jax.Array,
    values: list[jax.Array],
    ok: jax.Array,
) -> list[jax.Array]:
    """Traced: each float32 block of lines (n, 128) with entry ``(line[i], lane[i])`` set to
    ``values[j][i]`` (finite) where ``ok[i]``; the ``ok`` entries' places are distinct.

    No scatter: a TPU's scatter writes one entry at a time (two scatters of 256 entries
    into 793 lines took 15.4 us of chip each, 31 us of a 0.3 ms prioritized conv step, in a
    TPU v5e's profile). Here one matmul, ``one_hot(line).T @ [one_hot(lane), one_hot(lane)
    * values...]`` (``precision=HIGHEST``: one product of 1.0 and a float32 is exact, and no
    place has two; a subnormal value may come out 0, as a TPU's arithmetic flushes it
    anyway), gives each place whether it is hit and its new values, and a select keeps
    the other entries (their sign bits included) as they are. Its cost grows with
    ``n`` where the scatter's does not: blocks of more than :data:`ONE_HOT_LINES` lines
    take the scatter, and so does every block off a TPU (where a scatter is fast).
    """
    n = blocks[0].shape[0]
    if n > _one_hot_lines():
        at = apart(ok, line, n)
        return [
            b.at[at, lane].set(v, mode="drop", unique_indices=True)
            for b, v in zip(blocks, values, strict=True)
        ]
    hot_line = (line[:, None] == jnp.arange(n, dtype=line.dtype)[None, :]) & ok[:, None]
    hot_lane = (lane[:, None] == jnp.arange(LANES, dtype=lane.dtype)[None, :]) & ok[:, None]
    rhs = jnp.concatenate(
        [hot_lane.astype(jnp.float32)] + [jnp.where(hot_lane, v[:, None], 0.0) for v in values],
        axis=1,
    )
    grid = jax.lax.dot_general(  # (n, 128 * (1 + len(values))): contracted over the entries
        hot_line.astype(jnp.float32), rhs, (((0,), (0,)), ((), ())), precision=_HI
    )
    hit = grid[:, :LANES] > 0.5
    return [
        jnp.where(hit, grid[:, (j + 1) * LANES : (j + 2) * LANES], b) for j, b in enumerate(blocks)
    ]


def rebuild(
    packed: jax.Array,
    sums_at: list[tuple[int, int]],
    mins_at: list[tuple[int, int]],
    level0: jax.Array,
) -> jax.Array:
    """Traced: ``packed`` (laid out as :func:`update` says) with level 0 set to ``level0``
    (lines) and every level above recomputed from it (one pass, ``O(C)``); in place."""
    sums, mins = _above(level0, [n for _, n in sums_at])
    for (at, _), x in zip(sums_at + mins_at, sums + mins, strict=True):
        packed = jax.lax.dynamic_update_slice_in_dim(packed, x, at, axis=0)
    return packed


def update(
    packed: jax.Array,
    sums_at: list[tuple[int, int]],
    mins_at: list[tuple[int, int]],
    slots: jax.Array,
    mass: jax.Array,
    ok: jax.Array,
) -> jax.Array:
    """Traced: ``packed`` (float32 lines holding the trees: level ``l`` of the sum tree at
    lines ``sums_at[l] = (first, count)``, level ``l + 1`` of the min tree at
    ``mins_at[l]``) with the masses of ``slots`` (int32[B], distinct where ``ok``; live)
    set to ``mass`` (float32[B], >= 0) and, level by level, only the entries above the
    touched lines recomputed: the way for rings past :data:`DENSE_SLOTS` (smaller ones set
    level 0 with :func:`set_entries` and :func:`rebuild` the levels above). Entries not
    ``ok`` are skipped. Every write goes into ``packed`` in place (a donated state's
    buffer is reused)."""
    first, _ = sums_at[0]
    end = packed.shape[0]
    line = slots // LANES
    lane = slots % LANES
    # the skipped entries each to its own line past the end: the indices stay distinct
    packed = packed.at[apart(ok, first + line, end), lane].set(
        mass, mode="drop", unique_indices=True
    )
    low_at = None
    for (s_at, _), (m_at, _) in zip(sums_at[1:], mins_at, strict=True):
        prev = first if low_at is None else low_at[0]
        x = jnp.take(packed, prev + line, axis=0, mode="clip")  # the touched lines, updated
        low = _live_min(x) if low_at is None else jnp.take(packed, low_at[1] + line, axis=0)
        dst = jnp.where(ok, line // LANES, end)  # duplicates write equal values
        lane = line % LANES
        packed = packed.at[s_at + dst, lane].set(x.sum(1), mode="drop")
        packed = packed.at[m_at + dst, lane].set(low.min(1), mode="drop")
        low_at = (s_at, m_at)
        line = line // LANES
    return packed
