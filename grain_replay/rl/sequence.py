"""Sequences around anchor steps: per-key time offsets, frame stacks, action chunks, pad masks."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.rl._derived import DerivedSource, Spans
from grain_replay.rl._sequence_plan import Anchors, FixTables, OffsetGroup, offset_groups, rows_plan
from grain_replay.rl._sequence_windows import read_windowed
from grain_replay.rl.episodes import EpisodeFlags, EpisodeIndex
from grain_replay.rl.sequence_spec import (
    PAD_MODES,
    PAD_SUFFIX,
    TOLERANCE_S,
    check_leaves,
    sequence_offsets,
    sequence_treedef,
)
from grain_replay.sources import ReplaySource
from grain_replay.sources.access import LeafAccess
from grain_replay.sources.capabilities import Refreshable
from grain_replay.sources.checks import check_out
from grain_replay.store.layout import LeafSpec

__all__ = ["SequenceDataSource", "PAD_MODES", "PAD_SUFFIX", "TOLERANCE_S"]


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
    the step source, never one per offset or per anchor. A grain_replay source
    is asked for the B x K rows at once: its readers fetch (and decode) each
    distinct chunk or page once per batch and copy repeated rows, which
    measured faster than reading the deduplicated rows and gathering them
    again in memory. Any other source (read with ``read_batch``, whose rows
    may cost work each) is asked for the union of the rows once, and the
    batch is gathered from it in memory.

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
      done_key: the leaf flagging each episode's last step (default: found by name,
        see :class:`EpisodeFlags`).
      terminated_key: the leaf flagging terminations (default: found by name).
      truncated_key: the leaf flagging truncations (default: found by name).
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

    Examples:
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
        if fps is None:
            fps = getattr(steps, "fps", None)
        steps_of, self._seconds, self._fps = sequence_offsets(
            offsets, delta_timestamps, fps, pad, where
        )
        check_leaves(access, steps_of)
        self._pad = pad
        # In the step source's leaf order, which is also the output order.
        self._offsets = {k: np.asarray(steps_of[k], np.int64) for k in access.spec if k in steps_of}
        # grain_replay sources read one leaf at chosen rows; others read every leaf per row.
        self._per_leaf = isinstance(steps, ReplaySource)
        # Leaves with equal offsets share one (B, K) plan per batch (and the windows' choice).
        self._groups = offset_groups(self._offsets, access.spec, self._per_leaf, pad)
        # Leaf (in the step source's order, the output's) -> (its group, first leaf of it).
        self._group_of = {
            key: (g, key == group.keys[0])
            for g, group in enumerate(self._groups)
            for key in group.keys
        }
        self._group_of = {key: self._group_of[key] for key in self._offsets}
        every = np.concatenate([g.offsets for g in self._groups])
        # The anchor itself counts: records are steps of their episode.
        self._lo = min(int(every.min()), 0)
        self._hi = max(int(every.max()), 0)
        treedef = sequence_treedef(access.treedef, set(self._offsets), where)
        spec: dict[str, LeafSpec] = {}
        for key, off in self._offsets.items():
            leaf = access.spec[key]
            spec[key] = LeafSpec(leaf.dtype, (len(off), *leaf.shape))
            spec[key + PAD_SUFFIX] = LeafSpec(np.dtype(bool), (len(off),))
        self._windowed = any(g.windowed for g in self._groups)
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
            first = index.starts - self._lo
            count = np.maximum(lengths - (self._hi - self._lo), 0)
        else:
            first, count = index.starts, lengths.copy()
            if index.open_last and count.size:
                # The unfinished episode: no anchor reaches past the committed rows.
                count[-1] = max(int(count[-1]) - self._hi, 0)
        fix = FixTables(self._groups, index) if self._windowed and self._pad != "drop" else None
        return Anchors(first, count, index, fix)

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
        out = {}
        for group, rows, is_pad in self._group_plans(ids):
            for key in group.keys:
                out[key] = (rows, is_pad)
        return out

    def _group_plans(self, ids: np.ndarray) -> list[tuple[OffsetGroup, np.ndarray, np.ndarray]]:
        """Per distinct offset list: ``(group, rows, is_pad)``, both ``(B, K)`` and C-ordered.

        A handful of vectorized operations per batch (no loop over anchors or
        offsets): the anchors' episodes by one binary search, then per list the
        ``(B, K)`` matrix of steps, clipped to the episode only on the side its
        offsets reach. The matrices are built from contiguous ``B * K`` vectors
        (each anchor repeated K times, plus the offsets tiled B times): numpy's
        broadcast of a ``(B, 1)`` against a ``(K,)`` array runs its inner loop B
        times over K elements, three times slower at B=256, K=16.
        """
        spans = cast(Anchors, self._derived()[1])
        episode, t = spans.locate(ids)
        return [(group, *rows_plan(group, t, episode, spans, self._pad)) for group in self._groups]

    def _read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        if self._windowed:
            spans = cast(Anchors, self._derived()[1])
            got, masks = read_windowed(self._groups, self._access, spans, ids, self._pad)
            return self._finish(got, masks)
        plans = self._group_plans(ids)
        if self._per_leaf:
            # The B x K positions in one read per leaf: the readers fetch and decode each
            # distinct chunk (or page) once per batch, and a repeated row costs them one copy,
            # which is what a gather from a deduplicated read would cost on top of that read.
            got = self._access.take({k: rows for group, rows, _ in plans for k in group.keys})
        else:
            # A source read with read_batch may do work per row: read the union once, gather.
            union, inverse = np.unique(
                np.concatenate([rows.reshape(-1) for _, rows, _ in plans]), return_inverse=True
            )
            read = self._access.take(dict.fromkeys(self._offsets, union))
            got, at = {}, 0
            for group, rows, _ in plans:
                where = inverse[at : at + rows.size].reshape(rows.shape)
                at += rows.size
                for k in group.keys:
                    got[k] = np.take(read[k], where, axis=0)
        return self._finish(got, [is_pad for _, _, is_pad in plans])

    def read_into(
        self,
        indices: Sequence[int] | np.ndarray,
        out: Mapping[str, np.ndarray],
        *,
        check: bool = True,
    ) -> None:
        """Reads records ``indices`` of the leaves and masks named in ``out`` into those
        arrays (see :meth:`SourceSurface.read_into`; a loader's workers read each batch
        into their shared slot so).

        On a grain_replay step source, a leaf read at rows (not as windows: images,
        and any leaf whose offsets are not one run holding the anchor) is gathered by the
        source straight into its ``out``: a batch of action chunks with the current
        frames decodes or reads its cached frames into the slot, no batch of frames
        allocated (its pages faulted in) and copied. Windowed leaves (the action chunks)
        and masks are copied in; ``pad="zero"`` zeros the padded positions in place.
        Leaves not named are not read.
        """
        ids = self._check_indices(indices)
        if check:
            check_out(out, self.spec, len(ids), repr(self))
        if not self._per_leaf:
            super().read_into(ids, out, check=False)
            return
        if self._windowed:
            spans = cast(Anchors, self._derived()[1])
            got, masks = read_windowed(self._groups, self._access, spans, ids, self._pad, out)
        else:
            plans = self._group_plans(ids)
            self._access.take_into(
                {k: (rows, out[k]) for group, rows, _ in plans for k in group.keys if k in out}
            )
            got, masks = {}, [is_pad for _, _, is_pad in plans]
        for key, (g, _) in self._group_of.items():
            mask = masks[g]
            dst = out.get(key)
            if dst is not None:
                values = got.get(key)
                if values is not None:
                    dst[...] = values
                if self._pad == "zero" and mask.any():
                    dst[mask] = 0
            dst = out.get(key + PAD_SUFFIX)
            if dst is not None:
                dst[...] = mask

    def _finish(self, got: dict[str, np.ndarray], masks: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The output of the leaves read (``got``) and their groups' masks, zeros padded."""
        out: dict[str, np.ndarray] = {}
        for key, (g, first) in self._group_of.items():
            is_pad = masks[g]
            # Each leaf owns its mask: the group's first leaf takes the plan's, others copy it.
            mask = is_pad if first else is_pad.copy()
            values = got[key]
            if self._pad == "zero" and mask.any():
                if not values.flags.writeable:
                    values = values.copy()
                values[mask] = 0
            out[key] = values
            out[key + PAD_SUFFIX] = mask
        return out

    # -- growing stores -------------------------------------------------------------

    def refresh(self, episodes: EpisodeIndex | None = None) -> int:
        """Picks up rows committed to the step store since; returns the new number of records.

        Calls the step source's ``refresh()`` (when it has one), rebuilds the
        episode index and the records. Records already seen keep their index
        and content; new ones follow them (see the class docs on unfinished
        episodes). A loader made before keeps sampling the records it was
        made with (its workers hold a copy of this view): make a new one to
        sample the new records.

        Args:
          episodes: the new :class:`EpisodeIndex` of the steps; needed when
            the view was made with ``episodes=`` and the store grew.

        Raises:
          InvalidStoreError: the view was made with ``episodes=``, the store
            grew and no new index was given, or it covers another length.
        """
        source = self._access.source
        if isinstance(source, Refreshable):
            source.refresh()
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
