"""Base of the sources whose records are computed from a step source's episodes."""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError
from grain_replay.rl.episodes import (
    EpisodeFlags,
    EpisodeIndex,
    build_episode_index,
    source_episodes,
)
from grain_replay.sources.access import LeafAccess
from grain_replay.sources.base import SourceSurface, as_record_index, check_indices
from grain_replay.sources.capabilities import HasEpisodeBounds
from grain_replay.store.layout import LeafSpec

__all__ = ["DerivedSource", "Spans"]


class Spans:
    """Records laid out as ``count[e]`` positions per episode, ``stride`` steps apart.

    Record ids run over episode 0's positions, then episode 1's, and so on.
    Memory is O(episodes), not O(records).
    """

    def __init__(self, first: np.ndarray, count: np.ndarray, stride: int = 1):
        self.first = np.asarray(first, dtype=np.int64)
        self.count = np.asarray(count, dtype=np.int64)
        self.stride = int(stride)
        self.cum_end = np.cumsum(self.count)
        self.total = int(self.cum_end[-1]) if self.cum_end.size else 0

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(episode, step)`` of each record id (ids in range)."""
        episode = np.searchsorted(self.cum_end, ids, side="right")
        k = ids - (self.cum_end[episode] - self.count[episode])
        return episode, self.first[episode] + k * self.stride


class DerivedSource(SourceSurface):
    """A grain random-access source over records derived from the steps of ``source``.

    The episode index is built (or loaded from its cache file) once per
    process: pickling carries the wrapped source and the options, never the
    index, a handle or array data, and the receiving process rebuilds the
    index on first read.
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {"_state": None, "_pid": None}

    def __init__(
        self,
        source: Any,
        *,
        flags: EpisodeFlags,
        episodes: EpisodeIndex | None,
        cache: bool,
    ):
        self._access = LeafAccess(source)
        self._flags = flags
        self._cache = bool(cache)
        if episodes is not None and episodes.num_steps != len(source):
            raise InvalidStoreError(
                f"{self._access.where}: episodes= covers {episodes.num_steps} steps but the "
                f"source has {len(source)}. Fix: build it from this source with "
                "gr.build_episode_index(source)."
            )
        self._given_episodes = episodes
        self._lock = threading.Lock()
        self._state: tuple[EpisodeIndex, Spans] | None = None
        self._pid: int | None = None
        self._num_records = -1
        self._num_records = self._derived()[1].total

    # -- subclass hooks -----------------------------------------------------------

    @abc.abstractmethod
    def _spans(self, index: EpisodeIndex) -> Spans:
        """The records of ``index``'s episodes."""

    @abc.abstractmethod
    def _read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """``{key: array}`` of records ``ids`` (in range, non-negative)."""

    @abc.abstractmethod
    def _options_repr(self) -> str:
        """The options part of ``repr``, deterministic."""

    # -- episodes -------------------------------------------------------------------

    def _derived(self) -> tuple[EpisodeIndex, Spans]:
        return self._per_process("_state", self._make_state)

    def _make_state(self) -> tuple[EpisodeIndex, Spans]:
        index = self._load_episodes()
        spans = self._spans(index)
        if self._num_records >= 0 and spans.total != self._num_records:
            raise InvalidStoreError(
                f"{self._access.where}: the store changed since this source was made "
                f"({spans.total} records now, {self._num_records} before). Fix: create "
                "the source again."
            )
        return index, spans

    def _load_episodes(self) -> EpisodeIndex:
        if self._given_episodes is not None:
            return self._given_episodes
        source = self._access.source
        own = source_episodes(source) if not self._flags.keys else None
        if own is not None:
            return own
        # A store whose layout knows episode ends the flags alone do not give (a flashbax
        # Vault's batch rows) hands them over as arrays.
        bounded = not self._flags.keys and isinstance(source, HasEpisodeBounds)
        found = source.episode_bounds() if bounded else None
        if found is not None:
            ends, terminated, open_last = found
            return EpisodeIndex(ends, terminated, open_last)
        return build_episode_index(
            source,
            done_key=self._flags.done,
            terminated_key=self._flags.terminated,
            truncated_key=self._flags.truncated,
            cache=self._cache,
        )

    @property
    def step_episodes(self) -> EpisodeIndex:
        """The episode index of the wrapped source's steps."""
        return self._derived()[0]

    # -- the source protocol --------------------------------------------------------

    @property
    def source(self) -> Any:
        """The wrapped step source."""
        return self._access.source

    @property
    def path(self) -> str:
        return self._access.where

    @property
    def spec(self) -> Mapping[str, LeafSpec]:
        """Leaf key -> per-record ``LeafSpec(dtype, shape)``, in tree order."""
        return dict(self._spec)

    @property
    def treedef(self) -> dict[str, Any]:
        return self._treedef

    def _set_structure(self, treedef: dict[str, Any], spec: dict[str, LeafSpec]) -> None:
        self._treedef = treedef
        self._spec = {k: spec[k] for k in tree_lib.leaf_keys(treedef)}
        self._build = tree_lib.compile_unflatten(treedef)

    def __len__(self) -> int:
        return self._num_records

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(source={self._access.source!r}, {self._options_repr()}, "
            f"num_records={self._num_records})"
        )

    def _check_indices(self, indices: Any) -> np.ndarray:
        if type(indices) is np.ndarray and indices.dtype == np.int64 and indices.ndim == 1:
            # The indices a sampler draws: in range is one reduction (negatives wrap to large
            # unsigned values), about a third of the full check.
            if indices.size and int(indices.view(np.uint64).max()) < self._num_records:  # type: ignore[call-overload, unused-ignore]
                return indices
        return check_indices(indices, len(self), f"{type(self).__name__}({self._access.where})")

    def __getitem__(self, index: int) -> Any:
        """Record ``index`` (negative counts from the end) as a tree of numpy arrays."""
        flat = self.read_flat([as_record_index(index, self)])
        return self._build({k: v[0] for k, v in flat.items()})

    def read_flat(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Like :meth:`read_batch` but returns ``{key: array}`` instead of the tree."""
        return self._read(self._check_indices(indices))

    # -- handle, pickling -----------------------------------------------------------

    @property
    def _handle(self) -> Any:
        return self._access.handle()

    @property
    def _opens(self) -> int:
        return self._access.opens()

    def close(self) -> None:
        """Releases the wrapped source's handle; reading again reopens it."""
        self._access.close()
