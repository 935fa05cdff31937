"""Episode index from end-of-episode flags: built once, vectorized, cached beside the store."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidStoreError,
    UnknownLeafError,
)
from grain_replay.rl.episode_index import EpisodeIndex
from grain_replay.sources.access import LeafAccess, local_path, save_cache
from grain_replay.sources.capabilities import HasEpisodeEnds, HasEpisodes, ManyWriterStore

__all__ = [
    "EpisodeIndex",
    "EpisodeFlags",
    "build_episode_index",
    "episode_cache_path",
    "source_episodes",
]

logger = logging.getLogger(__name__)

# Names tried, in order, when no flag key is given.
_TERMINATED_NAMES = ("terminated", "terminations", "terminals", "terminal")
_TRUNCATED_NAMES = ("truncated", "truncations", "timeouts", "timeout")
_DONE_NAMES = ("done", "dones")
# RLDS's step flags: is_last ends every episode, is_terminal the terminated ones.
_IS_LAST, _IS_TERMINAL = "is_last", "is_terminal"
# Rows of a flag leaf read at a time while building: bounds memory on huge stores.
_BLOCK_ROWS = 1 << 20
_CACHE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class EpisodeFlags:
    """Which leaves mark episode ends.

    An episode ends on a step where any given flag is set. It counts as
    terminated where ``terminated`` is set; with only ``done``, where ``done``
    is set and ``truncated`` (if given) is not. With none given,
    :meth:`resolve` looks for ``terminated``/``truncated``,
    ``terminations``/``truncations`` (Minari), ``terminals``/``timeouts``
    (D4RL), then ``done``/``dones``, then RLDS's ``is_last``/``is_terminal``.

    Examples:
      >>> EpisodeFlags(done="is_last").resolve(src.spec, src.path).keys
      ['is_last']
    """

    done: str | None = None
    terminated: str | None = None
    truncated: str | None = None

    def __post_init__(self) -> None:
        for name in ("done", "terminated", "truncated"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ArgumentTypeError(
                    f"{name}_key must be a leaf key (str) or None, got {value!r}"
                )

    @property
    def keys(self) -> list[str]:
        return [k for k in (self.done, self.terminated, self.truncated) if k is not None]

    def resolve(self, spec: Mapping[str, Any], where: str) -> EpisodeFlags:
        """These flags with defaults filled in from ``spec``'s leaves.

        Raises:
          InvalidStoreError: a named flag leaf is missing or not one value per
            step, or no flag leaf is named and none of the usual names exists.
        """
        leaves = list(spec)
        if not self.keys:
            term = next((k for k in _TERMINATED_NAMES if k in spec), None)
            trunc = next((k for k in _TRUNCATED_NAMES if k in spec), None)
            done = next((k for k in _DONE_NAMES if k in spec), None)
            if term is None and trunc is None and done is None and _IS_LAST in spec:
                terminal = _IS_TERMINAL if _IS_TERMINAL in spec else None
                return EpisodeFlags(done=_IS_LAST, terminated=terminal).resolve(spec, where)
            if term is None and trunc is None and done is None:
                raise InvalidStoreError(
                    f"{where}: no end-of-episode flag leaf found; the leaves are {leaves}. "
                    "Fix: pass done_key='<leaf>' (True on the last step of every episode), or "
                    "terminated_key=/truncated_key= for separate termination/time-limit flags."
                )
            resolved = EpisodeFlags(terminated=term, truncated=trunc) if term or trunc else (
                EpisodeFlags(done=done)
            )  # fmt: skip
        else:
            resolved = self
        for name, key in (
            ("done_key", resolved.done),
            ("terminated_key", resolved.terminated),
            ("truncated_key", resolved.truncated),
        ):
            if key is None:
                continue
            if key not in spec:
                raise UnknownLeafError(
                    f"{where}: {name}={key!r} names no leaf of the store; the leaves are "
                    f"{leaves}. Fix: pass {name}= with the flag leaf's key from that list."
                )
            if int(np.prod(spec[key].shape, dtype=np.int64)) != 1:
                raise InvalidStoreError(
                    f"{where}: flag leaf {key!r} holds {spec[key].shape} values per step; an "
                    f"end-of-episode flag has one. Fix: pass {name}= with a per-step flag leaf."
                )
        return resolved

    def tag(self) -> str:
        return json.dumps([self.done, self.terminated, self.truncated])


def source_episodes(source: Any) -> EpisodeIndex | None:
    """The episodes a step source knows itself, or None.

    An ``episodes`` attribute that is an :class:`EpisodeIndex` (Minari,
    LeRobot), or ``episode_ends``/``episode_terminated`` arrays, which stores
    below this layer (RLDS) expose without depending on it.
    """
    n = len(source)
    own = source.episodes if isinstance(source, HasEpisodes) else None
    if isinstance(own, EpisodeIndex) and own.num_steps == n:
        return own
    if not isinstance(source, HasEpisodeEnds):
        return None
    ends = source.episode_ends
    if isinstance(ends, np.ndarray) and (ends[-1] if ends.size else 0) == n:
        terminated = source.episode_terminated
        if not isinstance(terminated, np.ndarray) or terminated.shape != ends.shape:
            terminated = np.zeros(ends.shape, bool)
        return EpisodeIndex(ends, terminated)
    return None


def episode_cache_path(path: str) -> str:
    """Where the episode index of the store at ``path`` is cached."""
    if os.path.isdir(path):
        return os.path.join(path, ".episodes.npz")
    return path + ".episodes.npz"


def _fingerprint(source: Any, path: str, keys: Sequence[str]) -> str:
    """mtime, size and inode of the store and of the files that hold the flag leaves."""
    # A directory's own mtime is left out: writing the cache inside it changes it.
    candidates = [] if os.path.isdir(path) else [path]
    candidates += [os.path.join(path, "grain_replay.json"), os.path.join(path, "zarr.json")]
    locations = getattr(source, "locations", None) or {}  # a store's; a view has none
    for key in keys:
        loc = str(locations.get(key, key))
        full = loc if os.path.isabs(loc) else os.path.join(path, loc)
        candidates += [full, full + ".npy", os.path.join(full, "zarr.json")]
    out = []
    for c in dict.fromkeys(candidates):
        try:
            st = os.stat(c)
        except OSError:
            continue
        out.append([os.path.relpath(c, path), st.st_mtime_ns, st.st_size, st.st_ino])
    return json.dumps(out)


def _read_flags(
    access: LeafAccess, flags: EpisodeFlags, n: int, block_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """Episode ends and their termination flags, reading the flag leaves in blocks."""
    ends: list[np.ndarray] = []
    term: list[np.ndarray] = []
    for a in range(0, n, block_rows):
        rows = np.arange(a, min(a + block_rows, n), dtype=np.int64)
        got = {
            k: v.reshape(len(rows)) != 0
            for k, v in access.take(dict.fromkeys(flags.keys, rows)).items()
        }
        end = np.zeros(len(rows), dtype=bool)
        for v in got.values():
            end |= v
        where = np.flatnonzero(end)
        if flags.terminated is not None:
            t = got[flags.terminated][where]
        elif flags.done is not None:
            t = got[flags.done][where]
            if flags.truncated is not None:
                t &= ~got[flags.truncated][where]
        else:
            t = np.zeros(len(where), dtype=bool)
        ends.append(where + a + 1)
        term.append(t)
    if not ends:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    return np.concatenate(ends), np.concatenate(term)


def build_episode_index(
    source: Any,
    *,
    done_key: str | None = None,
    terminated_key: str | None = None,
    truncated_key: str | None = None,
    cache: bool = True,
    block_rows: int = _BLOCK_ROWS,
) -> EpisodeIndex:
    """Builds (or loads from its cache) the episode index of a step store.

    The flag leaves are read in blocks of ``block_rows`` through the source's
    leaf readers and reduced with ``np.flatnonzero``, so memory stays bounded
    on stores of any size. For a store on the local file system the index is
    cached in :func:`episode_cache_path` (beside a file store, inside a
    directory store), keyed by the flag keys, the number of steps and the
    mtime/size/inode of the files holding the flags; a stale or unreadable
    cache is rebuilt and replaced atomically.

    Args:
      source: a grain_replay source (or any object with ``spec``, ``__len__``
        and ``read_batch``) whose records are steps.
      done_key: leaf that is True on the last step of every episode.
      terminated_key: leaf that is True where an episode terminated.
      truncated_key: leaf that is True where an episode was cut by a time limit.
      cache: read and write the cache file.
      block_rows: rows of each flag leaf read at a time.

    Returns:
      The :class:`EpisodeIndex`; steps after the last flag form an open last
      episode.

    Raises:
      InvalidStoreError: no usable flag leaf (the message lists the leaves and
        the ``*_key=`` argument to pass).

    Examples:
      >>> idx = build_episode_index(gr.open_source("replay.h5"), done_key="done")
      >>> idx.num_episodes, idx.lengths.mean()
    """
    if block_rows <= 0:
        raise InvalidArgumentError(f"block_rows must be positive, got {block_rows}")
    given = EpisodeFlags(done_key, terminated_key, truncated_key)
    if not given.keys and isinstance(source, HasEpisodeEnds) and source.episode_ends is not None:
        known = source_episodes(source)  # a store that indexed its episodes itself (RLDS)
        if known is not None:
            return known
    access = LeafAccess(source)
    flags = given.resolve(access.spec, access.where)
    n = len(source)
    # A bounded store's steps are not a growing prefix (old ones are evicted): no cache.
    many_writers = isinstance(source, ManyWriterStore)
    path = local_path(source) if cache and not many_writers else None
    cache_file = fingerprint = None
    if path is not None:
        cache_file = episode_cache_path(path)
        fingerprint = _fingerprint(source, path, flags.keys)
        index = _load(cache_file, flags.tag(), n, fingerprint)
        if index is not None:
            return index
    ends, term = _read_flags(access, flags, n, block_rows)
    if many_writers:
        # Many writers: an episode never runs from one writer's rows into the next's
        # (the last, unfinished one of each writer ends, truncated, at its newest row).
        # The first episode of each writer starts at its oldest live row.
        cuts = np.asarray(source.writer_starts(), dtype=np.int64)
        cuts = np.setdiff1d(cuts[(cuts > 0) & (cuts < n)], ends)
        order = np.argsort(np.concatenate([ends, cuts]), kind="stable")
        ends = np.concatenate([ends, cuts])[order]
        term = np.concatenate([term, np.zeros(len(cuts), dtype=bool)])[order]
    index = EpisodeIndex.from_ends(ends, term, n)
    if cache_file is not None and fingerprint is not None:
        _save(cache_file, index, flags.tag(), n, fingerprint)
    return index


def _load(file: str, tag: str, n: int, fingerprint: str) -> EpisodeIndex | None:
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            if meta != {"version": _CACHE_VERSION, "flags": tag, "n": n, "fp": fingerprint}:
                logger.info("%s: episode index cache is stale; rebuilding it", file)
                return None
            return EpisodeIndex(z["ends"], z["terminated"], bool(z["open_last"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        logger.info("%s: unreadable episode index cache (%s); rebuilding it", file, e)
        return None


def _save(file: str, index: EpisodeIndex, tag: str, n: int, fingerprint: str) -> None:
    meta = json.dumps({"version": _CACHE_VERSION, "flags": tag, "n": n, "fp": fingerprint})
    arrays = {
        "ends": index.ends,
        "terminated": index.terminated,
        "open_last": np.bool_(index.open_last),
        "meta": np.str_(meta),
    }
    save_cache(file, arrays, "episode index cache", logger)
