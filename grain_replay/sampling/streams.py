"""Sampling modes as streams: what each batch is made of, drawn in the consuming process.

The built-in modes' streams, registered in ``modes.py`` (``"epochs"`` mixtures,
``UniformReplay``, ``PrioritizedReplay``), and :func:`make_stream`, which checks the
arguments every mode shares and hands the rest to the mode's registered factory. A new
mode registers its own factories next to its options class; nothing here changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidSamplingError
from grain_replay.sampling.mixture import MixtureSampler, Weights
from grain_replay.sampling.mixture_reader import MixtureReader
from grain_replay.sampling.modes import Stream, StreamRequest, find_sampling, register_sampling
from grain_replay.sampling.priority import PrioritizedReplay, PrioritySampler, Sampled
from grain_replay.sampling.priority_slots import IdPriorityReader, SlotPrioritySampler
from grain_replay.sampling.replay import IdTask, RowReader, UniformReplay, UniformSampler
from grain_replay.sampling.store_length import StoreLength
from grain_replay.sources.capabilities import ReadsIds
from grain_replay.store.parts import RowIds

__all__ = ["Stream", "StreamRequest", "make_stream", "register_sampling"]


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


def _mixture(
    sources: Mapping[str, Any], request: StreamRequest, replay: UniformReplay | None
) -> Stream:
    """A mixture's stream: each source's epochs, or (``replay``) uniform draws of each."""
    reader = MixtureReader(
        sources,
        keys=None if request.keys is None else list(request.keys),
        source_leaf=request.source_leaf,
        growing=replay is not None,
    )
    sizes = dict(reader.sizes)  # what the reader knows the rows are drawn below
    empty = [n for n, size in sizes.items() if size == 0]
    if empty and replay is None:
        raise InvalidSamplingError(f"The mixture's sources {empty} hold no records.")
    lengths = None
    if replay is not None:
        lengths = [StoreLength(src, replay.refresh_every) for src in sources.values()]
    sampler = MixtureSampler(
        sizes,
        request.weights,
        request.batch_size,
        seed=request.seed,
        shuffle=request.shuffle,
        shard_index=request.shard_index,
        shard_count=request.shard_count,
        lengths=lengths,
    )
    return _MixtureStream(sampler, reader, request.seed)


def _epochs_mixture(sampling: str, sources: Mapping[str, Any], request: StreamRequest) -> Stream:
    return _mixture(sources, request, None)


def _replay_mixture(
    sampling: UniformReplay, sources: Mapping[str, Any], request: StreamRequest
) -> Stream:
    return _mixture(sources, request, sampling)


def _uniform(sampling: UniformReplay, source: Any, request: StreamRequest) -> Stream:
    uniform = UniformSampler(
        source, sampling, request.batch_size, seed=request.seed, shard_index=request.shard_index
    )
    return _UniformStream(uniform, RowReader(source), {**request.describe(), "sampling": "uniform"})


def _prioritized(sampling: PrioritizedReplay, source: Any, request: StreamRequest) -> Stream:
    by_id = isinstance(source, ReadsIds)
    prioritized = (SlotPrioritySampler if by_id else PrioritySampler)(
        source,
        sampling,
        request.batch_size,
        seed=request.seed,
        lag=request.lag,
        workers=request.workers,
        shard_index=request.shard_index,
        shard_count=request.shard_count,
    )
    described = {**request.describe(), "sampling": "prioritized"}
    return (_IdPriorityStream if by_id else _PriorityStream)(
        prioritized,
        IdPriorityReader(source) if by_id else RowReader(source),
        {**described, "alpha": sampling.alpha, "eps": sampling.eps},
    )


register_sampling("epochs", mixture=_epochs_mixture)
register_sampling(UniformReplay, stream=_uniform, mixture=_replay_mixture)
register_sampling(PrioritizedReplay, stream=_prioritized)


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
    workers: tuple[int, int] = (0, 1),
) -> Stream:
    """The stream of ``source`` (a source or a mapping of them) under ``sampling``.

    ``sampling`` is looked up in the registry of ``modes.py``: its factory for a mapping
    of sources or for one source makes the stream.
    """
    request = StreamRequest(
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        shard_index=shard_index,
        shard_count=shard_count,
        lag=lag,
        workers=workers,
        weights=weights,
        keys=keys,
        source_leaf=source_leaf,
    )
    mode = find_sampling(sampling)
    if isinstance(source, Mapping):
        if mode is None or mode.mixture is None:
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
        return mode.mixture(sampling, source, request)
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
    if mode is None or mode.stream is None:
        raise InvalidSamplingError(
            f"sampling must be 'epochs', gr.UniformReplay() or gr.PrioritizedReplay(), got "
            f"{sampling!r}."
        )
    return mode.stream(sampling, source, request)
