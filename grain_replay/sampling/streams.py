"""Sampling modes as streams: what each batch is made of, drawn in the consuming process."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from grain_replay.errors import InvalidSamplingError
from grain_replay.sampling.mixture import MixtureSampler, Weights
from grain_replay.sampling.mixture_reader import MixtureReader
from grain_replay.sampling.priority import PrioritizedReplay, PrioritySampler, Sampled
from grain_replay.sampling.priority_slots import IdPriorityReader, SlotPrioritySampler
from grain_replay.sampling.replay import (
    IdTask,
    RowReader,
    StoreLength,
    UniformReplay,
    UniformSampler,
)
from grain_replay.sources.capabilities import ReadsIds
from grain_replay.store.parts import RowIds

__all__ = ["Stream", "make_stream"]


class Stream(Protocol):
    """What a sampling mode does in the consuming process."""

    @property
    def kind(self) -> str: ...
    @property
    def reader(self) -> Callable[[Any], Any]: ...

    def describe(self) -> dict[str, Any]: ...
    def draw(self, step: int) -> tuple[Any, Any]: ...
    def state(self) -> dict[str, Any]: ...
    def set_state(self, state: Mapping[str, Any]) -> None: ...
    def finish(self, data: Any, extra: Any) -> Any: ...


class _SelfStatedStream:
    """A stream whose sampler draws a step's rows and saves its own state; batches go as read."""

    sampler: MixtureSampler | UniformSampler

    def draw(self, step: int) -> tuple[Any, Any]:
        return self.sampler.draw(), None

    def state(self) -> dict[str, Any]:
        return self.sampler.state()

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.sampler.set_state(state)

    def finish(self, data: Any, extra: Any) -> Any:
        return data


class _MixtureStream(_SelfStatedStream):
    kind = "mixture"
    sampler: MixtureSampler

    def __init__(self, sampler: MixtureSampler, reader: MixtureReader, seed: int) -> None:
        self.sampler = sampler
        self.reader = reader
        self._seed = seed

    def describe(self) -> dict[str, Any]:
        s = self.sampler
        replay = s.replay
        return {
            # a replayed source grows: its size is no part of what must match
            "sources": list(s.names) if replay else dict(zip(s.names, s.sizes)),
            "replay": replay,
            "batch_size": s.batch_size,
            "seed": self._seed,
        }


class _ReplayStream:
    """A replay buffer's stream: its sampler, the reader of its rows, a fixed description."""

    def __init__(
        self, sampler: Any, reader: RowReader | IdPriorityReader, describe: dict[str, Any]
    ):
        self.sampler = sampler
        self.reader = reader
        self._describe = describe

    def describe(self) -> dict[str, Any]:
        return self._describe


class _UniformStream(_ReplayStream, _SelfStatedStream):
    kind = "uniform"
    sampler: UniformSampler

    def draw(self, step: int) -> tuple[Any, Any]:
        rows = self.sampler.draw()
        return self.sampler.task(rows), None  # the reader's task: rows and their bound, or ids


class _PriorityStream(_ReplayStream):
    kind = "prioritized"
    sampler: PrioritySampler

    def draw(self, step: int) -> tuple[Any, Any]:
        index, weight = self.sampler.draw(step)
        return (index, self.sampler.bound), (index, weight)

    def state(self) -> dict[str, Any]:
        return {}  # the priorities travel in priority_state()

    def set_state(self, state: Mapping[str, Any]) -> None:
        pass

    def finish(self, data: Any, extra: Any) -> Any:
        index, weight = extra
        return Sampled(data, index, weight)


class _IdPriorityStream(_PriorityStream):
    """Prioritized replay over a bounded or many-writer store: rows travel as ids, and a
    row that could not be read any more comes back named -1 with weight 0."""

    def draw(self, step: int) -> tuple[Any, Any]:
        ids, weight = self.sampler.draw(step)
        return IdTask(ids), (ids, weight)

    def bind_maps(self, maps: Sequence[Any]) -> IdPriorityReader:
        """The reader that applies ``maps`` itself (to the data, not to its mask)."""
        return IdPriorityReader(self.reader.source, maps)

    def finish(self, data: Any, extra: Any) -> Any:
        rows, ok = data
        index, weight = extra
        ok = np.asarray(ok, dtype=bool)
        if not ok.all():
            index = np.where(ok, index, -1)
            weight = np.where(ok, weight, np.float32(0))
        return Sampled(rows, np.asarray(index, dtype=np.int64).view(RowIds), weight)


def make_stream(
    source: Any,
    *,
    weights: Weights | None,
    sampling: Any,
    batch_size: int,
    seed: int,
    shuffle: bool,
    keys: Sequence[str] | None,
    source_leaf: str | None,
    shard_index: int,
    shard_count: int,
    lag: int,
) -> Stream:
    """The stream of ``source`` (a source or a mapping of them) under ``sampling``."""
    describe = {"batch_size": batch_size, "seed": seed, "shard": [shard_index, shard_count]}
    if isinstance(source, Mapping):
        if sampling != "epochs" and not isinstance(sampling, UniformReplay):
            raise InvalidSamplingError(
                f"sampling={sampling!r} replays one source; got a mapping of "
                f"{len(source)} sources. Fix: mix them with weights= and sampling='epochs' "
                "or gr.UniformReplay(), or replay one store."
            )
        if weights is None:
            raise InvalidSamplingError(
                f"A mixture of {list(source)} needs weights=, e.g. "
                f"{ {n: 1.0 for n in source} }, or a callable of the step returning one."
            )
        reader = MixtureReader(
            source,
            keys=None if keys is None else list(keys),
            source_leaf=source_leaf,
            growing=isinstance(sampling, UniformReplay),
        )
        sizes = dict(reader.sizes)  # what the reader knows the rows are drawn below
        empty = [n for n, size in sizes.items() if size == 0]
        if empty and not isinstance(sampling, UniformReplay):
            raise InvalidSamplingError(f"The mixture's sources {empty} hold no records.")
        lengths = None
        if isinstance(sampling, UniformReplay):
            lengths = [StoreLength(src, sampling.refresh_every) for src in source.values()]
        sampler = MixtureSampler(
            sizes,
            weights,
            batch_size,
            seed=seed,
            shuffle=shuffle,
            shard_index=shard_index,
            shard_count=shard_count,
            lengths=lengths,
        )
        return _MixtureStream(sampler, reader, seed)
    if weights is not None or source_leaf is not None:
        raise InvalidSamplingError(
            "weights= and source_leaf= describe a mixture: pass a mapping of sources, e.g. "
            "{'offline': a, 'online': b}."
        )
    if keys is not None:
        raise InvalidSamplingError(
            "keys= selects the leaves a mixture's sources share; for one source, open it "
            "with keys= instead."
        )
    if isinstance(sampling, UniformReplay):
        uniform = UniformSampler(source, sampling, batch_size, seed=seed, shard_index=shard_index)
        return _UniformStream(uniform, RowReader(source), {**describe, "sampling": "uniform"})
    if isinstance(sampling, PrioritizedReplay):
        by_id = isinstance(source, ReadsIds)
        prioritized = (SlotPrioritySampler if by_id else PrioritySampler)(
            source,
            sampling,
            batch_size,
            seed=seed,
            lag=lag,
            shard_index=shard_index,
            shard_count=shard_count,
        )
        return (_IdPriorityStream if by_id else _PriorityStream)(
            prioritized,
            IdPriorityReader(source) if by_id else RowReader(source),
            {**describe, "sampling": "prioritized", "alpha": sampling.alpha, "eps": sampling.eps},
        )
    raise InvalidSamplingError(
        f"sampling must be 'epochs', gr.UniformReplay() or gr.PrioritizedReplay(), got "
        f"{sampling!r}."
    )
