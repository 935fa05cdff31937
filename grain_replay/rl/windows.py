"""Windows of consecutive steps that stay inside one episode, as a random-access grain source."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.errors import ArgumentTypeError, InvalidArgumentError
from grain_replay.rl._derived import DerivedSource, Spans
from grain_replay.rl.episodes import EpisodeFlags, EpisodeIndex
from grain_replay.sources.access import with_entries
from grain_replay.store.layout import LeafSpec

__all__ = ["WindowDataSource", "WindowOptions"]

_LEAF = {"type": "leaf"}


@dataclasses.dataclass(frozen=True)
class WindowOptions:
    """Shape of the windows: validated once.

    Attributes:
      length: steps per window (T).
      stride: steps between the starts of consecutive windows of an episode.
      pad: also include windows that run past the episode end, padded by
        repeating the episode's last step.
      mask_key: name of the added ``(T,)`` bool leaf with ``pad=True``.
    """

    length: int
    stride: int = 1
    pad: bool = False
    mask_key: str = "mask"

    def __post_init__(self) -> None:
        for name in ("length", "stride"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise InvalidArgumentError(f"{name} must be positive, got {value}")
        if not isinstance(self.pad, bool):
            raise ArgumentTypeError(f"pad must be a bool, got {self.pad!r}")
        if not isinstance(self.mask_key, str) or not self.mask_key or "/" in self.mask_key:
            raise InvalidArgumentError(
                f"mask_key must be a non-empty name without '/', got {self.mask_key!r}"
            )


class WindowDataSource(DerivedSource):
    """Every window of ``length`` consecutive steps inside one episode, as one record.

    Windows start at steps ``start + k * stride`` of each episode. Without
    ``pad``, only windows that end inside the episode are records (an episode
    shorter than ``length`` gives none); with ``pad=True`` every such start is
    a record and steps past the episode's end repeat its last step, marked
    False in the added ``mask`` leaf. Records are ordered by episode, then by
    start.

    A batch of B windows is read with one vectorized read per leaf of the
    wrapped source (B * T rows, gathered at once) and reshaped to
    ``(B, T, ...)``.

    Episodes come from ``episodes=``, else from the source itself when it
    knows them (``MinariDataSource``, ``TransitionDataSource``), else from the
    end-of-episode flag leaves (see :func:`build_episode_index`, cached beside
    the store).

    Args:
      source: a step source: any grain_replay source (or an object with
        ``spec``, ``__len__`` and ``read_batch``); it is pickled with this one.
      length: steps per window (T).
      stride: steps between window starts within an episode.
      pad: include windows that run past the episode end (see above).
      keys: leaves (or groups) of the source to put in the windows; default all.
      mask_key: name of the padding mask leaf added with ``pad=True``.
      done_key: leaf that is True on the last step of every episode.
      terminated_key: leaf that is True where an episode terminated.
      truncated_key: leaf that is True where an episode hit a time limit.
      episodes: a prebuilt :class:`EpisodeIndex` of the source's steps.
      cache: read/write the episode index cache file.

    Raises:
      InvalidStoreError: no end-of-episode flag leaf (the message names the
        ``*_key=`` to pass), unknown ``keys``, or ``mask_key`` already a leaf.
      ValueError: ``length`` or ``stride`` not positive.

    Examples:
      >>> windows = gr.WindowDataSource(gr.open_source("replay.h5"), length=8)
      >>> batch = windows.read_batch([0, 5])  # batch["obs"].shape == (2, 8, ...)
    """

    def __init__(
        self,
        source: Any,
        length: int,
        stride: int = 1,
        pad: bool = False,
        keys: Sequence[str] | str | None = None,
        *,
        mask_key: str = "mask",
        done_key: str | None = None,
        terminated_key: str | None = None,
        truncated_key: str | None = None,
        episodes: EpisodeIndex | None = None,
        cache: bool = True,
    ):
        self.options = WindowOptions(length, stride, pad, mask_key)
        flags = EpisodeFlags(done_key, terminated_key, truncated_key)
        super().__init__(source, flags=flags, episodes=episodes, cache=cache)
        self._leaves, treedef = self._access.select(keys)
        t = self.options.length
        spec = {k: LeafSpec(s.dtype, (t, *s.shape)) for k, s in self._access.spec.items()}
        if pad:
            treedef = with_entries(treedef, [(mask_key, dict(_LEAF))], self._access.where)
            spec[mask_key] = LeafSpec(np.dtype(bool), (t,))
        self._set_structure(treedef, spec)

    def _spans(self, index: EpisodeIndex) -> Spans:
        o = self.options
        lengths = index.lengths
        if o.pad:
            count = -(-lengths // o.stride)
        else:
            count = np.where(lengths >= o.length, (lengths - o.length) // o.stride + 1, 0)
        return Spans(index.starts, count, o.stride)

    def _options_repr(self) -> str:
        o = self.options
        return (
            f"length={o.length}, stride={o.stride}, pad={o.pad}, keys={self._leaves!r}, "
            f"episodes={self._given_episodes!r}"
        )

    def window_steps(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step ids each window reads, and which of them are real steps.

        Args:
          indices: window (record) indices; negatives count from the end.

        Returns:
          ``(steps, mask)``, both ``(B, T)``: the wrapped source's step ids
          (padding repeats the episode's last step) and False on padding.

        Raises:
          RecordIndexError: an index is outside ``[-N, N)``.
        """
        return self._steps(self._check_indices(indices))

    def _steps(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        index, spans = self._derived()
        episode, start = spans.locate(ids)
        steps = start[:, None] + np.arange(self.options.length, dtype=np.int64)
        last = index.ends[episode][:, None] - 1
        mask = steps <= last
        if self.options.pad:
            steps = np.minimum(steps, last)
        return steps, mask

    def _read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        steps, mask = self._steps(ids)
        out = self._access.take(dict.fromkeys(self._leaves, steps))
        if self.options.pad:
            out[self.options.mask_key] = mask
        return out
