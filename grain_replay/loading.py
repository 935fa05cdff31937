"""The loaders a user builds: ``gr.make_data_loader`` and ``gr.replay_dataset``.

A facade above the two rooms it composes: epochs of seeded permutations
(``pipeline/loader.py``) and mixtures and replay streams (``grain_replay.sampling``).
It picks one from the arguments; neither room imports the other's loader.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain

from grain_replay.pipeline.arguments import LoaderArguments
from grain_replay.pipeline.flags import ensure_absl_flags_parsed
from grain_replay.pipeline.loader import epoch_dataset, make_epoch_loader
from grain_replay.sampling.loader import make_sampling_dataset, make_sampling_loader
from grain_replay.sources.base import BatchSource

__all__ = ["make_data_loader", "replay_dataset"]


def _samples(source: Any, args: LoaderArguments) -> bool:
    """Whether the arguments ask for a mixture or replay stream (``grain_replay.sampling``)."""
    return bool(
        isinstance(source, Mapping)
        or args.sampling != "epochs"
        or args.weights is not None
        or args.keys
        or args.source_leaf
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

    Examples:
      >>> loader = gr.make_data_loader(src, batch_size=256, num_epochs=None)
      >>> for batch in gr.sharded_device_put(loader): ...
    """
    ensure_absl_flags_parsed()  # grain starts workers only once absl flags are parsed
    args = LoaderArguments(
        batch_size=batch_size, shuffle=shuffle, seed=seed, num_epochs=num_epochs,
        drop_remainder=drop_remainder, worker_count=worker_count, shard_options=shard_options,
        operations=operations, read_options=read_options, worker_buffer_size=worker_buffer_size,
        weights=weights, sampling=sampling, keys=keys, source_leaf=source_leaf,
    )  # fmt: skip
    if _samples(source, args):
        return make_sampling_loader(source, args)
    return make_epoch_loader(source, args)


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

    Examples:
      >>> ds = gr.replay_dataset(src, batch_size=256).map(augment).mp_prefetch()
    """
    ensure_absl_flags_parsed()  # grain starts workers only once absl flags are parsed
    args = LoaderArguments(
        batch_size=batch_size, shuffle=shuffle, seed=seed, num_epochs=num_epochs,
        drop_remainder=drop_remainder, shard_options=shard_options, read_options=read_options,
        weights=weights, sampling=sampling, keys=keys, source_leaf=source_leaf,
    )  # fmt: skip
    if _samples(source, args):
        return make_sampling_dataset(source, args)
    return epoch_dataset(source, args)
