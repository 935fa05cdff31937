"""Host batches to globally sharded ``jax.Array``s, prefetched in a background thread."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, Self

import grain
import jax
import numpy as np

from grain_replay.device.converter import Converter
from grain_replay.device.prefetch import Prefetcher
from grain_replay.errors import (
    InvalidArgumentError,
    InvalidPrefetchError,
    InvalidShardingError,
    UnsupportedStateError,
)
from grain_replay.pipeline.state import load_text, save_text
from grain_replay.sources.capabilities import (
    Checkpointable,
    LaysOutLanes,
    Prefetches,
    PriorityUpdates,
    StateAt,
)
from grain_replay.store.parts import RowIds

if TYPE_CHECKING:
    from grain_replay.device.resident import ResidentReplayIterator

__all__ = [
    "InvalidPrefetchError",
    "InvalidShardingError",
    "ShardedDevicePutIterator",
    "UnsupportedStateError",
    "sharded_device_put",
]

logger = logging.getLogger(__name__)


def has_pinned_host() -> bool:
    """Whether the default backend's devices have a ``pinned_host`` memory space."""
    return any(m.kind == "pinned_host" for m in jax.local_devices()[0].addressable_memories())


def _pinned_if_available(pinned: bool) -> bool:
    """``pinned``, unless the backend has no pinned host memory or it was measured to lose
    there (TPU): then False, with a warning saying why."""
    if pinned and not has_pinned_host():
        logger.warning(
            "sharded_device_put(pinned=True): the %s backend has no pinned_host memory; "
            "putting pageable host batches instead",
            jax.default_backend(),
        )
        return False
    if pinned and jax.default_backend() == "tpu":
        logger.warning(
            "sharded_device_put(pinned=True) is off on TPU: measured slower than pageable "
            "puts on a v5e (numpy -> pinned_host runs at 0.4-0.6 GB/s; even a reused pinned "
            "buffer filled in place then moved to HBM reached 4.3 GB/s for frame batches, "
            "against 13.3 GB/s for a packed pageable buffer, 4 in flight; "
            "benchmarks/probe_link.py). Putting pageable host batches instead; "
            "docs/loader.md has the numbers."
        )
        return False
    return pinned


def _packed_default(packed: bool | None) -> bool:
    """``packed=None``: on where it was measured to pay (TPU, batches that go several to
    a transfer), else off."""
    if packed is None:
        return jax.default_backend() == "tpu"
    if not isinstance(packed, bool):
        raise InvalidArgumentError(
            f"packed must be True, False or None (None: on for TPU), got {packed!r}. "
            "Fix: packed=None."
        )
    return packed


def _local_rows(x: Any) -> np.ndarray:
    """``x`` as numpy; of a globally sharded jax.Array, this process's rows in order."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        shards = {s.index[0].indices(x.shape[0])[0]: s.data for s in x.addressable_shards}
        return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])
    return np.asarray(x)


def _put_row_ids_aside(batch: Any) -> tuple[Any, RowIds | None]:
    """The batch to put, and the row ids of a prioritized batch over a bounded or
    many-writer store (``index``, :class:`grain_replay.store.parts.RowIds`) to keep on the
    host, or None.

    They need 64 bits (``ordinal << 40 | seq``) and jax keeps 32 without
    ``jax_enable_x64``; the index only goes back to ``update_priorities``.
    """
    index = getattr(batch, "index", None)
    if isinstance(index, RowIds) and jax.dtypes.canonicalize_dtype(np.int64) != np.int64:
        # the tree as given (a pytree of shardings still matches), the ids put back after
        return batch._replace(index=np.asarray(index, dtype=np.int32)), index
    return batch, None


def _keep_row_ids(convert: Callable[[list[Any]], list[Any]]) -> Callable[[list[Any]], list[Any]]:
    """``convert`` (of a list of batches), the row ids kept on the host (see above)."""

    def put(batches: list[Any]) -> list[Any]:
        prepared = [_put_row_ids_aside(b) for b in batches]
        out = convert([b for b, _ in prepared])
        return [a if ids is None else a._replace(index=ids) for a, (_, ids) in zip(out, prepared)]

    return put


class ShardedDevicePutIterator(Iterator[Any]):
    """Iterator of sharded ``jax.Array`` batches; see :func:`sharded_device_put`.

    Over a ``grain.DatasetIterator`` (or a grain dataset) it is one too, so that
    grain's Orbax handler saves its (dict) state as it saves the wrapped iterator's.
    """

    def __new__(cls, batches: Iterable[Any], *args: Any, **kwargs: Any) -> Self:
        if cls is ShardedDevicePutIterator and isinstance(
            batches, (grain.DatasetIterator, grain.IterDataset, grain.MapDataset)
        ):
            cls = _DatasetShardedDevicePutIterator
        return super().__new__(cls)

    def __init__(
        self,
        batches: Iterable[Any],
        sharding: Any = None,
        *,
        prefetch: int = 2,
        pinned: bool = False,
        packed: bool | None = None,
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise InvalidPrefetchError(f"prefetch must be a non-negative int, got {prefetch!r}")
        self._prefetcher: Prefetcher | None = None
        self._converter = Converter(
            sharding, _pinned_if_available(pinned), _packed_default(packed), packed is None
        )
        self._convert = _keep_row_ids(self._converter.convert_group)
        self._prefetch = prefetch
        inner: Any = batches if isinstance(batches, Iterator) else iter(batches)
        self._inner = inner
        if self._converter.lays_out and isinstance(inner, LaysOutLanes):
            inner.lay_out_lanes()  # the loader lays batches out as the packed buffer
        self._stateful = isinstance(inner, Checkpointable)
        # An inner iterator that can give the state of an earlier position (a replay
        # iterator, whose state holds the priorities) is asked only at a checkpoint.
        self._state_at: Callable[[int], Any] | None = (
            inner.get_state_at if self._stateful and isinstance(inner, StateAt) else None
        )
        self._capture = self._stateful and self._state_at is None
        self._state = copy.deepcopy(inner.get_state()) if self._capture else None
        self._finished = False
        self._handed = getattr(inner, "position", 0)  # batches the caller received

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._prefetch == 0:
            try:
                batch = next(self._inner)
                state = copy.deepcopy(self._inner.get_state()) if self._capture else None
                arrays = self._convert([batch])[0]
            except BaseException:
                self._finished = True
                raise
            self._state = state
            self._handed += 1
            return arrays
        if self._prefetcher is None:
            self._start()
        assert self._prefetcher is not None
        try:
            arrays, self._state = self._prefetcher.next()
        except BaseException:
            self._finished = True
            self._prefetcher = None  # it has stopped
            raise
        self._handed += 1
        return arrays

    def _start(self) -> None:
        # A prioritized stream stamps each priority update with the batches this wrapper
        # may have pulled ahead (``prefetch``): its batches are moved one at a time.
        transfers = None if isinstance(self._inner, PriorityUpdates) else self._converter.transfers
        self._prefetcher = Prefetcher(
            self._inner, self._convert, self._prefetch, self._capture, transfers
        )

    def _halt(self, timeout: float | None = None) -> None:
        """Stops the producer and drops what it prefetched."""
        if self._prefetcher is not None:
            self._prefetcher.halt(timeout)
        self._prefetcher = None

    def get_state(self) -> Any:
        """Returns the wrapped iterator's state right after the last batch handed out.

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``get_state``/``set_state``.
        """
        self._require_state("get_state")
        if self._state_at is not None:
            return self._state_at(self._handed)
        return copy.deepcopy(self._state)

    def set_state(self, state: Any) -> None:
        """Resumes the stream right after the batch at which ``state`` was saved.

        Args:
            state: A value returned by :meth:`get_state` (or by the wrapped iterator).

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``get_state``/``set_state``.
        """
        self._require_state("set_state")
        self._halt()  # no timeout: the producer must be out of the wrapped iterator
        self._inner.set_state(copy.deepcopy(state))
        self._state = copy.deepcopy(state) if self._capture else None
        self._finished = False
        self._handed = getattr(self._inner, "position", 0)

    def update_priorities(self, index: Any, priorities: Any) -> None:
        """Forwards a priority update to the wrapped (prioritized replay) iterator.

        ``index`` and ``priorities`` may be numpy or jax arrays; a globally sharded
        array contributes this process's rows. The update is stamped with the batches
        handed to the caller plus ``prefetch`` (the batches this wrapper may have
        pulled ahead), so the draws stay a function of the updates, not of timing.

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``update_priorities``.
        """
        if not isinstance(self._inner, PriorityUpdates):
            raise UnsupportedStateError(
                f"Cannot call update_priorities(): the wrapped iterator "
                f"({type(self._inner).__name__}) does not sample with priorities. Wrap a "
                "loader made with sampling=gr.PrioritizedReplay()."
            )
        self._inner.update_priorities(
            _local_rows(index), _local_rows(priorities), handed_out=self._handed + self._prefetch
        )

    def _require_state(self, method: str) -> None:
        if not self._stateful:
            raise UnsupportedStateError(
                f"Cannot call {method}(): the wrapped iterator "
                f"({type(self._inner).__name__}) has no get_state/set_state. Wrap a grain "
                "DataLoader or DatasetIterator to checkpoint the stream."
            )

    async def save(self, directory: Any) -> Any:
        """Orbax's ``StatefulCheckpointable.save``: the wrapped iterator's state, as grain's.

        Args:
            directory: An Orbax ``PathAwaitingCreation``.

        Returns:
            A coroutine writing ``process_<i>-of-<n>.json`` once the directory exists.

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``get_state``/``set_state``.
        """
        state = self.get_state()
        text = state.decode() if isinstance(state, bytes) else json.dumps(state, indent=4)
        return save_text(directory, text)

    async def load(self, directory: Any) -> Any:
        """Orbax's ``StatefulCheckpointable.load``: reads what :meth:`save` wrote.

        Returns:
            A coroutine that sets the state and starts prefetching.

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``get_state``/``set_state``.
        """
        self._require_state("load")
        # else a grain dataset's dict
        loader_state = isinstance(self._state, bytes) or (
            self._state_at is not None and not isinstance(self, grain.DatasetIterator)
        )

        async def read() -> None:
            text = await load_text(directory, elastic=loader_state)
            self.set_state(text.encode() if loader_state else json.loads(text))
            self.start_prefetch()

        return read()

    def start_prefetch(self) -> None:
        """Starts reading and transferring the next batches in the background.

        grain's Orbax handler calls it after restoring the state. With ``prefetch=0``
        the wrapped iterator's own ``start_prefetch`` runs, if it has one.
        """
        if self._finished:
            return
        if self._prefetch == 0:
            if isinstance(self._inner, Prefetches):
                self._inner.start_prefetch()
        elif self._prefetcher is None:
            self._start()

    def close(self) -> None:
        """Stops the producer thread and drops prefetched batches; iteration then ends."""
        self._finished = True
        self._halt(timeout=30.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Only signal: joining here could block the garbage collector.
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None:
            prefetcher.signal_stop()


class _DatasetShardedDevicePutIterator(ShardedDevicePutIterator, grain.DatasetIterator):
    """A :class:`ShardedDevicePutIterator` over a grain dataset iterator (dict states)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        grain.DatasetIterator.__init__(self)
        ShardedDevicePutIterator.__init__(self, *args, **kwargs)


def sharded_device_put(
    batches: Iterable[Any],
    sharding: Any = None,
    *,
    prefetch: int = 2,
    pinned: bool = False,
    packed: bool | None = None,
    resident: bool | Literal["auto"] = False,
    budget_bytes: int | None = None,
) -> ShardedDevicePutIterator | ResidentReplayIterator:
    """Wraps host batches into an iterator of ``jax.Array`` pytrees sharded on the batch axis.

    Each leaf is built with ``jax.make_array_from_process_local_data``, so with several JAX
    processes the global batch is the process-local batch times the process count (with one
    process, ``jax.make_array_from_callback`` builds the same arrays, faster). A
    background thread pulls from ``batches`` and issues the (asynchronous) transfers, keeping
    up to ``prefetch`` batches in flight. Run it in the consuming process, after the loader.
    Do not modify a host batch after handing it over: jax may still be copying it, or (on
    the CPU backend) alias it. grain_replay's loaders never reuse a batch's memory.

    Args:
        batches: An iterable or iterator of host batches: pytrees of numpy arrays with a
            leading per-process batch axis. An iterable that is not an iterator (a
            ``grain.DataLoader``) has ``iter()`` called on it once.
        sharding: ``None`` for a 1-D mesh named ``"data"`` over ``jax.devices()``; a
            ``jax.sharding.Mesh`` to shard over its first axis; a ``jax.sharding.Sharding``
            used for every leaf; or a pytree of shardings that is a prefix of the batch tree.
        prefetch: Batches kept in flight by the background thread; 0 runs synchronously.
        pinned: Stage each numpy leaf in pinned host memory (``memory_kind="pinned_host"``)
            before the device copy. Off by default: not yet measured to pay on a GPU (the
            ``device`` benchmark section measures it); on a backend without pinned host
            memory, and on TPU (measured slower there, docs/loader.md), it logs a warning
            and puts pageable batches.
        packed: Move each batch as one lane-aligned ``uint32[rows, 128]`` buffer per
            device and lay the leaves out on the device (one jitted program per batch
            layout), instead of one put per leaf. The arrays are the same (values,
            dtypes, shapes, shardings). ``None`` (default): on for TPU, where a put per
            leaf pays a host-side relayout into the chip's tiles and a fixed cost per
            put (a batch of 5 transition leaves 3.6x faster, frames 1.9x, on a v5e;
            ``benchmarks/bench_feed.py``), off elsewhere. Where it does not apply
            (several processes, non-numpy leaves, leaves sharded differently or
            replicated, dtypes other than bool/int/uint/float) leaves are put one by one.
            Packed on one device, a loader of :func:`make_data_loader` is asked to lay
            each batch out as that buffer (``lay_out_lanes()``): the batch is then put
            as the buffer it lies in, with no copy in this process (docs/loader.md).
        resident: ``True`` for device-resident replay: ``batches`` must be a loader of
            :func:`make_data_loader` (no host ``operations``); its store is loaded once onto
            every device (a replica per device, read in chunks with a progress bar) and each
            batch is gathered on the devices, the same batches in the same order, sharded
            the same way, with the loader's checkpoint bytes. ``"auto"``: the same, but fall
            back to the host pipeline (with a warning) where it does not apply or fit.
            ``prefetch`` does not apply: batches are gathered up to 64 per dispatch, the
            next group queued while half of the current one is left.
        budget_bytes: Device memory per device that ``resident`` may use (the store plus
            the batches gathered ahead); default: half of the free memory the device
            reports (on CPU, half of the available host memory over the devices). The
            store counts as laid out on the device (each leaf's 32-bit words in 128-lane
            lines, padded to a TPU's ``(8, 128)`` tiles): a few percent over its records'
            bytes for the usual leaves (the iterator's ``store_bytes``).

    Returns:
        A :class:`ShardedDevicePutIterator` (a ``ResidentReplayIterator`` with
        ``resident``); it has ``get_state``/``set_state`` when ``batches`` does, and
        ``close()`` (or ``with``) stops it.

    Raises:
        InvalidShardingError: ``sharding`` is not one of the accepted kinds.
        InvalidPrefetchError: ``prefetch`` is negative or not an int.
        BatchShardingError: Raised by ``next()`` when a leaf is a scalar or its batch size
            does not split evenly over the process-local devices.
        ResidentBudgetError: ``resident=True`` and the store does not fit in the budget.
        ResidentUnsupportedError: ``resident=True`` and ``batches`` is not a loader of
            ``make_data_loader``, has host operations, or ``sharding`` is a pytree.

    Examples:
        >>> loader = gr.make_data_loader(source, batch_size=256)  # doctest: +SKIP
        >>> for batch in gr.sharded_device_put(loader, prefetch=2):  # doctest: +SKIP
        ...     state = train_step(state, batch)
    """
    if resident is not False:
        from grain_replay.device.resident import resident_device_put

        it = resident_device_put(batches, sharding, resident=resident, budget_bytes=budget_bytes)
        if it is not None:
            return it
    elif budget_bytes is not None:
        raise InvalidArgumentError(
            "budget_bytes applies to resident=True or 'auto'; got resident=False"
        )
    return ShardedDevicePutIterator(
        batches, sharding, prefetch=prefetch, pinned=pinned, packed=packed
    )
