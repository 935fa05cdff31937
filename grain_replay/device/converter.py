"""Host batches validated against a sharding and built into sharded ``jax.Array``s."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from grain_replay.device import packed as packing
from grain_replay.device.packed import PackedLayout, laid_out, plan
from grain_replay.errors import BatchShardingError, InvalidShardingError
from grain_replay.pipeline.lanes import LaneField

__all__ = ["Converter", "default_sharding", "mesh_sharding"]


def _is_sharding(x: Any) -> bool:
    return isinstance(x, (Sharding, Mesh))


def default_sharding() -> NamedSharding:
    """``sharding=None``: a 1-D mesh named ``"data"`` over ``jax.devices()``."""
    return NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))


def mesh_sharding(mesh: Mesh) -> NamedSharding:
    """A ``Mesh`` given as the sharding: its first axis shards the batch axis."""
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))


def _to_sharding(x: Sharding | Mesh) -> Sharding:
    return mesh_sharding(x) if isinstance(x, Mesh) else x


class Converter:
    """Validates a host batch and builds the sharded arrays; holds no reference to the wrapper."""

    def __init__(
        self, sharding: Any, pinned: bool = False, packed: bool = False, packed_auto: bool = False
    ) -> None:
        self._pinned = pinned  # the caller checked that the backend has pinned host memory
        self._packed = packed and not pinned
        self._packed_auto = packed_auto  # packed by default, not asked for: may drop it
        self._layouts: dict[Any, PackedLayout | None] = {}
        if sharding is None:
            sharding = default_sharding()
        self._single: Sharding | None = None
        self._tree: Any = None
        if _is_sharding(sharding):
            self._single = _to_sharding(sharding)
        else:
            paths = jax.tree_util.tree_leaves_with_path(sharding, is_leaf=_is_sharding)
            bad = [jax.tree_util.keystr(p) for p, s in paths if not _is_sharding(s)]
            if bad or not paths:
                raise InvalidShardingError(
                    "Expected sharding=None, a jax.sharding.Mesh, a jax.sharding.Sharding or a "
                    f"pytree of them. Got {type(sharding).__name__} with non-sharding leaves at "
                    f"{bad or 'nowhere (no leaves)'} instead."
                )
            self._tree = jax.tree_util.tree_map(_to_sharding, sharding, is_leaf=_is_sharding)
        # one process, one device: a batch the loader laid out can be put as it lies
        self._one_device = (
            self._single is not None
            and len(self._single.device_set) == 1
            and jax.process_count() == 1
        )
        self._grouped = False  # transfers() decided several batches a transfer
        self._shard_counts: dict[tuple[Sharding, int], int | None] = {}
        self._tree_shardings: dict[Any, list[Sharding]] = {}

    def _leaf_shardings(self, batch: Any, treedef: Any, count: int) -> list[Sharding]:
        if self._single is not None:
            return [self._single] * count
        shardings = self._tree_shardings.get(treedef)
        if shardings is None:  # depends on the batch's structure only: worked out once
            try:
                full = jax.tree_util.tree_broadcast(self._tree, batch, is_leaf=_is_sharding)
            except (ValueError, TypeError) as e:
                raise BatchShardingError(
                    "The sharding pytree is not a prefix of the batch's structure. Give one "
                    f"sharding per leaf or per subtree of the batch. ({e})"
                ) from e
            shardings = list(jax.tree_util.tree_leaves(full, is_leaf=_is_sharding))
            self._tree_shardings[treedef] = shardings
        return shardings

    def _local_shards(self, sharding: Sharding, ndim: int) -> int | None:
        """Distinct slices of axis 0 this process holds; None if the sharding can't tell."""
        key = (sharding, ndim)
        if key not in self._shard_counts:
            n = len(sharding.device_set)
            try:  # every mesh-axis product divides the device count, so (n,)*ndim always splits
                index_map = sharding.addressable_devices_indices_map((n,) * ndim)
                starts = {idx[0].indices(n)[:2] for idx in index_map.values() if idx}
                self._shard_counts[key] = len(starts)
            except (ValueError, TypeError, NotImplementedError):  # exotic: jax checks
                self._shard_counts[key] = None
        return self._shard_counts[key]

    def _validated(self, batch: Any) -> tuple[Any, list[tuple[Any, Sharding]]]:
        """The batch's treedef and its (leaf, sharding) pairs, every leaf checked."""
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        shardings = self._leaf_shardings(batch, treedef, len(leaves))
        arrays = []
        for i, (leaf, sharding) in enumerate(zip(leaves, shardings, strict=True)):
            array = leaf if hasattr(leaf, "ndim") and hasattr(leaf, "shape") else np.asarray(leaf)
            if array.ndim == 0:
                raise BatchShardingError(
                    f"Leaf '{_leaf_name(batch, i)}' is a scalar (rank 0), so it has no leading "
                    "batch axis to shard. Give every leaf of the batch a leading batch axis."
                )
            devices = self._local_shards(sharding, array.ndim)
            size = array.shape[0]
            if devices is not None and size % devices:
                lower, upper = size // devices * devices, (size // devices + 1) * devices
                nearest = f"{lower} or {upper}" if lower else f"{upper}"
                raise BatchShardingError(
                    f"Leaf '{_leaf_name(batch, i)}' has a per-process batch size of {size}, "
                    f"which does not split evenly over the {devices} process-local devices its "
                    f"leading axis is sharded across. Use a per-process batch size that is a "
                    f"multiple of {devices}: {devices}, {2 * devices}, {3 * devices}, ...; "
                    f"nearest: {nearest}."
                )
            arrays.append((array, sharding))
        return treedef, arrays

    @property
    def packs(self) -> bool:
        """Whether batches go in packed transfers (after :meth:`transfers` decided it)."""
        return self._packed

    @property
    def lays_out(self) -> bool:
        """Whether batches laid out as a packed buffer by the loader (``lay_out_lanes``)
        are put as they lie: packed transfers, one sharding over one device."""
        return self._packed and self._one_device

    @property
    def asks_lanes(self) -> bool:
        """Whether the loader should lay batches out (``lay_out_lanes``): put as they lie
        (:attr:`lays_out`) and, after :meth:`transfers`, one batch a transfer. Batches
        that go several to a transfer are copied into one buffer anyway (the regions
        concatenated), so laying them out saves this process no copy and costs an
        in-process read more (``benchmarks/probe_feed_handover.py``: MLP transitions,
        batch 256, 7 a transfer, ``worker_count=0``, the fed path's main-thread CPU 181
        -> 145 us a batch unlaid on the 2-core CPU machine; ``worker_count=4`` even)."""
        return self.lays_out and not self._grouped

    def _layout(
        self,
        pairs: list[tuple[Any, Sharding]],
        treedefs: tuple[Any, ...],
        fields: tuple[LaneField, ...] | None = None,
    ) -> Any:
        if self._single is not None:  # one sharding: hashed once, not once per leaf
            leaves: tuple[Any, ...] = tuple((a.shape, getattr(a, "dtype", None)) for a, _ in pairs)
        else:
            leaves = tuple((a.shape, getattr(a, "dtype", None), s) for a, s in pairs)
        key = (treedefs, leaves, fields)
        layout = self._layouts.get(key, False)
        if layout is False:
            if len(self._layouts) >= 16:  # shapes that keep changing: no unbounded cache
                self._layouts.clear()
            layout = plan([a for a, _ in pairs], [s for _, s in pairs], fields)
            self._layouts[key] = layout
        return layout

    def transfers(self, batch: Any) -> tuple[int, int]:
        """How to move a stream of batches like this one, worked out from its first one:
        ``(batches per transfer, transfers in flight on their own threads)``.

        Packed batches smaller than :data:`grain_replay.device.packed.GROUP_BYTES` go
        several to one transfer (at most ``MAX_GROUP``). Batches of
        :data:`grain_replay.device.packed.PARALLEL_BYTES` or more go one per transfer,
        ``PUT_THREADS`` at once: a put holds its thread while the host lays the batch out.
        With ``packed`` left to its default (``None``, on TPU), a batch that would go
        alone in its packed transfer is put leaf by leaf instead, unless the loader laid it
        out already. Measured on a TPU v5e (``benchmarks/bench_feed.py``, three runs): fed
        by ``make_data_loader(worker_count=4)``, frame batches put leaf by leaf reached
        0.45-0.46x of the link, laid out by the loader and put as one buffer 0.37-0.39x
        (the flat buffer alone moves fastest, 13.3 GB/s against 7.2, but laying it out
        costs the loader more): ``sharded_device_put`` decides at the first batch, before
        it asks the loader to lay batches out.
        """
        treedef, pairs = self._validated(batch)
        nbytes = sum(int(getattr(a, "nbytes", 0)) for a, _ in pairs)
        if self._packed and self._layout(pairs, (treedef,)) is not None:
            group = max(1, min(packing.MAX_GROUP, packing.GROUP_BYTES // max(nbytes, 1)))
            laid = self.lays_out and laid_out([a for a, _ in pairs]) is not None
            if group > 1 or not self._packed_auto or laid:
                self._grouped = group > 1
                return group, packing.PUT_THREADS if nbytes >= packing.PARALLEL_BYTES else 1
            self._packed = False  # auto: one batch a transfer pays only leaf by leaf
        return 1, packing.PUT_THREADS if nbytes >= packing.PARALLEL_BYTES else 1

    def __call__(self, batch: Any) -> Any:
        return self.convert_group([batch])[0]

    def convert_group(self, batches: list[Any]) -> list[Any]:
        """The sharded arrays of each batch; packed batches go in one transfer together.
        Every leaf of every batch is validated before the first transfer."""
        checked = [self._validated(b) for b in batches]
        if self._packed:
            pairs = [p for _, ps in checked for p in ps]
            treedefs = tuple(t for t, _ in checked)
            flat = self._put_laid_out(checked, pairs, treedefs) if self.lays_out else None
            if flat is None:
                layout = self._layout(pairs, treedefs)
                flat = layout.put([a for a, _ in pairs]) if layout is not None else None
            if flat is not None:
                out, at = [], 0
                for treedef, ps in checked:
                    out.append(jax.tree_util.tree_unflatten(treedef, flat[at : at + len(ps)]))
                    at += len(ps)
                return out
        return [self._put(treedef, arrays) for treedef, arrays in checked]

    def _put_laid_out(
        self, checked: list[tuple[Any, Any]], pairs: list[Any], treedefs: tuple[Any, ...]
    ) -> list[Any] | None:
        """The leaves, if every batch lies in a buffer of its own as a packed transfer's
        (the loader laid it out): their buffers put one after the other, no per-leaf copy."""
        regions: list[np.ndarray] = []
        fields: list[LaneField] = []
        row = 0
        for _, ps in checked:
            found = laid_out([a for a, _ in ps])
            if found is None:
                return None
            region, own = found
            regions.append(region)
            fields.extend(LaneField(f.row + row, f.rows, f.per_element) if row else f for f in own)
            row += region.shape[0]
        layout = self._layout(pairs, treedefs, tuple(fields))
        return None if layout is None else layout.put_regions(regions)

    def _put(self, treedef: Any, arrays: list[tuple[Any, Sharding]]) -> Any:
        if self._pinned:
            arrays = [(self._stage(a, s), s) for a, s in arrays]
        if jax.process_count() > 1:
            out = [jax.make_array_from_process_local_data(s, a) for a, s in arrays]
        else:
            # One process: the local batch is the global one. For numpy leaves,
            # make_array_from_callback goes straight to jax's batched per-device
            # put: a quarter less Python per batch than jax.device_put (measured,
            # 5 leaves over 8 devices: 295 vs 388 us), same arrays.
            out = [
                jax.make_array_from_callback(a.shape, s, a.__getitem__)
                if isinstance(a, np.ndarray)
                else jax.device_put(a, s)
                for a, s in arrays
            ]
        return jax.tree_util.tree_unflatten(treedef, out)

    @staticmethod
    def _stage(array: Any, sharding: Sharding) -> Any:
        """``array`` copied into pinned host memory, from where the device copy is a plain DMA."""
        if not isinstance(array, np.ndarray):
            return array
        pinned = sharding.with_memory_kind("pinned_host")
        if jax.process_count() > 1:
            return jax.make_array_from_process_local_data(pinned, array)
        return jax.make_array_from_callback(array.shape, pinned, array.__getitem__)


def _leaf_name(batch: Any, i: int) -> str:
    """``"obs/pixels"`` for leaf ``i`` of ``batch``: built for error messages only."""
    path, _ = jax.tree_util.tree_flatten_with_path(batch)[0][i]
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"
