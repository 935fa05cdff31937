"""What a stream replays, found through its sampler: the store, its watermarks, priorities."""

from __future__ import annotations

from typing import Any

from grain_replay.errors import InvalidSamplingError
from grain_replay.sampling.iterator_state import check_store, store_watermark
from grain_replay.sampling.mixture import MixtureSampler
from grain_replay.sampling.priority import PrioritySampler
from grain_replay.sampling.replay import UniformSampler
from grain_replay.sampling.store_length import StoreLength
from grain_replay.sampling.streams import Stream
from grain_replay.store.watermark import Watermark

__all__ = [
    "check_watermarks",
    "mixture_lengths",
    "mixture_watermarks",
    "priority_sampler",
    "refresh_stream",
    "replayed_source",
    "stream_watermark",
]


def replayed_source(stream: Stream) -> Any:
    """The one store a uniform or prioritized stream replays (None for mixtures)."""
    sampler = getattr(stream, "sampler", None)
    if isinstance(sampler, (UniformSampler, PrioritySampler)):
        return sampler.source
    return None


def stream_watermark(stream: Stream) -> Watermark | None:
    """The rows the stream's sampler draws from, as the store's writers count them (None:
    not a replay of one store)."""
    source = replayed_source(stream)
    if source is None:
        return None
    return store_watermark(stream.sampler, source)  # type: ignore[attr-defined]


def mixture_lengths(stream: Stream) -> dict[str, StoreLength] | None:
    """A replay mixture's sources' lengths by name (None: not a mixture with replay)."""
    sampler = getattr(stream, "sampler", None)
    if not isinstance(sampler, MixtureSampler) or sampler.lengths is None:
        return None
    return dict(zip(sampler.names, sampler.lengths))


def mixture_watermarks(stream: Stream) -> dict[str, Watermark] | None:
    """A replay mixture's watermark of each source, by name (None: not a mixture with
    replay): the offline sources' committed length, the online stores' writers."""
    lengths = mixture_lengths(stream)
    if lengths is None:
        return None
    return {name: store_watermark(n, n.source) for name, n in lengths.items()}


def check_watermarks(
    stream: Stream, saved: Watermark | None, saved_mixture: dict[str, Watermark] | None
) -> None:
    """A checkpoint's watermarks (of the one store, or by source name of a replay mixture)
    name the stores ``stream`` replays, which still hold the rows they cover.

    Raises:
      ReplayCheckpointError: another store, or rows the checkpoint replayed are gone
        (see :func:`~grain_replay.sampling.iterator_state.check_store`).
    """
    if saved is not None:
        check_store(saved, stream_watermark(stream), replayed_source(stream))
    if saved_mixture is not None:
        lengths = mixture_lengths(stream) or {}
        for name, mark in sorted(saved_mixture.items()):
            if name in lengths:  # the sources' names are part of what must match
                n = lengths[name]
                check_store(mark, store_watermark(n, n.source), n.source)


def priority_sampler(stream: Stream) -> PrioritySampler:
    """The prioritized sampler of ``stream``.

    Raises:
      InvalidSamplingError: the stream does not sample with priorities.
    """
    sampler = getattr(stream, "sampler", None)
    if not isinstance(sampler, PrioritySampler):
        raise InvalidSamplingError(
            f"This loader samples with {stream.kind!r}; priorities exist only with "
            "sampling=gr.PrioritizedReplay(). Fix: make the loader with "
            "sampling=gr.PrioritizedReplay(...), or drop the priority calls."
        )
    return sampler


def refresh_stream(stream: Stream) -> None:
    """Has the stream look for newly committed rows before its next draw.

    Raises:
      InvalidSamplingError: the stream does not replay (epochs have a fixed length).
    """
    sampler = getattr(stream, "sampler", None)
    if isinstance(sampler, MixtureSampler) and sampler.replay:
        sampler.refresh()
        return
    if not isinstance(sampler, (UniformSampler, PrioritySampler)):
        raise InvalidSamplingError(
            f"refresh() applies to UniformReplay and PrioritizedReplay (and mixtures under "
            f"UniformReplay); this loader samples with {stream.kind!r}, whose sources have a "
            "fixed length. Fix: sampling=gr.UniformReplay() to replay a growing store, or "
            "drop the refresh() call."
        )
    sampler.refresh()
