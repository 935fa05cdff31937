"""Sequences around anchor steps: per-key time offsets, frame stacks, action chunks, pad masks."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import ArgumentTypeError, InvalidArgumentError, InvalidStoreError
from grain_replay.layout import LeafSpec
from grain_replay.rl._access import LeafAccess
from grain_replay.rl._derived import DerivedSource, Spans
from grain_replay.rl.episodes import EpisodeFlags, EpisodeIndex

__all__ = ["SequenceDataSource", "PAD_MODES", "PAD_SUFFIX", "TOLERANCE_S"]

PAD_MODES = ("edge", "zero", "drop")
# The mask of leaf "obs/pixels" is "obs/pixels_is_pad" (LeRobot's convention).
PAD_SUFFIX = "_is_pad"
# How far (seconds) a delta timestamp may lie from a frame: LeRobot's default tolerance_s.
TOLERANCE_S = 1e-4
_LEAF = {"type": "leaf"}


def _offsets_in_steps(offsets: Any, where: str) -> dict[str, tuple[int, ...]]:
    """``offsets`` validated: leaf key -> tuple of int steps."""
    out: dict[str, tuple[int, ...]] = {}
    for key, values in _entries(offsets, "offsets", where).items():
        steps = []
        for v in values:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
                raise ArgumentTypeError(
                    f"{where}: offsets[{key!r}] holds {v!r}, which is not a whole number of "
                    "steps. Fix: give offsets in steps as ints (e.g. range(-3, 1)), or offsets "
                    "in seconds as delta_timestamps= with fps=."
                )
            steps.append(int(v))
        out[key] = tuple(steps)
    return out


def _offsets_from_seconds(
    delta_timestamps: Any, fps: float, where: str
) -> dict[str, tuple[int, ...]]:
    """LeRobot's rule: offset = round(dt * fps); a dt over TOLERANCE_S off a frame is refused."""
    out: dict[str, tuple[int, ...]] = {}
    for key, values in _entries(delta_timestamps, "delta_timestamps", where).items():
        steps = []
        for dt in values:
            if isinstance(dt, (bool, np.bool_)) or not isinstance(dt, numbers.Real):
                raise ArgumentTypeError(
                    f"{where}: delta_timestamps[{key!r}] holds {dt!r}, which is not a number of "
                    "seconds. Fix: give a list of floats, e.g. [-0.1, 0.0]."
                )
            if not math.isfinite(float(dt)):
                raise InvalidArgumentError(
                    f"{where}: delta_timestamps[{key!r}] holds {dt!r}. Fix: give finite seconds."
                )
            frames = float(dt) * fps
            k = round(frames)
            if abs(frames - k) / fps > TOLERANCE_S:
                raise InvalidArgumentError(
                    f"{where}: delta_timestamps[{key!r}] holds {dt!r} s, which is not a frame at "
                    f"fps={fps!r} (nearest: {k} steps = {k / fps!r} s; tolerance "
                    f"{TOLERANCE_S} s). Fix: use multiples of 1/fps = {1 / fps!r} s, or the "
                    "right fps=."
                )
            steps.append(int(k))
        out[key] = tuple(steps)
    return out


def _entries(mapping: Any, name: str, where: str) -> dict[str, list[Any]]:
    if not isinstance(mapping, Mapping):
        raise ArgumentTypeError(
            f"{where}: {name}= must be a mapping from leaf key to a list, got "
            f"{type(mapping).__name__}. Fix: e.g. {name}={{'obs': [-1, 0], 'action': [0, 1]}}."
        )
    if not mapping:
        raise InvalidArgumentError(
            f"{where}: {name}= is empty, so nothing would be read. Fix: name at least one leaf, "
            f"e.g. {name}={{'obs': [0]}}."
        )
    out: dict[str, list[Any]] = {}
    for key, values in mapping.items():
        if not isinstance(key, str):
            raise ArgumentTypeError(
                f"{where}: {name}= has the key {key!r}; keys are leaf keys (str) such as "
                "'obs/pixels'."
            )
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise ArgumentTypeError(
                f"{where}: {name}[{key!r}] is {values!r}, not a list. Fix: give a list, even "
                "for one value: [0]."
            )
        values = list(values)
        if not values:
            raise InvalidArgumentError(
                f"{where}: {name}[{key!r}] is empty; a named leaf needs at least one offset. "
                "Fix: give e.g. [0], or leave the key out (it is then not read)."
            )
        out[key] = values
    return out


def _resolve_fps(fps: Any, where: str) -> float:
    if isinstance(fps, (bool, np.bool_)) or not isinstance(fps, numbers.Real):
        raise ArgumentTypeError(f"{where}: fps must be a number of frames per second, got {fps!r}")
    value = float(fps)
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgumentError(f"{where}: fps must be positive and finite, got {fps!r}")
    return value


def _check_leaves(access: LeafAccess, keys: Iterable[str]) -> None:
    leaves = list(access.spec)
    for key in keys:
        if key in access.spec:
            continue
        under = access.leaves_under(key)
        if under:
            raise InvalidArgumentError(
                f"{access.where}: the offset key {key!r} is a group, not a leaf; offsets apply "
                f"to leaves, each with its own mask. Fix: name its leaves: {under}."
            )
        raise InvalidArgumentError(
            f"{access.where}: the offset key {key!r} names no leaf of the store; the leaves are "
            f"{leaves}. Fix: pick keys from that list."
        )


def _sequence_treedef(treedef: Mapping[str, Any], named: set[str], where: str) -> dict[str, Any]:
    """The step tree pruned to ``named`` leaves, each followed by its ``<leaf>_is_pad`` mask.

    Containers become dicts (lists and tuples keyed by index), so every leaf
    keeps its key and its mask sits beside it.
    """
    if treedef["type"] == "leaf":
        raise InvalidStoreError(
            f"{where}: the steps are a single unnamed array; a sequence names its leaves and "
            "puts a mask beside each. Fix: store the steps as a dict, e.g. {'obs': ...}."
        )

    def visit(node: Mapping[str, Any], path: str) -> dict[str, Any] | None:
        kind = node["type"]
        if kind == "dict":
            names = list(node["keys"])
        elif kind == "namedtuple":
            names = list(node["fields"])
        else:
            names = [str(i) for i in range(len(node["children"]))]
        entries: list[tuple[str, dict[str, Any]]] = []
        for name, child in zip(names, node["children"]):
            key = f"{path}/{name}" if path else name
            if child["type"] == "leaf":
                if key in named:
                    entries += [(name, dict(_LEAF)), (name + PAD_SUFFIX, dict(_LEAF))]
                continue
            sub = visit(child, key)
            if sub is not None:
                entries.append((name, sub))
        if not entries:
            return None
        seen: set[str] = set()
        for name, _ in entries:
            if name in seen:
                clash = f"{path}/{name}" if path else name
                raise InvalidArgumentError(
                    f"{where}: the output would hold {clash!r} twice: a leaf of that name and "
                    f"the mask of {clash[: -len(PAD_SUFFIX)]!r}. Fix: leave one of them out of "
                    "the offsets."
                )
            seen.add(name)
        return {
            "type": "dict",
            "keys": [n for n, _ in entries],
            "children": [c for _, c in entries],
        }

    return visit(treedef, tree_lib.ROOT_KEY) or {"type": "dict", "keys": [], "children": []}


class SequenceDataSource(DerivedSource):
    """Records are anchor steps; each named leaf is read at its own time offsets around them.

    ``offsets={"obs": [-1, 0], "action": range(16), "reward": [0]}`` makes
    every record an anchor step ``t`` with ``obs`` of shape ``(2, ...)`` (steps
    ``t-1, t``), ``action`` of shape ``(16, ...)`` (steps ``t .. t+15``) and
    ``reward`` of shape ``(1,)``; beside each leaf a bool mask
    ``"<leaf>_is_pad"`` of shape ``(K,)`` is True where the offset falls
    outside the anchor's episode. Offsets of a key keep the order given
    (duplicates allowed). Leaves not named are not read. Frame stacking is
    ``offsets={"obs": [-3, -2, -1, 0]}``; action chunking
    ``offsets={"obs": [-1, 0], "action": range(16)}``.

    Padding (``pad=``), at both ends of an episode:

    * ``"edge"`` (default, LeRobot's behaviour): every step is an anchor;
      an offset before the episode's first step reads that first step, one
      past its last step reads that last step.
    * ``"zero"``: every step is an anchor; padded positions are zeros.
    * ``"drop"``: only anchors whose every offset (and the anchor itself)
      lies inside the episode are records; masks are all False. An episode
      shorter than the span of the offsets gives no record.

    Records are ordered by episode, then anchor step. Offsets in seconds:
    ``delta_timestamps={"action": [0.0, 0.1, ...]}`` with ``fps=`` (default:
    the step source's ``fps`` attribute, which LeRobot stores have) become
    ``round(dt * fps)`` steps; a ``dt`` farther than 1e-4 s (LeRobot's
    ``tolerance_s``) from a frame is refused.

    A store that is still being written (its last episode has no end flag
    yet) never yields a record that reaches past the committed rows: in that
    unfinished last episode, an anchor whose largest forward offset lies past
    the last committed step is not a record yet (it becomes one once the rows
    are committed, or padded once the episode ends). Padding at an episode's
    end is reserved for episodes that ended (terminated or truncated), so a
    record never changes after :meth:`refresh`: new rows only add records at
    the end. A finished store whose last episode has no end flag keeps those
    last anchors out too; pass ``episodes=`` (``open_last=False``) to count
    it as ended.

    A batch of B anchors is read with one vectorized read per named leaf of
    the step source: the union of the rows its offsets need (B x K positions,
    deduplicated), then a gather in memory.

    Args:
      steps: the step source: any grain_replay source (HDF5, .npy, Zarr,
        :class:`MinariDataSource`, ...) or object with ``spec``, ``__len__``
        and ``read_batch`` (then every leaf of a batch is read in one
        ``read_batch``). It is pickled with this view.
      offsets: leaf key -> offsets in steps (ints, negative = past).
      delta_timestamps: leaf key -> offsets in seconds (instead of ``offsets``).
      fps: frames per second for ``delta_timestamps``; default
        ``getattr(steps, "fps", None)``.
      pad: ``"edge"``, ``"zero"`` or ``"drop"`` (see above).
      episodes: a prebuilt :class:`EpisodeIndex` of the steps; default: the
        source's own (Minari), else built from its end-of-episode flags.
      done_key, terminated_key, truncated_key: end-of-episode flag leaves
        (default: found by name, see :class:`EpisodeFlags`).
      cache: read/write the episode index cache file beside the store.

    Raises:
      InvalidArgumentError: both or neither of ``offsets``/``delta_timestamps``,
        an empty offset list, an offset key that is not a leaf, a mask name
        that clashes, an unknown ``pad``, seconds without a frame rate, or a
        ``dt`` that is not a frame.
      ArgumentTypeError: a non-integer offset, or offsets that are not a
        mapping of lists.
      InvalidStoreError: no end-of-episode flag leaf (the message names the
        ``*_key=`` to pass), or ``episodes=`` of another length.

    Example:
      >>> seq = gr.SequenceDataSource(
      ...     gr.open_source("robot.zarr"), {"obs": [-1, 0], "action": range(16)})
      >>> b = seq.read_batch([0, 7])
      >>> b["obs"].shape[:2], b["action"].shape[:2], b["action_is_pad"].shape
      ((2, 2), (2, 16), (2, 16))
    """

    def __init__(
        self,
        steps: Any,
        offsets: Mapping[str, Iterable[int]] | None = None,
        *,
        delta_timestamps: Mapping[str, Iterable[float]] | None = None,
        fps: float | None = None,
        pad: str = "edge",
        episodes: EpisodeIndex | None = None,
        done_key: str | None = None,
        terminated_key: str | None = None,
        truncated_key: str | None = None,
        cache: bool = True,
    ):
        access = LeafAccess(steps)
        where = access.where
        if pad not in PAD_MODES:
            raise InvalidArgumentError(
                f"{where}: pad={pad!r} is not a padding mode. Fix: pass one of {list(PAD_MODES)}."
            )
        if (offsets is None) == (delta_timestamps is None):
            raise InvalidArgumentError(
                f"{where}: pass exactly one of offsets= (steps) and delta_timestamps= (seconds), "
                f"got {'both' if offsets is not None else 'neither'}."
            )
        if fps is None:
            fps = getattr(steps, "fps", None)
        self._fps = None if fps is None else _resolve_fps(fps, where)
        if delta_timestamps is not None:
            if self._fps is None:
                raise InvalidArgumentError(
                    f"{where}: delta_timestamps= gives offsets in seconds, but the step source "
                    "has no frame rate (no `fps` attribute) and fps= was not given. Fix: pass "
                    "fps=<frames per second>, or offsets= in steps."
                )
            steps_of = _offsets_from_seconds(delta_timestamps, self._fps, where)
            self._seconds: dict[str, tuple[float, ...]] | None = {
                k: tuple(float(v) for v in vs)
                for k, vs in _entries(delta_timestamps, "delta_timestamps", where).items()
            }
        else:
            steps_of = _offsets_in_steps(offsets, where)
            self._seconds = None
        _check_leaves(access, steps_of)
        self._pad = pad
        # In the step source's leaf order, which is also the output order.
        self._offsets = {k: np.asarray(steps_of[k], np.int64) for k in access.spec if k in steps_of}
        every = np.concatenate(list(self._offsets.values()))
        # The anchor itself counts: records are steps of their episode.
        self._lo = min(int(every.min()), 0)
        self._hi = max(int(every.max()), 0)
        treedef = _sequence_treedef(access.treedef, set(self._offsets), where)
        spec: dict[str, LeafSpec] = {}
        for key, off in self._offsets.items():
            leaf = access.spec[key]
            spec[key] = LeafSpec(leaf.dtype, (len(off), *leaf.shape))
            spec[key + PAD_SUFFIX] = LeafSpec(np.dtype(bool), (len(off),))
        flags = EpisodeFlags(done_key, terminated_key, truncated_key)
        super().__init__(steps, flags=flags, episodes=episodes, cache=cache)
        self._set_structure(treedef, spec)

    # -- options --------------------------------------------------------------------

    @property
    def offsets(self) -> dict[str, tuple[int, ...]]:
        """Leaf key -> its offsets in steps (converted from seconds if given so)."""
        return {k: tuple(int(x) for x in v) for k, v in self._offsets.items()}

    @property
    def delta_timestamps(self) -> dict[str, tuple[float, ...]] | None:
        """The offsets in seconds as given, or None when given in steps."""
        return None if self._seconds is None else dict(self._seconds)

    @property
    def fps(self) -> float | None:
        """Frames per second of the steps (given, or the step source's), if known."""
        return self._fps

    @property
    def pad(self) -> str:
        return self._pad

    def _options_repr(self) -> str:
        given = (
            f"delta_timestamps={self._seconds!r}, fps={self._fps!r}"
            if self._seconds is not None
            else f"offsets={self.offsets!r}"
        )
        return f"{given}, pad={self._pad!r}, episodes={self._given_episodes!r}"

    # -- records --------------------------------------------------------------------

    def _spans(self, index: EpisodeIndex) -> Spans:
        lengths = index.lengths
        if self._pad == "drop":
            # Anchors t with start <= t + lo and t + hi < end.
            return Spans(index.starts - self._lo, np.maximum(lengths - (self._hi - self._lo), 0))
        count = lengths.copy()
        if index.open_last and count.size:
            # The unfinished episode: no anchor reaches past the committed rows.
            count[-1] = max(int(count[-1]) - self._hi, 0)
        return Spans(index.starts, count)

    def anchor_steps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The step id of each record's anchor (negative indices count from the end)."""
        _, spans = self._derived()
        return spans.locate(self._check_indices(indices))[1]

    def sequence_steps(
        self, indices: Sequence[int] | np.ndarray
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The steps each record reads, per leaf, and where they are padding.

        Args:
          indices: record indices; negatives count from the end.

        Returns:
          Leaf key -> ``(steps, is_pad)``, both ``(B, K)``: the step ids read
          (clipped to the anchor's episode) and True where the offset falls
          outside it.

        Raises:
          RecordIndexError: an index is outside ``[-N, N)``.
        """
        return self._plan(self._check_indices(indices))

    def _plan(self, ids: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        index, spans = self._derived()
        episode, t = spans.locate(ids)
        first = index.starts[episode][:, None]
        last = index.ends[episode][:, None] - 1
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        done: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        for key, off in self._offsets.items():
            # Leaves with equal offsets share one row array (one read for LeafAccess' fallback).
            tag = off.tobytes()
            if tag not in done:
                pos = t[:, None] + off
                done[tag] = (np.minimum(np.maximum(pos, first), last), (pos < first) | (pos > last))
            out[key] = done[tag]
        return out

    def _read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        plan = self._plan(ids)
        # One read per leaf of the union of its rows; the batch is gathered from it in memory.
        unions: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        requests: dict[str, np.ndarray] = {}
        for key, (rows, _) in plan.items():
            if id(rows) not in unions:
                unions[id(rows)] = np.unique(rows.reshape(-1), return_inverse=True)
            requests[key] = unions[id(rows)][0]
        got = self._access.take(requests)
        out: dict[str, np.ndarray] = {}
        for key, (rows, is_pad) in plan.items():
            inverse = unions[id(rows)][1]
            values = np.take(got[key], inverse.reshape(-1), axis=0)
            values = values.reshape(rows.shape + values.shape[1:])
            if self._pad == "zero" and is_pad.any():
                values[is_pad] = 0
            out[key] = values
            out[key + PAD_SUFFIX] = is_pad.copy()
        return out

    # -- growing stores -------------------------------------------------------------

    def refresh(self, episodes: EpisodeIndex | None = None) -> int:
        """Picks up rows committed to the step store since; returns the new number of records.

        Calls the step source's ``refresh()`` (when it has one), rebuilds the
        episode index and the records. Records already seen keep their index
        and content; new ones follow them (see the class docs on unfinished
        episodes).

        Args:
          episodes: the new :class:`EpisodeIndex` of the steps; needed when
            the view was made with ``episodes=`` and the store grew.

        Raises:
          InvalidStoreError: the view was made with ``episodes=``, the store
            grew and no new index was given, or it covers another length.
        """
        source = self._access.source
        step_refresh = getattr(source, "refresh", None)
        if callable(step_refresh):
            step_refresh()
        n = len(source)
        if episodes is not None:
            if episodes.num_steps != n:
                raise InvalidStoreError(
                    f"{self._access.where}: episodes= covers {episodes.num_steps} steps but the "
                    f"source has {n}. Fix: build it from this source with "
                    "gr.build_episode_index(source)."
                )
            self._given_episodes = episodes
        elif self._given_episodes is not None and self._given_episodes.num_steps != n:
            raise InvalidStoreError(
                f"{self._access.where}: the store has {n} steps now, but the view was made with "
                f"episodes= of {self._given_episodes.num_steps}. Fix: call "
                "refresh(episodes=...) with the index of the grown store."
            )
        index = self._load_episodes()
        spans = self._spans(index)
        with self._lock:
            self._state, self._pid = (index, spans), os.getpid()
            self._num_records = spans.total
        return self._num_records
