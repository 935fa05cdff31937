"""A store's leaves as 32-bit words in 128-lane lines: the one device layout of rows.

Three parts of the package put a record's leaves into lanes, and all use this module:
``gr.DeviceReplay``'s ring (``device/replay.py``), device-resident replay's store
(``device/resident_store.py``) and packed transfers (``device/packed.py``, which packs a
batch on the host and unpacks it here, with :func:`from_words`).

A TPU tiles an array's two minor dimensions to ``(8, 128)`` 32-bit words: a ``(n, 64)``
float32 leaf takes the room of ``(n, 128)``, a ``(n, 1)`` one 128 times its size, a
``(n, 131)`` row matrix 256 lanes, a ``(n, 84, 84, 4)`` uint8 frame pads its 4 channels
to 128 lanes, and a gather of such rows is slow. So each leaf is held as 32-bit words
(``uint32``; bitcast on the way in and out, bit-exact), ``w`` words a row (bytes packed:
a uint8 leaf of 28,224 bytes is 7,056 words; a scalar narrower than a word, a bool or a
uint8, is zero-extended to one: 4 bytes for 1, fine for the few scalars of a record), and
laid out by ``w``:

- *lines* (``w <= 128``): ``w`` rounded up to a power of two ``v`` (a divisor of 128: 3 ->
  4, 5 -> 8, 100 -> 128; the waste is ``v - w`` words a row, none for the usual 1, 2, 4,
  ..., 64-word leaves), ``k = 128 // v`` rows a 128-lane line: ``(ceil(n / k), 128)``.
  A draw gathers row ``s``'s line ``s // k`` and picks its part ``s % k``;
- *wide* (``w > 128``): ``(n, w)``, one row a line (the device's tiling pads ``w`` to a
  multiple of 128);
- *tiles* (``w > 128`` whose ``ceil(w / 128)`` lines round up to a multiple of 8 for at
  most :data:`TILE_WASTE` more): ``(n, lines, 128)``, a row whole ``(8, 128)`` tiles, one
  contiguous span of HBM on a TPU, which a DMA copies in one go (``device/row_dma.py``): an
  84x84x4 uint8 frame's 7,056 words take 56 lines, 7,168 words (1.6%, as in *wide*);

and the leaves of one layout and width share a buffer ``(leaves, lines, lanes)`` (*tiles*:
``(leaves, n, lines, 128)``): a draw is one gather per buffer (a transition's two 64-float
observations one, its four scalars another). A leaf of a dtype that does not pack into
words (complex), or with no elements, keeps its own ``(n, *shape)`` buffer ("as-is").

Rows are written two ways: :meth:`RowLayout.scatter`, one scatter a buffer whose windows
are the rows' lane spans (``(line, part * v)``, ``v`` lanes; no reshape of the buffer, so
no relayout copy: the ring's refresh), and :meth:`RowLayout.write_rows`, a block of
consecutive rows from a row that starts a line (one ``dynamic_update_slice`` a buffer: the
resident store's chunked load).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grain_replay.device import row_dma

__all__ = [
    "LANES",
    "ROW_ALIGN",
    "TILE_WASTE",
    "WORD",
    "Probe",
    "apart",
    "RowLayout",
    "from_words",
    "packable",
    "to_words",
    "tiled_bytes",
    "words",
]

LANES = 128
WORD = 4  # bytes
SUBLANES = 8  # the second-minor tile of 32-bit words on a TPU
TILE_WASTE = 0.02  # rows become whole tiles ("tiles") when that adds at most this
ROW_ALIGN = LANES  # write_rows starts on a multiple of this: a line's first row in every layout


def apart(keep: jax.Array, index: jax.Array, bound: int) -> jax.Array:
    """Traced: ``index`` (int32[n]) where ``keep``, else ``bound + i`` for entry ``i``: each
    skipped entry its own place past the end, so that a scatter with ``mode="drop"`` drops
    it and the indices stay distinct (``unique_indices=True``: no serialized writes)."""
    return jnp.where(keep, index, bound + jnp.arange(index.shape[0], dtype=jnp.int32))


def _part(rows: jax.Array, part: jax.Array) -> jax.Array:
    """Traced: ``rows[:, i, part[i]]`` of ``rows`` (L, B, k, lanes) words, as a masked sum
    over the parts (one word in each sum is not zero). Not ``take_along_axis``: on a TPU
    that gather wants the batch axis outermost, and the relayout of the gathered lines
    into it cost 13 us of chip time for three one-word leaves of 256 rows (a TPU v5e's
    profile of the prioritized conv step), the masked sum well under 1 us."""
    k = rows.shape[2]
    hit = jnp.arange(k, dtype=jnp.int32)[None, None, :, None] == part[None, :, None, None]
    return jnp.sum(jnp.where(hit, rows, 0), axis=2, dtype=rows.dtype)


def packable(dtype: Any) -> bool:
    """Whether a leaf of ``dtype`` packs into 32-bit words (bool, ints, floats of 1, 2, 4
    or 8 bytes, bfloat16 and the other ml_dtypes floats included)."""
    d = np.dtype(dtype)
    kind_ok = d == np.bool_ or d.kind in "iu" or jnp.issubdtype(d, jnp.floating)
    return bool(kind_ok and d.itemsize in (1, 2, 4, 8))


def words(shape: tuple[int, ...], dtype: Any) -> int | None:
    """32-bit words a row of a leaf of ``shape`` and ``dtype`` takes, or None: the dtype
    does not pack into words, or the leaf has no elements (held as it is)."""
    size = int(np.prod(shape, dtype=np.int64))
    if not packable(dtype) or size == 0:
        return None
    return math.ceil(size * np.dtype(dtype).itemsize / WORD)


def tiled_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes an array takes on a TPU, its two minor dimensions padded to ``(8, 128)`` tiles
    of 32-bit words (sub-word dtypes: ``8 * 4 / itemsize`` rows a tile); an upper bound on
    other backends, whose arrays are not padded."""
    d = np.dtype(dtype)
    if len(shape) == 0:
        return d.itemsize
    dims = list(shape)
    dims[-1] = -(-dims[-1] // LANES) * LANES
    if len(dims) >= 2:
        sub = SUBLANES * max(1, WORD // d.itemsize)
        dims[-2] = -(-dims[-2] // sub) * sub
    return int(np.prod(dims, dtype=np.int64)) * d.itemsize


def tile_lines(w: int) -> int | None:
    """128-lane lines a row of ``w`` words takes as whole ``(8, 128)`` tiles, or None: the
    rounding to tiles would add more than :data:`TILE_WASTE` to its lines."""
    lines = -(-w // LANES)
    tiled = -(-lines // SUBLANES) * SUBLANES
    return tiled if w > LANES and tiled - lines <= TILE_WASTE * lines else None


def _uint(itemsize: int) -> Any:
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[itemsize]


def _channels_in_a_word(shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether the leaf's last axis is one word (a uint8 frame's 4 channels): its words are
    then the leaf less that axis, and one bitcast makes the leaf, with no flat byte axis (a
    TPU lays such arrays out batch-minor: the unpack of a batch of 256 frames through a
    flat uint8 axis cost 2.4 ms, this one the latency floor; ``benchmarks/probe_link.py``)."""
    return itemsize < WORD and len(shape) > 1 and shape[-1] * itemsize == WORD


def to_words(x: jax.Array, w: int) -> jax.Array:
    """Traced: ``x`` (K, ...) as uint32 words (K, w) (bit-exact; zero padded)."""
    k = x.shape[0]
    shape = tuple(x.shape[1:])
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    it = x.dtype.itemsize
    if _channels_in_a_word(shape, it):
        u = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(k, -1)
        return jnp.pad(u, ((0, 0), (0, w - u.shape[1])))
    x = x.reshape(k, -1)
    if it < WORD and x.shape[1] == 1:  # a scalar byte or half: zero-extended, no relayout
        u = jax.lax.bitcast_convert_type(x, _uint(it)).astype(jnp.uint32)
    elif it == 8:
        u = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(k, -1)
    elif it == WORD:
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        per = WORD // it
        b = jax.lax.bitcast_convert_type(x, _uint(it))
        b = jnp.pad(b, ((0, 0), (0, -b.shape[1] % per)))
        u = jax.lax.bitcast_convert_type(b.reshape(k, -1, per), jnp.uint32)
    return jnp.pad(u, ((0, 0), (0, w - u.shape[1])))


def from_words(u: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Traced: :func:`to_words` undone: uint32 words (B, >= w) as (B, *shape) of ``dtype``.

    Also reads a packed transfer's rows: a leaf's bytes from the first lane on, in order,
    whatever the lanes after them hold."""
    b = u.shape[0]
    d = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64))
    it = d.itemsize
    target = np.dtype(np.uint8) if d == np.bool_ else d
    if _channels_in_a_word(shape, it):
        n = size // shape[-1]
        x = jax.lax.bitcast_convert_type(u[:, :n].reshape(b, *shape[:-1]), target)
        return x != 0 if d == np.bool_ else x
    if it < WORD and size == 1:
        x = u[:, :1].astype(_uint(it))
        x = x != 0 if d == np.bool_ else jax.lax.bitcast_convert_type(x, d)
    elif it == 8:
        x = jax.lax.bitcast_convert_type(u[:, : 2 * size].reshape(b, size, 2), d)
    elif it == WORD:
        x = jax.lax.bitcast_convert_type(u[:, :size], d)
    else:
        per = WORD // it
        n = -(-size // per)
        x = jax.lax.bitcast_convert_type(u[:, :n], _uint(it)).reshape(b, n * per)[:, :size]
        x = x != 0 if d == np.bool_ else jax.lax.bitcast_convert_type(x, d)
    return x.reshape(b, *shape)


class Probe:
    """A source's leaves (structure, shapes, device dtypes, bytes), from its first record."""

    def __init__(self, source: Any) -> None:
        first = source.read_batch(np.arange(1))
        leaves, self.treedef = jax.tree_util.tree_flatten(first)
        self.shapes = [tuple(np.shape(a))[1:] for a in leaves]
        # The dtype jax gives the leaf on the device (float64 -> float32 without x64),
        # as the host pipeline's transfer does.
        self.dtypes = [np.dtype(jax.dtypes.canonicalize_dtype(np.asarray(a).dtype)) for a in leaves]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.record_bytes = sum(
            n * d.itemsize for n, d in zip(self.sizes, self.dtypes, strict=True)
        )


class RowLayout:
    """Where each leaf of a probe lives in the buffers, and how to gather or write rows.

    Args:
      probe: the store's leaves (shapes, device dtypes, structure).
      capacity: rows the buffers hold (a ring's slots, a resident store's records).

    Attributes:
      groups: per buffer, ``(kind, lanes, members)``: ``kind`` "lines", "wide", "tiles"
        or "as-is"; ``lanes`` the lanes a row takes (``v``; ``w`` when wide; its lines
        times 128 as tiles); ``members`` the leaf indices it holds (in leaf order).
      shapes, dtypes: each buffer's shape and dtype.
    """

    def __init__(self, probe: Probe, capacity: int) -> None:
        self.probe = probe
        self.capacity = capacity
        self.widths = [words(s, d) for s, d in zip(probe.shapes, probe.dtypes, strict=True)]
        keys: dict[tuple[str, int], int] = {}
        self.groups: list[tuple[str, int, list[int]]] = []
        for i, w in enumerate(self.widths):
            if w is None:
                self.groups.append(("as-is", 0, [i]))
                continue
            if w <= LANES:
                key = ("lines", 1 << (w - 1).bit_length())
            else:
                t = tile_lines(w)
                key = ("wide", w) if t is None else ("tiles", t * LANES)
            if key not in keys:
                keys[key] = len(self.groups)
                self.groups.append((key[0], key[1], []))
            self.groups[keys[key]][2].append(i)
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[np.dtype[Any]] = []
        for kind, lanes, members in self.groups:
            if kind == "as-is":
                i = members[0]
                self.shapes.append((capacity, *probe.shapes[i]))
                self.dtypes.append(np.dtype(probe.dtypes[i]))
            elif kind == "lines":
                lines = math.ceil(capacity / (LANES // lanes))
                self.shapes.append((len(members), lines, LANES))
                self.dtypes.append(np.dtype(np.uint32))
            elif kind == "tiles":
                self.shapes.append((len(members), capacity, lanes // LANES, LANES))
                self.dtypes.append(np.dtype(np.uint32))
            else:
                self.shapes.append((len(members), capacity, lanes))
                self.dtypes.append(np.dtype(np.uint32))

    def nbytes(self) -> int:
        """Bytes of the row buffers (as allocated, before any device tiling)."""
        return sum(
            int(np.prod(s, dtype=np.int64)) * d.itemsize
            for s, d in zip(self.shapes, self.dtypes, strict=True)
        )

    def device_bytes(self) -> int:
        """Bytes of the row buffers on a TPU, tiles included (:func:`tiled_bytes`: lines
        pad to 8 a buffer, wide rows to a multiple of 128 lanes); an upper bound elsewhere."""
        return sum(tiled_bytes(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True))

    def row_bytes(self) -> int:
        """Bytes of one record's leaves as the buffers hold them (lanes included)."""
        total = 0
        for (kind, lanes, members), dtype in zip(self.groups, self.dtypes, strict=True):
            if kind == "as-is":
                total += (
                    int(np.prod(self.probe.shapes[members[0]], dtype=np.int64)) * dtype.itemsize
                )
            else:
                total += len(members) * lanes * WORD
        return total

    def allocate(self) -> list[jax.Array]:
        """Traced: zero buffers."""
        return [jnp.zeros(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True)]

    @property
    def has_tiles(self) -> bool:
        """Whether a buffer holds rows as whole tiles (which :meth:`gather` may copy by DMA)."""
        return any(kind == "tiles" for kind, _, _ in self.groups)

    def gather(self, bufs: Any, slots: jax.Array, *, dma: bool = False) -> list[jax.Array]:
        """Traced: the leaves (in leaf order, device dtypes) of rows ``slots`` (int32, in
        ``[0, capacity)``). ``dma``: rows held as tiles are copied by DMA
        (``device/row_dma.py``; TPU only), not by XLA's gather."""
        b = slots.shape[0]
        leaves: list[Any] = [None] * len(self.widths)
        for (kind, lanes, members), buf in zip(self.groups, bufs, strict=True):
            if kind == "as-is":
                leaves[members[0]] = jnp.take(buf, slots, axis=0, mode="clip")
                continue
            k = LANES // lanes if kind == "lines" else 1
            if kind == "tiles":
                rows = (
                    row_dma.gather_rows(buf, slots)
                    if dma
                    else jnp.take(buf, slots, axis=1, mode="clip")
                ).reshape(len(members), b, lanes)
            else:
                rows = jnp.take(buf, slots // k if k > 1 else slots, axis=1, mode="clip")
            if k > 1:  # (L, B, 128) lines -> (L, B, lanes): part s % k of each
                rows = _part(rows.reshape(len(members), b, k, lanes), slots % k)
            for j, i in enumerate(members):
                leaves[i] = from_words(rows[j], self.probe.shapes[i], self.probe.dtypes[i])
        return leaves

    def scatter(self, bufs: Any, leaves: list[jax.Array], targets: jax.Array) -> list[jax.Array]:
        """Traced: ``bufs`` with rows ``targets`` (int32, distinct; ``capacity``: dropped)
        set to ``leaves`` (one per leaf, leading axis ``len(targets)``)."""
        n = targets.shape[0]
        keep = targets < self.capacity
        out = []
        for (kind, lanes, members), buf in zip(self.groups, bufs, strict=True):
            if kind == "as-is":
                x = leaves[members[0]].astype(buf.dtype)
                out.append(buf.at[jnp.where(keep, targets, buf.shape[0])].set(x, mode="drop"))
                continue
            k = LANES // lanes if kind == "lines" else 1
            rows = jnp.stack([to_words(leaves[i], lanes) for i in members])  # (L, n, lanes)
            if kind == "tiles":  # whole rows: row t of every leaf set, out of bounds dropped
                rows = rows.reshape(len(members), n, lanes // LANES, LANES)
                at = apart(keep, targets, buf.shape[1])
                out.append(buf.at[:, at].set(rows, mode="drop", unique_indices=True))
                continue
            line = apart(keep, targets // k, buf.shape[1])
            start = (targets % k) * lanes
            out.append(
                jax.lax.scatter(
                    buf,
                    jnp.stack([line, start], axis=1),
                    rows,
                    jax.lax.ScatterDimensionNumbers(
                        update_window_dims=(0, 2),
                        inserted_window_dims=(1,),
                        scatter_dims_to_operand_dims=(1, 2),
                    ),
                    indices_are_sorted=False,
                    unique_indices=True,
                    mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
                )
            )
        return out

    def write_rows(self, bufs: Any, leaves: list[jax.Array], lo: Any) -> list[jax.Array]:
        """Traced: ``bufs`` with rows ``[lo, lo + K)`` set to ``leaves`` (one per leaf,
        leading axis ``K``), one ``dynamic_update_slice`` a buffer.

        ``lo`` (static or traced) is a multiple of :data:`ROW_ALIGN`, so that it starts a
        line in every layout, and ``lo + K <= capacity``; the words of a last, partial line
        are zero.
        """
        n = leaves[0].shape[0]
        out = []
        for (kind, lanes, members), buf in zip(self.groups, bufs, strict=True):
            if kind == "as-is":
                x = leaves[members[0]].astype(buf.dtype)
                out.append(jax.lax.dynamic_update_slice_in_dim(buf, x, lo, axis=0))
                continue
            rows = jnp.stack([to_words(leaves[i], lanes) for i in members])  # (L, K, lanes)
            if kind == "tiles":
                rows = rows.reshape(len(members), n, lanes // LANES, LANES)
                out.append(jax.lax.dynamic_update_slice(buf, rows, (0, lo, 0, 0)))
                continue
            k = LANES // lanes if kind == "lines" else 1
            if k > 1:  # K rows -> ceil(K / k) whole lines
                rows = jnp.pad(rows, ((0, 0), (0, -n % k), (0, 0)))
                rows = rows.reshape(len(members), -1, LANES)
            start = lo // k if k > 1 else lo
            out.append(jax.lax.dynamic_update_slice(buf, rows, (0, start, 0)))
        return out
