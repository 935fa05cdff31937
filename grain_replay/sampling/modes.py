"""The sampling modes ``sampling=`` accepts: a registry from the mode to its stream factories.

A sampling mode is an options object (``gr.UniformReplay()``, ``gr.PrioritizedReplay()``)
or the string ``"epochs"``. Each registers, next to its stream, the factories that make
the stream of one source and of a mixture (a mapping of sources) under it::

    @dataclasses.dataclass(frozen=True)
    class FirstRow:  # grain_replay/sampling/first_row.py: its options...
        ...

    register_sampling(FirstRow, stream=first_row_stream)  # ...and nothing elsewhere

``make_stream`` (``streams.py``) finds a mode here by the options' type (or a base of it),
or by the string itself. The registry lives in the importing process: a mode registers
when the module defining its options class is imported, which it must be before an
instance exists (unpickling one in a worker imports it too). The options objects stay
plain picklable values; the factories are never pickled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "SamplingMode",
    "Stream",
    "StreamRequest",
    "find_sampling",
    "register_sampling",
]


class Stream(Protocol):
    """What a sampling mode does in the consuming process.

    ``draw(step)`` gives batch ``step``'s task (handed to ``reader``, here or in a worker)
    and what ``finish`` adds to the data read; ``state``/``set_state`` save and restore
    the draws; ``kind`` and ``describe()`` name the mode in checkpoints and reprs.
    """

    @property
    def kind(self) -> str: ...
    @property
    def reader(self) -> Callable[[Any], Any]: ...

    def describe(self) -> dict[str, Any]: ...
    def draw(self, step: int) -> tuple[Any, Any]: ...
    def state(self) -> dict[str, Any]: ...
    def set_state(self, state: Mapping[str, Any]) -> None: ...
    def finish(self, data: Any, extra: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class StreamRequest:
    """The loader's arguments a stream is made from, checked (see ``stream_factory``).

    Attributes:
      batch_size: rows per batch in this process.
      seed: the draws' seed.
      shuffle: permute each source's epochs (a mixture under ``"epochs"``).
      shard_index: this process among ``shard_count``.
      shard_count: the processes drawing.
      lag: batches the workers may read ahead of the caller.
      workers: the loader's ``(worker_count, worker_buffer_size)`` the lag comes from.
      weights: a mixture's weights (None for one source).
      keys: the leaves a mixture's sources share (None: all).
      source_leaf: a mixture's leaf naming each row's source (None: none).
    """

    batch_size: int
    seed: int
    shuffle: bool
    shard_index: int
    shard_count: int
    lag: int
    workers: tuple[int, int] = (0, 1)
    weights: Any = None
    keys: Sequence[str] | None = None
    source_leaf: str | None = None

    def describe(self) -> dict[str, Any]:
        """What every one-source stream's description starts with."""
        return {
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shard": [self.shard_index, self.shard_count],
        }


OneSource = Callable[[Any, Any, StreamRequest], Stream]
"""``(options, source, request) -> Stream``: the stream of one source."""
Mixture = Callable[[Any, Mapping[str, Any], StreamRequest], Stream]
"""``(options, sources, request) -> Stream``: the stream of a mapping of sources
(``request.weights`` is set)."""


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """A registered mode's factories; None where it does not sample that way."""

    stream: OneSource | None = None
    mixture: Mixture | None = None


_MODES: dict[type | str, SamplingMode] = {}


def register_sampling(
    key: type | str, *, stream: OneSource | None = None, mixture: Mixture | None = None
) -> None:
    """Makes ``sampling=`` accept ``key``'s instances (or the string ``key``).

    Args:
      key: the options class (its subclasses' instances match too), or a string value.
      stream: makes the stream of one source under the options.
      mixture: makes the stream of a mapping of sources; None refuses mixtures.

    A later registration of the same ``key`` replaces the earlier one (a reloaded module).

    Raises:
      ValueError: neither factory given.
    """
    if stream is None and mixture is None:
        raise ValueError(f"register_sampling({key!r}) needs stream= or mixture=")
    _MODES[key] = SamplingMode(stream, mixture)


def find_sampling(sampling: Any) -> SamplingMode | None:
    """The registered mode of ``sampling`` (an options object or a string), or None."""
    if isinstance(sampling, str):
        return _MODES.get(sampling)
    for cls in type(sampling).__mro__:
        mode = _MODES.get(cls)
        if mode is not None:
            return mode
    return None
