"""The windowed read of a batch of sequences: one window per anchor, then the fix-ups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from grain_replay.rl._sequence_plan import Anchors, OffsetGroup, rows_plan
from grain_replay.sources.access import LeafAccess

__all__ = ["read_windowed"]


def read_windowed(
    groups: Sequence[OffsetGroup],
    access: LeafAccess,
    spans: Anchors,
    ids: np.ndarray,
    pad: str,
    into: Mapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The leaves and the groups' masks of a batch of a grain_replay source with a
    windowed group (see ``SequenceDataSource._group_plans``).

    A windowed group's anchors read the window of its offsets' steps, from
    ``t + offsets[0]``, ``K`` rows: every windowed leaf of the batch in one
    ``LeafAccess.take_windows_fixed``. The anchors' codes (:class:`FixTables`,
    one lookup) give each group's mask, and the few anchors whose offsets
    reach past their episode (about 6% at 16 offsets and episodes of 50-500
    steps) are fixed up in the same read: each of their positions takes the
    window's row of its clipped step (which lies inside the window, as the
    offsets hold the anchor); on a memory-mapped leaf with numba, window and
    fix-up are one compiled copy (``sources/reading/windows.py``). A
    window that would leave the store (first or last episode) starts inside
    it. Other groups read their rows as before; with ``into`` (leaf key -> the
    ``(B, K, ...)`` array of a ``read_into``), their leaves named in it are
    gathered straight into it and not returned; windowed leaves named in it
    are returned. Leaves not named are not read.
    """
    episode, t = (None, ids) if spans.every_step else spans.locate(ids)
    b, n = len(t), spans.num_steps
    fix = spans.fix if pad != "drop" else None
    near = None
    if fix is not None:
        codes, near = fix.codes(t)
        if near.size:
            code = codes[near]
            top = int(code.max())
            at_edge = bool(fix.edges.size) and top >= fix.first_edge
        else:
            near = None
    windows: dict[str, tuple[np.ndarray, int, np.ndarray | None, np.ndarray | None]] = {}
    # Per group: (its (B, K) rows and mask) or, windowed, (its (B,) window starts and mask),
    # and the rows of the window read that its near anchors take.
    plans: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
    for g, group in enumerate(groups):
        k = len(group.offsets)
        if not group.windowed or n < k:
            if episode is None:
                episode = spans.ends.searchsorted(t, side="right")
            plans.append((*rows_plan(group, t, episode, spans, pad), None))
            continue
        off = group.first
        start = t + off if off else t
        tables = None if fix is None else fix.tables[g]
        at = None
        if tables is None:
            mask = np.zeros((b, k), bool)
        else:
            # take: about 4x faster than fancy indexing for these (B, K) rows.
            mask = tables[1].take(codes, axis=0)
            if near is not None:
                if top >= tables[3]:
                    at = tables[0].take(code, axis=0)
                if at_edge and tables[2]:
                    start = start.copy() if start is t else start
                    np.clip(start, 0, n - k, out=start)
        plans.append((start, mask, at))
        for key in group.keys:
            if into is None or key in into:
                windows[key] = (start, k, near if at is not None else None, at)
    got = access.take_windows_fixed(windows)
    masks = []
    for group, (rows, mask, _) in zip(groups, plans):
        masks.append(mask)
        if rows.ndim == 2:
            if into is None:
                got.update(access.take(dict.fromkeys(group.keys, rows)))
            else:
                access.take_into({k: (rows, into[k]) for k in group.keys if k in into})
    return got, masks
