"""The arrays every prioritized sampler's checkpoint holds, whatever its slots.

A state is a dict of numpy arrays: ``version`` (1: a plain store's rows, 2: a
bounded or many-writer store's slot table), ``shard``, ``options`` (alpha, eps,
lag), ``n``, the tree's ``values``, ``max_priority``, the handed-out bits
``seen`` and the queued updates (``pending_*``); the slot map adds its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from grain_replay.errors import ReplayCheckpointError

__all__ = ["KINDS", "parse_common", "pending_updates"]

KINDS = {1: "a plain store", 2: "a bounded or many-writer store"}


def parse_common(
    state: Mapping[str, Any], not_a_state: Callable[[Exception, Mapping[str, Any]], str]
) -> dict[str, Any]:
    """The common arrays of ``state``, checked for consistency (nothing changes).

    Raises:
      ReplayCheckpointError: a key is missing or does not convert (the message is
        ``not_a_state``'s), or the tree or the pending updates are inconsistent.
    """
    try:
        out: dict[str, Any] = {
            "version": int(state["version"]),
            "shard": np.asarray(state["shard"]).tolist(),
            "options": np.asarray(state["options"]).tolist(),
            "n": int(state["n"]),
            "values": np.asarray(state["values"], dtype=np.float64).reshape(-1),
            "max": float(state["max_priority"]),
            "seen": np.asarray(state["seen"], dtype=np.uint8).reshape(-1),
            "stamps": np.asarray(state["pending_stamp"], dtype=np.int64).reshape(-1),
            "counts": np.asarray(state["pending_count"], dtype=np.int64).reshape(-1),
            "index": np.asarray(state["pending_index"], dtype=np.int64).reshape(-1),
            "prio": np.asarray(state["pending_priority"], dtype=np.float64).reshape(-1),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayCheckpointError(not_a_state(e, state)) from e
    out["seen_bits"] = 8 * len(out["seen"])
    values, counts = out["values"], out["counts"]
    if not np.isfinite(values).all() or (values < 0).any():
        raise ReplayCheckpointError(
            "The priority state's tree holds values that are negative, NaN or infinite. "
            "Fix: pass it unchanged."
        )
    index, prio, stamps = out["index"], out["prio"], out["stamps"]
    if (
        (counts < 0).any()
        or int(counts.sum()) != len(index)
        or len(index) != len(prio)
        or len(stamps) != len(counts)
    ):
        raise ReplayCheckpointError(
            f"The priority state's pending updates are inconsistent ({len(stamps)} stamps, "
            f"{len(counts)} counts summing to {int(counts.sum())}, {len(index)} rows, "
            f"{len(prio)} priorities). Fix: pass it unchanged."
        )
    return out


def pending_updates(common: Mapping[str, Any]) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(stamp, saved index, priorities)`` of each queued update of a parsed state."""
    counts = common["counts"]
    for stamp, end, count in zip(common["stamps"], np.cumsum(counts), counts):
        yield int(stamp), common["index"][end - count : end], common["prio"][end - count : end]
