"""Mixture and replay loaders: the ``grain.DataLoader`` and ``grain.IterDataset`` wrappers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from grain_replay.errors import InvalidSamplingError
from grain_replay.pipeline.arguments import LoaderArguments
from grain_replay.pipeline.defaults import default_read_options, default_shard_options
from grain_replay.sampling.arguments import stream_factory
from grain_replay.sampling.iterator import ENDLESS, SamplingIterator
from grain_replay.sampling.rate.limit import RateLimiter
from grain_replay.sampling.streams import Stream

__all__ = [
    "SamplingDataLoader",
    "SamplingIterator",
    "SamplingIterDataset",
    "make_sampling_dataset",
    "make_sampling_loader",
]


class _Description:
    """The ``data_source`` grain's DataLoader is given: a description, never read by grain."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __len__(self) -> int:
        return ENDLESS

    def __getitem__(self, index: int) -> Any:
        raise TypeError(f"{self._text} is read by grain_replay's own iterator.")

    def __repr__(self) -> str:
        return self._text


class _EndlessSampler:
    def __len__(self) -> int:
        return ENDLESS

    def __getitem__(self, index: int) -> grain.RecordMetadata:
        return grain.RecordMetadata(index=index, record_key=index)

    def __repr__(self) -> str:
        return "_EndlessSampler()"


class SamplingDataLoader(grain.DataLoader):
    """A ``grain.DataLoader`` of mixture or replay batches (endless; see :class:`SamplingIterator`).

    Each ``iter()`` builds a fresh stream, so two iterators yield the same batches.
    """

    def __init__(
        self,
        make: Callable[[int, int], Stream],
        *,
        description: str,
        operations: Sequence[Any],
        worker_count: int,
        worker_buffer_size: int,
        shard_options: Any,
        read_options: grain.ReadOptions,
        limiter: RateLimiter | None = None,
    ) -> None:
        ops = list(operations)
        bad = [op for op in ops if not isinstance(op, grain.transforms.Map)]
        if bad:
            raise InvalidSamplingError(
                f"A mixture or replay loader applies grain.transforms.Map operations only; got "
                f"{bad}. Fix: batch-level maps only (the loader already batches)."
            )
        super().__init__(
            data_source=_Description(description),
            sampler=_EndlessSampler(),
            operations=ops,
            worker_count=worker_count,
            worker_buffer_size=worker_buffer_size,
            shard_options=shard_options,
            read_options=read_options,
        )
        self._make_stream = make
        self.sampling = description  # what it samples; sharded_device_put names it
        self._maps = ops
        self._workers = worker_count
        self._buffer = max(1, worker_buffer_size)
        self._threads = int(read_options.num_threads)
        # A rate limit's: holds the writers from now on; the first iterator takes it over.
        self._limiter = limiter

    def __iter__(self) -> SamplingIterator:
        return SamplingIterator(
            self._make_stream(self._workers, self._buffer),
            maps=self._maps,
            worker_count=self._workers,
            worker_buffer_size=self._buffer,
            read_threads=self._threads,
            take_over=self._limiter,
        )


class _DatasetIterator(grain.DatasetIterator):
    """grain ``DatasetIterator`` over a :class:`SamplingIterator` (state as a dict)."""

    def __init__(self, inner: SamplingIterator) -> None:
        super().__init__()
        self._inner = inner

    def __next__(self) -> Any:
        return next(self._inner)

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self._inner.get_state())
        return state

    def get_state_at(self, position: int) -> dict[str, Any]:
        """See :meth:`SamplingIterator.get_state_at`."""
        state: dict[str, Any] = json.loads(self._inner.get_state_at(position))
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self._inner.set_state(json.dumps(state).encode())

    def update_priorities(self, index: Any, priorities: Any, **kwargs: Any) -> None:
        """See :meth:`SamplingIterator.update_priorities`."""
        self._inner.update_priorities(index, priorities, **kwargs)

    def priority_state(self) -> dict[str, np.ndarray]:
        """See :meth:`SamplingIterator.priority_state`."""
        return self._inner.priority_state()

    def set_priority_state(self, state: Mapping[str, Any]) -> None:
        """See :meth:`SamplingIterator.set_priority_state`."""
        self._inner.set_priority_state(state)

    def refresh(self) -> None:
        """See :meth:`SamplingIterator.refresh`."""
        self._inner.refresh()

    @property
    def position(self) -> int:
        return self._inner.position


class SamplingIterDataset(grain.IterDataset):
    """A ``grain.IterDataset`` of mixture or replay batches, read in the iterating process."""

    def __init__(
        self,
        make: Callable[[int, int], Stream],
        description: str,
        limiter: RateLimiter | None = None,
    ) -> None:
        super().__init__()
        self._make_stream = make
        self._description = description
        self._limiter = limiter  # as SamplingDataLoader's

    def __iter__(self) -> _DatasetIterator:
        return _DatasetIterator(SamplingIterator(self._make_stream(0, 1), take_over=self._limiter))

    def __str__(self) -> str:
        return self._description


def make_sampling_loader(source: Any, args: LoaderArguments) -> SamplingDataLoader:
    """``make_data_loader`` for a mixture (a mapping of sources) or a replay ``sampling``."""
    worker_count = args.worker_count
    if isinstance(worker_count, bool) or not isinstance(worker_count, int) or worker_count < 0:
        raise InvalidSamplingError(f"worker_count must be an int >= 0, got {worker_count!r}")
    if args.shard_options is None:
        args = dataclasses.replace(args, shard_options=default_shard_options())
    make, text, limiter = stream_factory(source, args)
    return SamplingDataLoader(
        make,
        description=text,
        operations=args.operations,
        worker_count=worker_count,
        worker_buffer_size=args.worker_buffer_size,
        shard_options=args.shard_options,
        read_options=args.read_options or default_read_options(worker_count),
        limiter=limiter,
    )


def make_sampling_dataset(source: Any, args: LoaderArguments) -> SamplingIterDataset:
    """``replay_dataset`` for a mixture or a replay ``sampling``."""
    return SamplingIterDataset(*stream_factory(source, args))
