"""Device-resident replay: the store loaded once onto the devices, batches gathered there.

``sharded_device_put(loader, resident=True)`` hands out the batches of ``loader``
(same permutation, epochs, process shards and checkpoint bytes) without reading
the store again: every device holds a replica of the store's rows (each leaf's
32-bit words in 128-lane lines, ``device/lines.py``: no TPU tile padding), and each
device gathers its own slice of every batch from its replica, so a batch costs
no host read, no host-to-device copy and no communication between devices.
Batches are gathered a window at a time (one dispatch for up to
``_MAX_WINDOW`` batches) because on small batches the cost of a dispatch, not
the gather, is what limits the rate.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal, Self

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grain_replay.device import row_dma
from grain_replay.device.converter import default_sharding, mesh_sharding
from grain_replay.device.lines import Probe, RowLayout
from grain_replay.device.resident_programs import gather_program
from grain_replay.device.resident_store import default_budget, format_bytes, load_store
from grain_replay.errors import (
    BatchShardingError,
    InvalidArgumentError,
    ResidentBudgetError,
    ResidentUnsupportedError,
)
from grain_replay.pipeline import shutdown
from grain_replay.pipeline.loader import BatchedReads, LoaderPlan
from grain_replay.pipeline.state import handed_out_from_state, loader_state_bytes

__all__ = ["ResidentReplayIterator", "resident_device_put"]

logger = logging.getLogger(__name__)

_MAX_WINDOW = 64  # batches gathered by one dispatch
_WINDOW_BYTES = 64 << 20  # ...and at most this many bytes of them per device
_CHUNK_BYTES = 64 << 20  # host rows read (and copied to the devices) per loading step


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


class ResidentReplayIterator(Iterator[Any]):
    """The batches of a ``make_data_loader`` loader, gathered on the devices.

    Built by ``sharded_device_put(loader, resident=True)``; see
    :func:`grain_replay.sharded_device_put`. Yields the same pytrees of sharded
    ``jax.Array`` as ``sharded_device_put(loader)``, in the same order, and its
    ``get_state``/``set_state`` bytes are those of the loader's own iterator.

    Attributes:
        window: Batches gathered by one dispatch (up to 64, fewer for big batches); the
            next window is queued when half of the current one is handed out.
        store_bytes: Device memory the store's replica takes per device, as laid out (the
            records' words in 128-lane lines, ``device/lines.py``) and padded to a TPU's
            ``(8, 128)`` tiles: a few percent over ``records x record bytes`` for the usual
            leaves.
        device_bytes: Device memory used per device: ``store_bytes`` plus two windows.
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
        probe = Probe(source)
        layout = RowLayout(probe, n)
        rows_per_device = self._batch_size // local
        self._window = max(
            1, min(_MAX_WINDOW, _WINDOW_BYTES // max(1, rows_per_device * probe.record_bytes))
        )
        self.window = self._window  # batches gathered by one dispatch
        # What the layout allocates, TPU tiles included: the budget is checked against the
        # device's real bytes, not the records' (n x record_bytes).
        store_bytes = layout.device_bytes()
        self.store_bytes = store_bytes
        # Up to one and a half windows are alive at once (see __next__); count two.
        window_bytes = 2 * self._window * rows_per_device * (probe.record_bytes + 4)
        self.device_bytes = store_bytes + window_bytes
        if budget_bytes is None:
            budget, why = default_budget()
        else:
            budget, why = budget_bytes, "budget_bytes"
        if self.device_bytes > budget:
            raise ResidentBudgetError(
                f"Device-resident replay of {source!r} needs {format_bytes(self.device_bytes)} "
                f"per device ({format_bytes(store_bytes)} for {n:,} records of "
                f"{probe.record_bytes:,} B on every device, as laid out there: 32-bit words in "
                f"128-lane lines, padded to the device's tiles; plus {format_bytes(window_bytes)} "
                f"for {self._window} batches gathered ahead), over the budget of "
                f"{format_bytes(budget)} per device ({why}). Fix: raise budget_bytes= if the "
                "devices have room, read fewer leaves (keys=[...]), or pass resident='auto' to "
                "fall back to the host pipeline."
            )
        logger.info(
            "Loading %s records (%s per device) of %r onto %d devices",
            n,
            format_bytes(store_bytes),
            source,
            len(sharding.device_set),
        )
        self._treedef = probe.treedef
        self._store = load_store(source, layout, replicated, progress, _CHUNK_BYTES)

        # Built once a process for a layout and sharding (device/resident_programs.py): a
        # second iterator of the same shapes compiles nothing.
        self._gather = by_xla = gather_program(layout, sharding, dma=False)
        if layout.has_tiles and jax.process_count() == 1 and row_dma.on_tpu(sharding.device_set):
            # Rows held as whole tiles (frames): a DMA a row where that is faster, timed
            # here on a window of this iterator's own shape (device/row_dma.py). One
            # process only: the processes of a run must not pick different programs.
            drawn = np.random.default_rng(0).integers(0, n, (self._window, self._batch_size))
            ids = self._ids_block(drawn.astype(np.int32))
            by_dma = gather_program(layout, sharding, dma=True)
            if row_dma.faster(by_xla, by_dma, (self._store, ids), repr(source)):
                self._gather = by_dma
        self._next = 0  # elements of this process handed out
        self._ready: collections.deque[Any] = collections.deque()
        # (first element, batches, record ids on the devices) of the next window
        self._ahead: tuple[int, int, jax.Array] | None = None
        self._closed = False
        # Closed at interpreter exit if still open: its arrays go before jax's teardown.
        shutdown.register(self, ResidentReplayIterator.close)

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
            # A short last batch that does not split over the devices is refused when
            # the caller reaches it (the fill at it, above, raises), not batches before.
            with contextlib.suppress(BatchShardingError):
                self._fill(ahead)
        return batch

    def _record_ids(self, j: int) -> np.ndarray:
        ident = self._identity
        return self._reads.record_ids(j * ident.shard_count + ident.shard_index)

    def _fill(self, start: int) -> None:
        """Gathers the window of batches from element ``start`` on with one dispatch, and
        sends the record ids of the window after it to the devices.

        The ids travel a window ahead: a put of a few kB costs a TPU about half a
        millisecond before a gather can use it, and a learner that waits for each step
        would wait for that put once a window too. Sent while this window is handed out,
        they are there when the next gather is dispatched.
        """
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == start:
            _, count, ids = ahead
        else:
            count, ids = self._window_ids(start)
        out = self._gather(self._store, ids)
        for leaves in out[:count]:
            self._ready.append(jax.tree_util.tree_unflatten(self._treedef, leaves))
        after = start + count
        if after < self._length:
            # A short last batch that does not split over the devices is refused when
            # the caller reaches it (its _fill computes it again and raises).
            with contextlib.suppress(BatchShardingError):
                self._ahead = (after, *self._window_ids(after))

    def _window_ids(self, start: int) -> tuple[int, jax.Array]:
        """(batches, the ``(steps, rows)`` record ids on the devices) of the window from
        element ``start``: up to ``window`` full batches, or a short last batch alone."""
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
        return len(rows), self._ids_block(block)

    def _ids_block(self, block: np.ndarray) -> jax.Array:
        """This process's ``(steps, rows)`` record ids as the global ids array."""
        global_shape = (block.shape[0], block.shape[1] * self._global_factor)
        if jax.process_count() > 1:
            return jax.make_array_from_process_local_data(self._ids_sharding, block, global_shape)
        return jax.make_array_from_callback(global_shape, self._ids_sharding, block.__getitem__)

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
        self._ahead = None

    def close(self) -> None:
        """Releases the store's device memory and the batches gathered ahead; iteration ends.

        Final: ``set_state`` does not reopen a closed iterator (make a new one).
        """
        shutdown.unregister(self)
        self._ready.clear()
        self._ahead = None
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
