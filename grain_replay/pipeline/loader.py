"""Epochs of batch-level reads inside grain: a DataLoader and an IterDataset of batches.

``grain_replay.loading.make_data_loader`` (``gr.make_data_loader``) builds these for
``sampling="epochs"``; mixtures and replay are ``grain_replay.sampling``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grain

from grain_replay.errors import InvalidArgumentError
from grain_replay.pipeline.arguments import LoaderArguments
from grain_replay.pipeline.batches import BatchedReads, LoaderOptions, _as_int
from grain_replay.pipeline.defaults import default_read_options, default_shard_options
from grain_replay.pipeline.flags import ensure_absl_flags_parsed
from grain_replay.pipeline.in_process import InProcessLoaderIterator
from grain_replay.pipeline.state import LoaderIdentity
from grain_replay.pipeline.workers import WorkerLoaderIterator
from grain_replay.sources.base import BatchSource

__all__ = ["LoaderOptions", "BatchedReads", "LoaderPlan", "epoch_dataset", "make_epoch_loader"]


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
                # No operations: a batch is the source's rows, read straight into shared memory.
                read_into=None if ops else parts.reads.read_into,
            )
        return InProcessLoaderIterator(
            identity,
            parts.reads.__getitem__,
            length=length,
            maps=ops,
            num_threads=threads,
            buffer_size=int(parts.read_options.prefetch_buffer_size),
            read_into=None if ops else parts.reads.read_into,
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


def make_epoch_loader(source: BatchSource, args: LoaderArguments) -> grain.DataLoader:
    """``gr.make_data_loader`` with ``sampling="epochs"``: seeded permutations, batch reads.

    Arguments as in :func:`grain_replay.loading.make_data_loader`.
    """
    reads, shard_options = _epoch_reads(source, args)
    worker_count = _as_int("worker_count", args.worker_count)
    if worker_count < 0:
        raise InvalidArgumentError(f"worker_count must be >= 0, got {worker_count}")
    ensure_absl_flags_parsed()
    return _ReplayDataLoader(
        data_source=reads,
        sampler=_GlobalBatchSampler(len(reads)),
        operations=list(args.operations),
        worker_count=worker_count,
        worker_buffer_size=args.worker_buffer_size,
        shard_options=shard_options,
        read_options=args.read_options or default_read_options(worker_count),
    )


def epoch_dataset(source: BatchSource, args: LoaderArguments) -> grain.IterDataset:
    """``gr.replay_dataset`` with ``sampling="epochs"``: a ``grain.IterDataset`` of batches.

    Arguments as in :func:`grain_replay.loading.replay_dataset`.
    """
    reads, shard_options = _epoch_reads(source, args)
    ds: grain.MapDataset = _BatchesMapDataset(reads)
    if shard_options.shard_count > 1:
        ds = ds[shard_options.shard_index :: shard_options.shard_count]
    ensure_absl_flags_parsed()
    return ds.to_iter_dataset(
        args.read_options or grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    )


def _epoch_reads(source: BatchSource, args: LoaderArguments) -> tuple[BatchedReads, Any]:
    """The global batches of ``source`` and the shard options (the default when None)."""
    options = LoaderOptions(
        args.batch_size, args.shuffle, args.seed, args.num_epochs, args.drop_remainder
    )
    shard_options = args.shard_options
    if shard_options is None:
        shard_options = default_shard_options()
    return BatchedReads(source, options, shard_options.shard_count), shard_options
