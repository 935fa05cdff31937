"""The checkpoint of a slot table (prioritized replay over a bounded or many-writer store).

A state names, per writer, its ordinal, ring, chunks and the live rows ``[lo,
hi)`` the draws saw; the id each slot holds follows from them (never stored).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.sampling.slots import owned_seqs
from grain_replay.store import parts as parts_lib

__all__ = ["STATE_VERSION", "held_ids", "parse_tables", "table_problem"]

STATE_VERSION = 2  # a plain store's PrioritySampler state is version 1


def parse_tables(state: Mapping[str, Any]) -> dict[str, Any]:
    """The writer tables of a state as int64 arrays (KeyError, TypeError, ValueError)."""
    return {
        "ordinal": np.asarray(state["writer_ordinal"], dtype=np.int64).reshape(-1),
        "ring": np.asarray(state["writer_ring"], dtype=np.int64).reshape(-1),
        "live": np.asarray(state["writer_live"], dtype=np.int64).reshape(2, -1),
        "chunks": np.asarray(state["writer_chunks"], dtype=np.int64).reshape(-1),
        "bases": np.asarray(state["chunk_base"], dtype=np.int64).reshape(-1),
    }


def table_problem(
    out: Mapping[str, Any], chunk: np.ndarray, values: np.ndarray, seen_bits: int
) -> str | None:
    """What is wrong with parsed tables over a tree of ``values``, or None."""
    k = len(out["ordinal"])
    slots = len(values)
    bases = out["bases"]
    if len(out["ring"]) != k or out["live"].shape[1] != k or len(out["chunks"]) != k:
        return f"{k} writers but tables of other lengths"
    if (out["chunks"] < 0).any() or len(bases) != int(out["chunks"].sum()):
        return f"{len(bases)} chunks but {int(out['chunks'].sum())} counted"
    sizes = np.repeat(chunk, out["chunks"])
    ends = bases + sizes
    if int(sizes.sum()) != slots:
        return f"{slots} slots but chunks covering {int(sizes.sum())}"
    if len(bases) and (
        int(bases.min()) < 0 or int(ends.max()) > slots or len(np.unique(bases)) != len(bases)
    ):
        return "chunks outside the slots"
    if (out["ring"] <= 0).any() or (out["live"][0] > out["live"][1]).any():
        return "a writer's ring or live rows out of range"
    if len(np.unique(out["ordinal"])) != k or (out["ordinal"] < 0).any():
        return "repeated writers"
    if seen_bits < slots:
        return "bad priorities or handed-out bits"
    return None


def held_ids(
    out: Mapping[str, Any],
    chunk: np.ndarray,
    values: np.ndarray,
    p: int,
    count: int,
    problems: list[str],
) -> np.ndarray:
    """The id each slot of checked tables holds: each writer's owned live rows (a
    problem found is appended to ``problems``)."""
    ids = np.full(len(values), -1, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(out["chunks"])]).astype(np.int64)
    for w, o in enumerate(out["ordinal"].tolist()):
        lo, hi = (int(x) for x in out["live"][:, w])
        seqs = owned_seqs(lo, hi, (p - o) % count, count)
        r = (seqs // count) % int(out["ring"][w])
        c = r // int(chunk[w])
        if len(seqs) > int(out["ring"][w]) or (len(c) and int(c.max()) >= out["chunks"][w]):
            problems.append(f"writer ordinal {o}: live rows outside its slots")
            return ids
        slot = out["bases"][starts[w] + c] + r % int(chunk[w])
        if (ids[slot] != -1).any():
            problems.append(f"writer ordinal {o}: two rows in one slot")
            return ids
        ids[slot] = parts_lib.make_ids(o, seqs)
    if (values[ids < 0] != 0).any():
        problems.append("a priority on an empty slot")
    return ids
