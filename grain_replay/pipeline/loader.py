"""Batch-level reads inside grain: a DataLoader and an IterDataset whose elements are batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import grain

from grain_replay._flags import ensure_absl_flags_parsed
from grain_replay.errors import InvalidArgumentError
from grain_replay.pipeline.batches import BatchedReads, LoaderOptions, _as_int
from grain_replay.pipeline.defaults import default_read_options, default_shard_options
from grain_replay.pipeline.in_process import InProcessLoaderIterator
from grain_replay.pipeline.state import LoaderIdentity
from grain_replay.pipeline.workers import WorkerLoaderIterator
from grain_replay.sources.base import BatchSource

__all__ = ["LoaderOptions", "BatchedReads", "LoaderPlan", "make_data_loader", "replay_dataset"]


class _GlobalBatchSampler:
    """Sampler whose index ``i`` is global batch ``i`` (grain shards indices by process)."""

    def __init__(self, num_batches: int):
        self._num_batches = num_batches

    def __len__(self) -> int:
        return self._num_batches

    def __getitem__(self, index: int) -> grain.RecordMetadata:
        if not 0 <= index < self._num_batches:
            raise IndexError(f"batch index {index} out of range [0, {self._num_batches})")
        return grain.RecordMetadata(index=index, record_key=index)

    def __repr__(self) -> str:
        return f"_GlobalBatchSampler(num_batches={self._num_batches})"


@dataclasses.dataclass(frozen=True)
class LoaderPlan:
    """What a loader of :func:`make_data_loader` reads, for code that replays it elsewhere.

    Process ``identity.shard_index`` of ``identity.shard_count`` hands out global
    batches ``shard_index, shard_index + shard_count, ...`` of ``reads``; its
    checkpoint bytes are named by ``identity`` (see ``pipeline/state.py``).
    """

    reads: BatchedReads
    identity: LoaderIdentity
    operations: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Parts:
    """What a :class:`_ReplayDataLoader` was built from (grain keeps its copies private)."""

    reads: BatchedReads
    sampler: _GlobalBatchSampler
    operations: tuple[Any, ...]
    shard_options: Any
    read_options: grain.ReadOptions


class _ReplayDataLoader(grain.DataLoader):
    """A ``grain.DataLoader`` whose iterators skip grain's per-element work.

    With ``grain.transforms.Map`` operations only (the usual case), iteration is
    grain_replay's own: an :class:`InProcessLoaderIterator` (``worker_count=0``)
    or a :class:`WorkerLoaderIterator` (batches cross processes in shared
    memory). Both yield grain's elements in grain's order and read and write
    grain's checkpoint bytes. Any other operation falls back to grain's iterator.
    """

    def __init__(
        self,
        *,
        data_source: BatchedReads,
        sampler: _GlobalBatchSampler,
        operations: Sequence[Any],
        shard_options: Any,
        read_options: grain.ReadOptions,
        worker_count: int,
        worker_buffer_size: int,
    ) -> None:
        super().__init__(
            data_source=data_source,
            sampler=sampler,
            operations=operations,
            worker_count=worker_count,
            worker_buffer_size=worker_buffer_size,
            shard_options=shard_options,
            read_options=read_options,
        )
        self._parts = _Parts(data_source, sampler, tuple(operations), shard_options, read_options)

    @property
    def plan(self) -> LoaderPlan:
        """The batches this loader reads, its state's identity and its operations."""
        return LoaderPlan(self._parts.reads, self._identity(), self._parts.operations)

    def _identity(self) -> LoaderIdentity:
        parts = self._parts
        return LoaderIdentity(
            worker_count=self.multiprocessing_options.num_workers,
            sampler=repr(parts.sampler),
            data_source=repr(parts.reads),
            shard_index=parts.shard_options.shard_index,
            shard_count=parts.shard_options.shard_count,
        )

    def __iter__(self) -> grain.DataLoaderIterator:
        parts = self._parts
        ops = parts.operations
        if not all(isinstance(op, grain.transforms.Map) for op in ops):
            return super().__iter__()
        shards = parts.shard_options
        workers = self.multiprocessing_options.num_workers
        identity = self._identity()
        length = len(parts.sampler) // shards.shard_count
        threads = int(parts.read_options.num_threads)
        if workers > 0:
            return WorkerLoaderIterator(
                identity,
                parts.reads.__getitem__,
                length=length,
                maps=ops,
                buffer_size=self.multiprocessing_options.per_worker_buffer_size,
                read_threads=threads,
            )
        return InProcessLoaderIterator(
            identity,
            parts.reads.__getitem__,
            length=length,
            maps=ops,
            num_threads=threads,
            buffer_size=int(parts.read_options.prefetch_buffer_size),
        )


class _BatchesMapDataset(grain.MapDataset):
    """``grain.MapDataset.source(reads)`` that knows its element spec.

    ``grain.experimental.get_element_spec`` asks a dataset for its
    ``_element_spec`` property, the extension point grain's dataset subclasses
    implement; the source dataset has none, this one answers from the store's
    spec and the batch size.
    """

    def __init__(self, reads: BatchedReads) -> None:
        source = grain.MapDataset.source(reads)
        super().__init__(source)
        self._batches = source
        self._reads = reads

    def __len__(self) -> int:
        return len(self._batches)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.slice(index)
        return self._batches[index]

    def __str__(self) -> str:
        return f"BatchesMapDataset(batch_size={self._reads.options.batch_size})"

    @property
    def _element_spec(self) -> Any:
        return self._reads.element_spec()


def _samples(
    source: Any, weights: Any, sampling: Any, keys: Sequence[str] | None, source_leaf: str | None
) -> bool:
    """Whether the arguments ask for a mixture or replay stream (``grain_replay.sampling``)."""
    return bool(
        isinstance(source, Mapping)
        or sampling != "epochs"
        or weights is not None
        or keys
        or source_leaf
    )


def make_data_loader(
    source: BatchSource,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = 1,
    drop_remainder: bool = True,
    worker_count: int = 0,
    shard_options: Any = None,
    operations: Sequence[Any] = (),
    read_options: grain.ReadOptions | None = None,
    worker_buffer_size: int = 2,
    weights: Any = None,
    sampling: Any = "epochs",
    keys: Sequence[str] | None = None,
    source_leaf: str | None = None,
) -> grain.DataLoader:
    """A ``grain.DataLoader`` of host batches, each read with one ``read_batch`` call.

    Every epoch is a fresh seeded permutation of the records; the processes of a
    multi-host job (``ShardByJaxProcess`` by default) read disjoint batches, and
    together every record exactly once per epoch (less the remainder dropped).
    The stream depends only on ``seed``, not on ``worker_count``.

    Args:
      source: a grain_replay source (anything with ``__len__`` and
        ``read_batch(indices)``).
      batch_size: records per batch in this process.
      shuffle: permute records each epoch; else read them in order.
      seed: selects the permutations.
      num_epochs: passes over the data; None repeats forever.
      drop_remainder: drop the last partial batch of each epoch.
      worker_count: worker processes reading and mapping batches (0 reads in this
        process). Each worker writes whole batches into its own shared-memory slots;
        the consuming process copies a batch out with one ``memcpy`` per leaf.
      shard_options: ``grain.sharding.ShardOptions``; default
        ``ShardByJaxProcess(drop_remainder=True)``.
      operations: grain transformations applied to host batches in the workers.
      read_options: grain ``ReadOptions``: threads reading ahead. Default: none;
        batches are read inside ``next()`` (which ``sharded_device_put`` calls on its
        own thread) or, with workers, one at a time in each worker. For a
        high-latency source (object storage), read ahead with e.g.
        ``grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)``; in a worker,
        ``num_threads`` reads are kept in flight.
      worker_buffer_size: finished batches each worker keeps ahead (its
        shared-memory slots).
      weights: with a mapping of sources (a mixture): name -> weight, or a callable
        of the step returning one. Every batch holds exactly the largest-remainder
        share of each source, without drift; each source walks its own epochs.
      sampling: ``"epochs"`` (the default, above), ``gr.UniformReplay()`` or
        ``gr.PrioritizedReplay()``: draws with replacement over a growing store.
        Mixtures and replay streams are endless (``num_epochs`` 1 or None).
      keys: a mixture reads only these leaves (the ones its sources share).
      source_leaf: a mixture's batches gain this int32 leaf: each row's source
        position in ``source``.

    Returns:
      A ``grain.DataLoader`` whose iterator yields numpy batches and supports
      ``get_state``/``set_state``.

    Example:
      >>> loader = gr.make_data_loader(src, batch_size=256, num_epochs=None)
      >>> for batch in gr.sharded_device_put(loader): ...
    """
    if _samples(source, weights, sampling, keys, source_leaf):
        from grain_replay.sampling.loader import make_sampling_loader

        ensure_absl_flags_parsed()
        return make_sampling_loader(
            source, batch_size=batch_size, shuffle=shuffle, seed=seed, num_epochs=num_epochs,
            drop_remainder=drop_remainder, worker_count=worker_count,
            shard_options=shard_options, operations=operations, read_options=read_options,
            worker_buffer_size=worker_buffer_size, weights=weights, sampling=sampling,
            keys=keys, source_leaf=source_leaf,
        )  # fmt: skip
    options = LoaderOptions(batch_size, shuffle, seed, num_epochs, drop_remainder)
    worker_count = _as_int("worker_count", worker_count)
    if worker_count < 0:
        raise InvalidArgumentError(f"worker_count must be >= 0, got {worker_count}")
    shard_options = shard_options if shard_options is not None else default_shard_options()
    reads = BatchedReads(source, options, shard_options.shard_count)
    ensure_absl_flags_parsed()
    return _ReplayDataLoader(
        data_source=reads,
        sampler=_GlobalBatchSampler(len(reads)),
        operations=list(operations),
        worker_count=worker_count,
        worker_buffer_size=worker_buffer_size,
        shard_options=shard_options,
        read_options=read_options or default_read_options(worker_count),
    )


def replay_dataset(
    source: BatchSource,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    num_epochs: int | None = 1,
    drop_remainder: bool = True,
    shard_options: Any = None,
    read_options: grain.ReadOptions | None = None,
    weights: Any = None,
    sampling: Any = "epochs",
    keys: Sequence[str] | None = None,
    source_leaf: str | None = None,
) -> grain.IterDataset:
    """A ``grain.IterDataset`` of host batches with the same batch-level reads.

    For pipelines composed by hand (``.map``, ``.mp_prefetch``, ...). Arguments
    as in :func:`make_data_loader`.

    A mixture or replay ``sampling`` reads in the iterating process; its iterator
    has ``update_priorities`` (prioritized replay) until it is wrapped.

    Example:
      >>> ds = gr.replay_dataset(src, batch_size=256).map(augment).mp_prefetch()
    """
    if _samples(source, weights, sampling, keys, source_leaf):
        from grain_replay.sampling.loader import make_sampling_dataset

        ensure_absl_flags_parsed()
        return make_sampling_dataset(
            source, batch_size=batch_size, shuffle=shuffle, seed=seed, num_epochs=num_epochs,
            drop_remainder=drop_remainder, shard_options=shard_options, weights=weights,
            sampling=sampling, keys=keys, source_leaf=source_leaf,
        )  # fmt: skip
    options = LoaderOptions(batch_size, shuffle, seed, num_epochs, drop_remainder)
    shard_options = shard_options if shard_options is not None else default_shard_options()
    reads = BatchedReads(source, options, shard_options.shard_count)
    ds: grain.MapDataset = _BatchesMapDataset(reads)
    if shard_options.shard_count > 1:
        ds = ds[shard_options.shard_index :: shard_options.shard_count]
    ensure_absl_flags_parsed()
    return ds.to_iter_dataset(
        read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    )
