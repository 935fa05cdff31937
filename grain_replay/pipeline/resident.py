"""Device-resident replay: the store loaded once onto the devices, batches gathered there.

``sharded_device_put(loader, resident=True)`` hands out the batches of ``loader``
(same permutation, epochs, process shards and checkpoint bytes) without reading
the store again: every device holds a replica of the store's rows, and each
device gathers its own slice of every batch from its replica, so a batch costs
no host read, no host-to-device copy and no communication between devices.
Batches are gathered a window at a time (one dispatch for up to
``_MAX_WINDOW`` batches) because on small batches the cost of a dispatch, not
the gather, is what limits the rate.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterator
from typing import Any, Literal, Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grain_replay.errors import (
    BatchShardingError,
    InvalidArgumentError,
    ResidentBudgetError,
    ResidentUnsupportedError,
)
from grain_replay.pipeline.converter import default_sharding, mesh_sharding
from grain_replay.pipeline.loader import BatchedReads, LoaderPlan
from grain_replay.pipeline.state import handed_out_from_state, loader_state_bytes

__all__ = ["ResidentReplayIterator", "resident_device_put"]

logger = logging.getLogger(__name__)

_MAX_WINDOW = 64  # batches gathered by one dispatch
_WINDOW_BYTES = 64 << 20  # ...and at most this many bytes of them per device
_CHUNK_BYTES = 64 << 20  # host rows read (and copied to the devices) per loading step
_DEFAULT_BUDGET_FRACTION = 0.5  # of the free memory a device reports, when no budget is given


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _batch_sharding(sharding: Any) -> NamedSharding:
    """The sharding ``sharded_device_put`` gives every leaf, as a NamedSharding."""
    if sharding is None:
        return default_sharding()
    if isinstance(sharding, Mesh):
        return mesh_sharding(sharding)
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))
    raise ResidentUnsupportedError(
        "Device-resident replay takes sharding=None, a jax.sharding.Mesh or a "
        f"jax.sharding.NamedSharding. Got {type(sharding).__name__} instead. Fix: pass a "
        "NamedSharding that shards the batch axis, or use resident=False for per-leaf shardings."
    )


def _slices(sharding: NamedSharding) -> tuple[int, int]:
    """(distinct slices of the batch axis over all devices, held by this process's devices)."""
    n = sharding.mesh.size
    every = sharding.devices_indices_map((n,)).values()
    local = sharding.addressable_devices_indices_map((n,)).values()
    return len({i[0].indices(n)[:2] for i in every if i}), len(
        {i[0].indices(n)[:2] for i in local if i}
    )


def _check_split(size: int, local_slices: int) -> None:
    if size % local_slices:
        lower = size // local_slices * local_slices
        upper = lower + local_slices
        nearest = f"{lower} or {upper}" if lower else f"{upper}"
        raise BatchShardingError(
            f"A batch of {size} records per process does not split evenly over the "
            f"{local_slices} process-local devices its leading axis is sharded across. Use a "
            f"per-process batch size that is a multiple of {local_slices}: {local_slices}, "
            f"{2 * local_slices}, ...; nearest: {nearest}."
        )


def _default_budget() -> tuple[int, str]:
    """Bytes per device when no budget is given, and how they were worked out."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        share = int(free * _DEFAULT_BUDGET_FRACTION)
        return share, f"half of the {_fmt_bytes(free)} free on {device}"
    # The CPU backend reports no limit: its devices share the host's memory.
    available = _host_available_bytes()
    count = jax.local_device_count()
    share = int(available * _DEFAULT_BUDGET_FRACTION) // count
    why = f"half of the {_fmt_bytes(available)} of available host memory over {count} devices"
    return share, why


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _Probe:
    """A source's leaves (structure, device dtypes, bytes) from its first record; their packing."""

    def __init__(self, source: Any) -> None:
        first = source.read_batch(np.arange(1))
        leaves, self.treedef = jax.tree_util.tree_flatten(first)
        self.shapes = [tuple(np.shape(a))[1:] for a in leaves]
        # The dtype jax gives the leaf on the device (float64 -> float32 without x64),
        # as the host pipeline's transfer does.
        self.dtypes = [jax.dtypes.canonicalize_dtype(np.asarray(a).dtype) for a in leaves]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.record_bytes = sum(
            n * np.dtype(d).itemsize for n, d in zip(self.sizes, self.dtypes, strict=True)
        )
        # The store is held as one row matrix per group of leaves: leaves whose dtype
        # can be bitcast to an unsigned int share the group of that width (a transition's
        # float32 and int32 leaves become one uint32 row), so a batch is one gather per
        # group rather than one per leaf (on XLA:CPU, 3-4x less time per batch).
        # A leaf alone in its group, or of another dtype (complex), is held as it is.
        self.groups: list[list[int]] = []
        self.group_dtypes: list[np.dtype[Any]] = []
        by_width: dict[int, int] = {}
        for i, d in enumerate(self.dtypes):
            d = np.dtype(d)
            packable = d == np.bool_ or d.kind in "iuf" or jnp.issubdtype(d, jnp.floating)
            if packable and d.itemsize in (1, 2, 4, 8):
                g = by_width.get(d.itemsize)
                if g is None:
                    g = by_width[d.itemsize] = len(self.groups)
                    self.groups.append([])
                    self.group_dtypes.append(np.dtype(f"uint{8 * d.itemsize}"))
                self.groups[g].append(i)
            else:
                self.groups.append([i])
                self.group_dtypes.append(d)
        for g, members in enumerate(self.groups):  # a leaf alone is held as it is
            if len(members) == 1:
                self.group_dtypes[g] = np.dtype(self.dtypes[members[0]])

    def group_shapes(self, n: int) -> list[tuple[int, ...]]:
        """Shape of each group's row matrix for ``n`` records."""
        out: list[tuple[int, ...]] = []
        for members in self.groups:
            if len(members) == 1:
                out.append((n, *self.shapes[members[0]]))
            else:
                out.append((n, sum(self.sizes[i] for i in members)))
        return out

    def pack(self, leaves: list[jax.Array]) -> list[jax.Array]:
        """Traced: the leaves of a chunk of rows as the groups' row matrices (bit-exact)."""
        out = []
        for members, dtype in zip(self.groups, self.group_dtypes, strict=True):
            if len(members) == 1:
                out.append(leaves[members[0]])
                continue
            cols = []
            for i in members:
                x = leaves[i].reshape(leaves[i].shape[0], -1)
                x = (
                    x.astype(dtype)
                    if x.dtype == jnp.bool_
                    else jax.lax.bitcast_convert_type(x, dtype)
                )
                cols.append(x)
            out.append(cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1))
        return out

    def unpack(self, rows: list[jax.Array]) -> list[jax.Array]:
        """Traced: the leaves of gathered group rows, in leaf order."""
        leaves: list[Any] = [None] * len(self.dtypes)
        for members, r in zip(self.groups, rows, strict=True):
            if len(members) == 1:
                leaves[members[0]] = r
                continue
            offset = 0
            for i in members:
                x = r[:, offset : offset + self.sizes[i]].reshape(r.shape[0], *self.shapes[i])
                offset += self.sizes[i]
                target = self.dtypes[i]
                leaves[i] = (
                    x != 0 if target == jnp.bool_ else jax.lax.bitcast_convert_type(x, target)
                )
        return leaves


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, desc=desc, unit="rec", unit_scale=True, leave=False)
    return None


def _load(
    source: Any, n: int, probe: _Probe, replicated: NamedSharding, progress: bool
) -> list[jax.Array]:
    """Rows ``[0, n)`` of ``source`` as the probe's group matrices, replicated on every device.

    Reads ``_CHUNK_BYTES`` of rows at a time and writes them into preallocated device
    buffers (donated, so updated in place): the host holds one chunk, never the store.
    Each chunk's leaves are put as the host pipeline puts them (same dtype conversion)
    and packed on the devices.
    """
    shapes = probe.group_shapes(n)
    allocate = jax.jit(
        lambda: [jnp.zeros(s, d) for s, d in zip(shapes, probe.group_dtypes, strict=True)],
        out_shardings=replicated,
    )
    update = jax.jit(
        lambda bufs, chunk, lo: [
            jax.lax.dynamic_update_slice_in_dim(b, c, lo, axis=0)
            for b, c in zip(bufs, probe.pack(chunk), strict=True)
        ],
        donate_argnums=0,
        out_shardings=replicated,
    )
    bufs = allocate()
    rows = max(1, _CHUNK_BYTES // max(1, probe.record_bytes))
    bar = _progress(n, "loading store onto devices", progress)
    try:
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            leaves = jax.tree_util.tree_leaves(source.read_batch(np.arange(lo, hi)))
            for key, a, shape in zip(_keys(probe), leaves, probe.shapes, strict=True):
                if tuple(np.shape(a)) != (hi - lo, *shape):
                    raise ResidentUnsupportedError(
                        f"Leaf '{key}' of {source!r} gave records of shape {np.shape(a)[1:]} "
                        f"at rows [{lo}, {hi}), but {shape} at row 0. Device-resident replay "
                        "needs every record of a leaf to have one shape. Fix: use resident=False."
                    )
            chunk = [
                jax.make_array_from_callback(np.shape(a), replicated, np.asarray(a).__getitem__)
                for a in leaves
            ]
            bufs = update(bufs, chunk, lo)
            del leaves, chunk
            jax.block_until_ready(bufs)  # one chunk in flight: host memory stays one chunk
            if bar is not None:
                bar.update(hi - lo)
    finally:
        if bar is not None:
            bar.close()
    return bufs


def _keys(probe: _Probe) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(probe.treedef, list(range(len(probe.shapes))))
    )[0]
    return [jax.tree_util.keystr(p, simple=True, separator="/") or "<root>" for p, _ in paths]


class ResidentReplayIterator(Iterator[Any]):
    """The batches of a ``make_data_loader`` loader, gathered on the devices.

    Built by ``sharded_device_put(loader, resident=True)``; see
    :func:`grain_replay.sharded_device_put`. Yields the same pytrees of sharded
    ``jax.Array`` as ``sharded_device_put(loader)``, in the same order, and its
    ``get_state``/``set_state`` bytes are those of the loader's own iterator.

    Attributes:
        window: Batches gathered by one dispatch (up to 64, fewer for big batches); the
            next window is queued when half of the current one is handed out.
        device_bytes: Device memory used per device: the store's replica plus two windows.
    """

    def __init__(
        self,
        plan: LoaderPlan,
        sharding: NamedSharding,
        *,
        budget_bytes: int | None = None,
        progress: bool = True,
    ) -> None:
        reads = plan.reads
        self._identity = plan.identity
        self._reads = reads
        self._length = len(reads) // plan.identity.shard_count
        self._batch_size = reads.options.batch_size
        self._sharding = sharding
        mesh, axis = sharding.mesh, sharding.spec[0] if sharding.spec else None
        every, local = _slices(sharding)
        _check_split(self._batch_size, local)
        self._local_slices = local
        self._global_factor = every // local  # global batch = local batch x this
        self._ids_sharding = NamedSharding(mesh, PartitionSpec(None, axis))
        replicated = NamedSharding(mesh, PartitionSpec())
        source, n = reads.source, reads.num_records
        if n >= 2**31:  # record ids travel as int32 (jax's default integer)
            raise ResidentUnsupportedError(
                f"{source!r} has {n:,} records; device-resident replay holds at most 2**31 - 1. "
                "Fix: use resident=False."
            )
        probe = _Probe(source)
        rows_per_device = self._batch_size // local
        self._window = max(
            1, min(_MAX_WINDOW, _WINDOW_BYTES // max(1, rows_per_device * probe.record_bytes))
        )
        self.window = self._window  # batches gathered by one dispatch
        store_bytes = n * probe.record_bytes
        # Up to one and a half windows are alive at once (see __next__); count two.
        window_bytes = 2 * self._window * rows_per_device * (probe.record_bytes + 4)
        self.device_bytes = store_bytes + window_bytes
        if budget_bytes is None:
            budget, why = _default_budget()
        else:
            budget, why = budget_bytes, "budget_bytes"
        if self.device_bytes > budget:
            raise ResidentBudgetError(
                f"Device-resident replay of {source!r} needs {_fmt_bytes(self.device_bytes)} "
                f"per device ({_fmt_bytes(store_bytes)} for {n:,} records of "
                f"{probe.record_bytes:,} B on every device, plus {_fmt_bytes(window_bytes)} for "
                f"{self._window} batches gathered ahead), over the budget of "
                f"{_fmt_bytes(budget)} per device ({why}). Fix: raise budget_bytes= if the "
                "devices have room, read fewer leaves (keys=[...]), or pass resident='auto' to "
                "fall back to the host pipeline."
            )
        logger.info(
            "Loading %s records (%s per device) of %r onto %d devices",
            n,
            _fmt_bytes(store_bytes),
            source,
            len(sharding.device_set),
        )
        self._treedef = probe.treedef
        self._store = _load(source, n, probe, replicated, progress)

        def gather(store: list[jax.Array], ids: jax.Array) -> tuple[list[jax.Array], ...]:
            # Per device: ids is (steps, this device's rows); store is the whole replica.
            return tuple(
                probe.unpack([jnp.take(group, ids[k], axis=0, mode="clip") for group in store])
                for k in range(ids.shape[0])
            )

        self._gather = jax.jit(
            jax.shard_map(
                gather,
                mesh=mesh,
                in_specs=(PartitionSpec(), PartitionSpec(None, axis)),
                out_specs=PartitionSpec(axis),
            )
        )
        self._next = 0  # elements of this process handed out
        self._ready: collections.deque[Any] = collections.deque()
        self._closed = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Any:
        if self._closed or self._next >= self._length:
            raise StopIteration
        if not self._ready:
            self._fill(self._next)
        batch = self._ready.popleft()
        self._next += 1
        ahead = self._next + len(self._ready)
        if len(self._ready) == self._window // 2 and ahead < self._length:
            # Queue the next window while half of this one is left: its gather runs on
            # the devices behind the steps already dispatched, never in front of a step.
            self._fill(ahead)
        return batch

    def _record_ids(self, j: int) -> np.ndarray:
        ident = self._identity
        return self._reads.record_ids(j * ident.shard_count + ident.shard_index)

    def _fill(self, start: int) -> None:
        """Gathers the window of batches from element ``start`` on with one dispatch."""
        first = self._record_ids(start)
        if len(first) != self._batch_size:  # the short last batch of an epoch: on its own
            _check_split(len(first), self._local_slices)
            rows = [first]
            steps = 1
        else:
            rows = [first]
            stop = min(self._length, start + self._window)
            for j in range(start + 1, stop):
                ids = self._record_ids(j)
                if len(ids) != self._batch_size:
                    break
                rows.append(ids)
            steps = self._window  # padded: one compiled shape for every full window
        block = np.zeros((steps, len(first)), dtype=np.int32)
        block[: len(rows)] = rows
        global_shape = (steps, len(first) * self._global_factor)
        if jax.process_count() > 1:
            on_device = jax.make_array_from_process_local_data(
                self._ids_sharding, block, global_shape
            )
        else:
            on_device = jax.make_array_from_callback(
                global_shape, self._ids_sharding, block.__getitem__
            )
        out = self._gather(self._store, on_device)
        for leaves in out[: len(rows)]:
            self._ready.append(jax.tree_util.tree_unflatten(self._treedef, leaves))

    def get_state(self) -> bytes:
        """The loader iterator's state right after the last batch handed out (same bytes)."""
        return loader_state_bytes(self._identity, self._next)

    def set_state(self, state: bytes) -> None:
        """Resumes right after the batch at which ``state`` was saved.

        Args:
            state: From :meth:`get_state`, or from an iterator of the same loader on the host
                (``sharded_device_put(loader)`` or ``iter(loader)``).

        Raises:
            CheckpointMismatchError: (a ``ValueError``) ``state`` is not a state of this
                loader's stream.
        """
        self._next = handed_out_from_state(self._identity, state)
        self._ready.clear()

    def close(self) -> None:
        """Releases the store's device memory and the batches gathered ahead; iteration ends.

        Final: ``set_state`` does not reopen a closed iterator (make a new one).
        """
        self._ready.clear()
        self._store = []
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def resident_device_put(
    batches: Any,
    sharding: Any,
    *,
    resident: bool | Literal["auto"],
    budget_bytes: int | None,
    progress: bool = True,
) -> ResidentReplayIterator | None:
    """A :class:`ResidentReplayIterator` of ``batches``; None to fall back (``resident="auto"``).

    Raises:
        ResidentUnsupportedError: ``batches`` is not a loader of ``make_data_loader``, it has
            host operations, or ``sharding`` is not None, a Mesh or a NamedSharding.
        ResidentBudgetError: The store does not fit in ``budget_bytes`` per device.
    """
    if not (resident is True or (isinstance(resident, str) and resident == "auto")):
        raise InvalidArgumentError(f"resident must be False, True or 'auto', got {resident!r}")
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
    ):
        raise InvalidArgumentError(
            f"budget_bytes must be a non-negative int or None, got {budget_bytes!r}"
        )
    try:
        plan = _plan_of(batches)
        return ResidentReplayIterator(
            plan, _batch_sharding(sharding), budget_bytes=budget_bytes, progress=progress
        )
    except (ResidentBudgetError, ResidentUnsupportedError) as e:
        if resident != "auto":
            raise
        logger.warning("resident='auto': using the host pipeline. %s", e)
        return None


def _plan_of(batches: Any) -> LoaderPlan:
    plan = getattr(batches, "plan", None)
    sampling = getattr(batches, "sampling", None)
    if isinstance(sampling, str) and plan is None:
        raise ResidentUnsupportedError(
            "Device-resident replay replays make_data_loader's seeded epochs over one store; "
            f"this loader samples otherwise ({sampling}) and reads on the host. Fix: use "
            "resident=False (or "
            'resident="auto" to fall back by itself).'
        )
    if not isinstance(plan, LoaderPlan) or not isinstance(plan.reads, BatchedReads):
        raise ResidentUnsupportedError(
            "Device-resident replay needs the loader returned by gr.make_data_loader (it "
            f"replays the loader's batches on the devices). Got {type(batches).__name__} "
            "instead. Fix: pass the loader itself, not an iterator of it, or use resident=False."
        )
    if plan.operations:
        raise ResidentUnsupportedError(
            f"The loader applies {len(plan.operations)} host operation(s) to its batches, "
            "which device-resident replay cannot run on the devices. Fix: apply them to the "
            "device batches in your jitted step, or use resident=False."
        )
    return plan
