"""Packed transfers: a host batch's leaves in one lane-aligned buffer per device, unpacked on it.

Why (measured on a TPU v5e, ``benchmarks/probe_link.py``): a put of each numpy leaf
makes the host lay the leaf out in the chip's tiles first, and a small or narrow leaf
pays a fixed ~0.5 ms a put. A ``uint8[256, 84, 84, 4]`` batch of frames is stored
batch-minor on the chip (tiles of ``(4, 128)`` over ``(84, 84, 4, 256)``): one plain
put ran at 1.7 GB/s, four in flight 7.2 GB/s. The same bytes as one ``(rows, 128)``
buffer, four in flight, went at 13.3 GB/s, and a batch of transitions (5 leaves,
134 KB) at 5,000 batches/s instead of 1,400. The relayout then runs on the chip, in
one jitted program per batch layout, at HBM speed.

The layout, per device: every leaf's rows of that device, each leaf starting on a row of
128 ``uint32`` lanes (512 bytes). A leaf whose element (one batch row) is 4 KiB or more
gives every element its own whole rows, so that the chip's relayout splits a row axis
instead of a flat one (a flat ``uint8`` frame batch unpacked at 2.4 ms, per-element
rows at the latency floor); smaller elements are packed densely. Values, dtypes, shapes
and shardings are those of the plain put: a leaf whose dtype jax would narrow
(``int64`` without ``jax_enable_x64``) is cast on the host first, as jax casts it.

A batch on one device whose leaves the loader already laid out so (``lay_out_lanes()``,
``pipeline/lanes.py``: the same rule) is put as the buffer it lies in (:func:`laid_out`).

Applies to one process, numpy leaves of 1, 2, 4 or 8 byte dtypes, and one sharding for
every leaf that splits the batch axis over all its devices without replicas
(``SingleDeviceSharding``, or a ``NamedSharding`` whose spec shards only axis 0, over
every mesh axis). :func:`plan` says None otherwise, and the caller puts leaf by leaf.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from grain_replay.device.lines import LANES, WORD, from_words, packable
from grain_replay.pipeline.lanes import ROW_BYTES, LaneField, leaf_rows, owner_of

__all__ = [
    "GROUP_BYTES",
    "MAX_GROUP",
    "PARALLEL_BYTES",
    "PUT_THREADS",
    "PackedLayout",
    "laid_out",
    "plan",
]

assert ROW_BYTES == LANES * WORD  # pipeline/lanes.py lays host batches out in these rows
# Small batches go several to a transfer: each put and each unpack program costs the host
# ~0.2 ms on a TPU v5e whatever its size (a 134 KB batch of transitions), as much as the
# MLP step's own dispatch. Batches are grouped up to this many bytes, at most MAX_GROUP.
GROUP_BYTES = 1 << 20
MAX_GROUP = 16
# Batches this large may be moved PUT_THREADS at a time, each on its own thread: a put
# holds its thread while the host lays the batch out (frame batches put back to back:
# 1 in flight 238 batches/s, 4 in flight 1,039/s on a TPU v5e). Off (1) by default: fed
# by the loader, 4 put threads did not beat one (0.36x vs 0.40x of the link, worker_count
# 4, benchmarks/bench_feed.py): the host's Python, not the put, bounds that stream.
PARALLEL_BYTES = 1 << 20
PUT_THREADS = 1


@dataclasses.dataclass(frozen=True)
class _Leaf:
    dtype: np.dtype[Any]  # the dtype on the device (jax's canonical one)
    shape: tuple[int, ...]  # the per-device shape
    row: int  # first row in the per-device buffer
    rows: int  # rows it spans
    per_element: int  # rows of each element, 0 for a densely packed leaf
    cast: bool  # the host leaf's dtype differs: cast on the host first


def _canonical(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _devices_in_order(sharding: Sharding, shape: tuple[int, ...]) -> list[Any] | None:
    """The devices of ``sharding`` by the batch rows they hold, if each holds its own slice
    of axis 0 and all of the other axes; else None."""
    if isinstance(sharding, SingleDeviceSharding):
        return list(sharding.device_set)
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    if not spec or spec[0] is None or any(s is not None for s in spec[1:]):
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    mesh = sharding.mesh
    if math.prod(mesh.shape[a] for a in axes) != mesh.size:
        return None  # replicated over some mesh axis: one buffer would go to several devices
    index = sharding.addressable_devices_indices_map(shape)
    if len(index) != mesh.size:
        return None
    starts = {}
    for device, idx in index.items():
        starts[device] = idx[0].indices(shape[0])[0] if idx else 0
    return sorted(starts, key=starts.__getitem__)


@dataclasses.dataclass
class PackedLayout:
    """The per-device buffer of one batch layout, how to fill it and how to unpack it."""

    sharding: Sharding
    devices: list[Any]
    leaves: list[_Leaf]
    rows: int  # rows of each device's buffer
    unpack: Callable[[Any], Any]
    buffer_sharding: Sharding
    exact: bool | None = None  # whether the unpacked leaves carry ``sharding`` itself

    def put_regions(self, regions: Sequence[np.ndarray]) -> list[jax.Array]:
        """The leaves on the device (one) from buffers already laid out (:func:`laid_out`),
        one after the other: one put, no copy for one buffer; then one unpack program."""
        buf = regions[0] if len(regions) == 1 else np.concatenate(regions)
        return self._unpacked(jax.device_put(buf, self.buffer_sharding))

    def put(self, arrays: Sequence[np.ndarray]) -> list[jax.Array]:
        """The leaves on the devices: one buffer per device, then one unpack program."""
        d = len(self.devices)
        bufs: list[Any] = []  # numpy with one device, else jax.Arrays on their devices
        for k, device in enumerate(self.devices):
            buf = np.empty((self.rows, LANES), np.uint32)
            flat = buf.reshape(-1).view(np.uint8)
            for leaf, array in zip(self.leaves, arrays, strict=True):
                n = array.shape[0] // d
                part = array[k * n : (k + 1) * n]
                if leaf.cast:
                    part = part.astype(leaf.dtype)
                start = leaf.row * ROW_BYTES
                if leaf.per_element:
                    stride = leaf.per_element * ROW_BYTES
                    rows = flat[start : start + n * stride].reshape(n, stride)
                    element = part.dtype.itemsize * math.prod(part.shape[1:])
                    rows[:, :element] = np.ascontiguousarray(part).reshape(n, -1).view(np.uint8)
                else:
                    data = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
                    flat[start : start + data.size] = data
            bufs.append(jax.device_put(buf, device) if d > 1 else buf)
        if d == 1:
            packed = jax.device_put(bufs[0], self.buffer_sharding)
        else:
            packed = jax.make_array_from_single_device_arrays(
                (d * self.rows, LANES), self.buffer_sharding, bufs
            )
        return self._unpacked(packed)

    def _unpacked(self, packed: jax.Array) -> list[jax.Array]:
        out = list(self.unpack(packed))
        if self.exact is None:
            self.exact = all(o.sharding == self.sharding for o in out)
        if not self.exact:
            # an equivalent sharding written another way (P("data") vs P("data", None)):
            # device_put between equivalent shardings rewraps the same buffers
            out = [jax.device_put(o, self.sharding) for o in out]
        return out


_CANONICAL: dict[np.dtype[Any], bool] = {}  # dtype -> jax keeps it (no cast on the host)


def _kept(dtype: np.dtype[Any]) -> bool:
    kept = _CANONICAL.get(dtype)
    if kept is None:
        kept = _CANONICAL[dtype] = _canonical(dtype) == dtype
    return kept


def laid_out(arrays: Sequence[Any]) -> tuple[np.ndarray, list[LaneField]] | None:
    """Where a batch's leaves (one device) already lie as a packed buffer: ``(region,
    fields)``, the ``uint32[rows, 128]`` region of the buffer they view and each leaf's
    rows in it; None if they do not.

    A loader asked to ``lay_out_lanes()`` hands out such batches: each leaf a view of one
    :class:`grain_replay.pipeline.lanes.LaneBuffer` that records it by its ``id``. A leaf
    replaced since (another object), or one of another buffer, and the batch is not laid
    out. A leaf changed in place is put as it now is: its bytes are the buffer's.
    """
    if not arrays or type(arrays[0]) is not np.ndarray:
        return None
    owner = owner_of(arrays[0])
    if owner is None:
        return None
    recorded = owner.lane_fields
    assert recorded is not None
    fields = []
    for a in arrays:
        field = recorded.get(id(a))
        if field is None or not _kept(a.dtype) or owner_of(a) is not owner:
            return None
        fields.append(field)
    region = owner[: owner.lane_rows * ROW_BYTES].view(np.uint32).reshape(-1, LANES)
    return region.view(np.ndarray), fields


def _unpack_leaf(x: Any, leaf: _Leaf) -> Any:
    """One leaf out of a device's ``uint32[rows, 128]`` buffer (``lines.from_words``: a
    uint8 frame's words become its pixels with one bitcast, no flat byte axis)."""
    slab = x[leaf.row : leaf.row + leaf.rows]
    n = leaf.shape[0]
    if leaf.per_element:
        return from_words(slab.reshape(n, leaf.per_element * LANES), leaf.shape[1:], leaf.dtype)
    count = math.prod(leaf.shape[1:])
    return from_words(slab.reshape(1, -1), (n * count,), leaf.dtype).reshape(leaf.shape)


def plan(
    arrays: Sequence[Any],
    shardings: Sequence[Sharding],
    fields: Sequence[LaneField] | None = None,
) -> PackedLayout | None:
    """The packed layout of a batch with these leaves and shardings, or None where it does
    not apply (then the caller puts leaf by leaf). ``fields``: where each leaf lies in a
    buffer the host already holds (:func:`laid_out`; one device), instead of one after
    the other."""
    if jax.process_count() != 1 or not arrays:
        return None
    if fields is not None and len(fields) != len(arrays):
        return None
    sharding = shardings[0]
    if any(s != sharding for s in shardings[1:]):
        return None
    if not all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in arrays):
        return None
    devices = _devices_in_order(sharding, arrays[0].shape)
    if devices is None:
        return None
    d = len(devices)
    if fields is not None and d != 1:
        return None
    leaves: list[_Leaf] = []
    row = 0
    for a in arrays:
        dtype = _canonical(a.dtype)
        if a.dtype.kind not in "biuf" or not packable(dtype) or a.shape[0] % d:
            return None
        if _devices_in_order(sharding, a.shape) != devices:
            return None
        n = a.shape[0] // d
        if fields is None:
            rows, per_element = leaf_rows(n, dtype.itemsize * math.prod(a.shape[1:]))
            start = row
        else:  # where the batch already lies (laid_out): d == 1
            start, rows, per_element = fields[len(leaves)]
        leaves.append(_Leaf(dtype, (n, *a.shape[1:]), start, rows, per_element, dtype != a.dtype))
        row = max(row, start + rows)
    row = max(row, 1)

    def local(x: Any) -> tuple[Any, ...]:
        return tuple(_unpack_leaf(x, leaf) for leaf in leaves)

    if d == 1:
        buffer_sharding: Sharding = SingleDeviceSharding(devices[0])
        unpack = jax.jit(local, out_shardings=tuple(sharding for _ in leaves))
    else:
        assert isinstance(sharding, NamedSharding)
        spec = PartitionSpec(sharding.spec[0])
        buffer_sharding = NamedSharding(sharding.mesh, spec)
        unpack = jax.jit(
            jax.shard_map(
                local,
                mesh=sharding.mesh,
                in_specs=spec,
                out_specs=tuple(PartitionSpec(sharding.spec[0]) for _ in leaves),
            )
        )
    return PackedLayout(sharding, devices, leaves, row, unpack, buffer_sharding)
