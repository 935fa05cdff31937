"""Rows of a device replay ring held lane-dense: each group of leaves one buffer, no tiling waste.

A TPU tiles an array's two minor dimensions to ``(8·k, 128)``: a ``(capacity, 131)`` row
matrix takes the room of ``(capacity, 256)``, a ``(capacity,)`` leaf of one bool per row
is fine but ``(capacity, 1)`` is 128 times its size. So each group of leaves
(:class:`~grain_replay.device.resident_store.Probe` packs a record's leaves into one row
per dtype width, bit-exact) is held in one of two layouts:

- *rows*: ``(capacity, width)``, when ``width`` is a multiple of 128 or so wide that
  rounding it up to one costs at most 1/16 (an 84x84x4 frame: 28,224 bytes -> 28,288);
- *flat*: the rows back to back in ``(lane_rows, 128)``: row ``s`` is elements
  ``[s·width, (s+1)·width)``; a draw gathers the ``K`` lane rows each drawn row spans
  (one row gather) and shifts it to its offset (one lane gather).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grain_replay.device.resident_store import Probe

__all__ = ["LANES", "RowLayout"]

LANES = 128
_MAX_WASTE = 1.0 / 16  # rows layout when rounding the width up to LANES wastes at most this


class RowLayout:
    """Where each group of a probe's leaves lives in the ring, and how to gather or write rows.

    Args:
      probe: the store's leaves and their packing into groups.
      capacity: rows the ring holds.
    """

    def __init__(self, probe: Probe, capacity: int) -> None:
        self.probe = probe
        self.capacity = capacity
        one = probe.group_shapes(1)
        self.row_shapes = [tuple(s[1:]) for s in one]  # what unpack takes per row
        self.widths = [int(np.prod(s, dtype=np.int64)) for s in self.row_shapes]
        self.dtypes = [np.dtype(d) for d in probe.group_dtypes]
        self.flat = []
        self.spans = []  # lane rows a drawn row may span (flat layout)
        self.shapes: list[tuple[int, ...]] = []
        for w in self.widths:
            padded = math.ceil(w / LANES) * LANES
            flat = w % LANES != 0 and (padded - w) / w > _MAX_WASTE
            self.flat.append(flat)
            span = (w + 2 * LANES - 2) // LANES  # offset <= 127 plus w elements
            self.spans.append(span)
            if flat:
                self.shapes.append((math.ceil(capacity * w / LANES) + span, LANES))
            else:
                self.shapes.append((capacity, w))

    def nbytes(self) -> int:
        """Bytes of the ring's row buffers (as allocated, before any device tiling)."""
        return sum(
            int(np.prod(s, dtype=np.int64)) * d.itemsize
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    def row_bytes(self) -> int:
        """Bytes of one record's leaves as the ring holds them."""
        return sum(w * d.itemsize for w, d in zip(self.widths, self.dtypes, strict=True))

    def allocate(self) -> list[jax.Array]:
        """Traced: zero buffers of every group."""
        return [jnp.zeros(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]

    def _lane_index(self, g: int, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
        """First lane row and lane offset of rows ``slots`` of flat group ``g`` (no int32
        overflow below 2**24 rows: ``s·w = s·(a·128 + b)`` splits as ``s·a`` lane rows and
        ``s·b`` elements)."""
        a, b = divmod(self.widths[g], LANES)
        rest = slots * b
        return slots * a + rest // LANES, rest % LANES

    def gather(self, bufs: Any, slots: jax.Array) -> list[jax.Array]:
        """Traced: the leaves (in leaf order, device dtypes) of rows ``slots`` (int32, valid)."""
        b = slots.shape[0]
        rows = []
        for g, buf in enumerate(bufs):
            w = self.widths[g]
            if not self.flat[g]:
                r = jnp.take(buf, slots, axis=0, mode="clip")
            else:
                q, o = self._lane_index(g, slots)
                span = self.spans[g]
                tiles = jnp.take(buf, q[:, None] + jnp.arange(span), axis=0, mode="clip")
                tiles = tiles.reshape(b, span * LANES)
                r = jnp.take_along_axis(tiles, o[:, None] + jnp.arange(w), axis=1)
            rows.append(r.reshape(b, *self.row_shapes[g]))
        return self.probe.unpack(rows)

    def scatter(self, bufs: Any, leaves: list[jax.Array], targets: jax.Array) -> list[jax.Array]:
        """Traced: ``bufs`` with rows ``targets`` (int32; ``capacity``: dropped) set to
        ``leaves`` (one per leaf, leading axis ``len(targets)``)."""
        k = targets.shape[0]
        out = []
        for g, (buf, packed) in enumerate(zip(bufs, self.probe.pack(leaves), strict=True)):
            w = self.widths[g]
            x = packed.reshape(k, w).astype(buf.dtype)
            if not self.flat[g]:
                out.append(buf.at[targets].set(x.reshape(k, *buf.shape[1:]), mode="drop"))
                continue
            q, o = self._lane_index(g, targets)
            lane = o[:, None] + jnp.arange(w)
            row = q[:, None] + lane // LANES
            row = jnp.where((targets < self.capacity)[:, None], row, buf.shape[0])
            out.append(buf.at[row, lane % LANES].set(x, mode="drop"))
        return out
