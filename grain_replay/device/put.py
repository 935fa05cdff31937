"""Host batches to globally sharded ``jax.Array``s, read ahead (a thread; inline on TPU)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

from grain_replay.device.put_iterator import ShardedDevicePutIterator
from grain_replay.device.put_options import has_pinned_host
from grain_replay.errors import (
    InvalidArgumentError,
    InvalidPrefetchError,
    InvalidShardingError,
    UnsupportedStateError,
)

if TYPE_CHECKING:
    from grain_replay.device.resident import ResidentReplayIterator

__all__ = [
    "InvalidPrefetchError",
    "InvalidShardingError",
    "ShardedDevicePutIterator",
    "UnsupportedStateError",
    "has_pinned_host",
    "sharded_device_put",
]


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
    process, ``jax.make_array_from_callback`` builds the same arrays, faster). The first
    batch is read in the caller's thread and says how batches move (packed or leaf by
    leaf); then a background thread pulls from ``batches`` and issues the (asynchronous)
    transfers, keeping up to ``prefetch`` batches in flight; on a TPU, packed transfers
    read ahead in the caller's thread instead, one group ahead (docs/loader.md). Run it in
    the consuming process, after the loader.
    Do not modify a host batch after handing it over: jax may still be copying it, or (on
    the CPU backend) alias it. grain_replay's loaders never reuse a batch's memory.

    Args:
        batches: An iterable or iterator of host batches: pytrees of numpy arrays with a
            leading per-process batch axis. An iterable that is not an iterator (a
            ``grain.DataLoader``) has ``iter()`` called on it once.
        sharding: ``None`` for a 1-D mesh named ``"data"`` over ``jax.devices()``; a
            ``jax.sharding.Mesh`` to shard over its first axis; a ``jax.sharding.Sharding``
            used for every leaf; or a pytree of shardings that is a prefix of the batch tree.
        prefetch: Batches kept in flight (at least a packed transfer's group when read
            ahead in the caller's thread); 0 runs synchronously.
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
            Packed on one device, one batch a transfer, a loader of
            :func:`make_data_loader` is asked to lay each batch out as that buffer
            (``lay_out_lanes()``): the batch is then put as the buffer it lies in, with
            no copy in this process (docs/loader.md).
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
