"""Statistics of one store: leaf checks, the cache beside the store, appended rows merged in."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.access import LeafAccess, local_path, save_cache
from grain_replay.sources.capabilities import ReadsIds
from grain_replay.stats.accumulate import (
    SAMPLE_BYTES,
    LeafState,
    StoreState,
    scan,
    stats_cache_path,
)
from grain_replay.store.layout import LeafSpec

__all__ = ["store_state"]

logger = logging.getLogger(__name__)

_CACHE_VERSION = 1
# Seed of the quantile sample: results are reproducible run to run.
_SEED = (0x57A75,)


def store_state(
    source: Any,
    keys: Sequence[str] | str | None,
    *,
    sample_rows: int,
    block_bytes: int,
    cache: bool,
    progress: Callable[[int], None] | None,
) -> tuple[StoreState, dict[str, Any], Callable[[], None]]:
    """The mergeable statistics of ``source``'s selected leaves, their tree structure, and a
    function that writes them to the cache.

    A valid cache covering the first ``c`` rows is reused; rows ``[c, N)`` are
    read and pooled into it. The returned function rewrites the cache
    (atomically) when anything was read or quantiles were added since.
    """
    access = LeafAccess(source)
    chosen, treedef = access.select(keys)
    spec = {k: access.spec[k] for k in chosen}
    _check_kinds(spec, access.where)
    n = len(source)
    row_bytes = sum(s.dtype.itemsize * int(np.prod(s.shape, dtype=np.int64)) for s in spec.values())
    sample_rows = max(1, min(sample_rows, SAMPLE_BYTES // max(1, row_bytes)))
    # A bounded store's rows are not a growing prefix (old ones are evicted): no cache.
    bounded = isinstance(source, ReadsIds)
    path = local_path(source) if cache and not bounded else None
    cache_file = stats_cache_path(path) if path is not None else None
    opts = {"sample_rows": sample_rows, "block_bytes": block_bytes, "seed": _SEED}
    state, cached = None, list(spec)
    if cache_file is not None and path is not None:
        state, cached = _load(cache_file, source, path, spec, sample_rows, n)
    scanned = state is None or state.count < n
    if scanned:
        start = 0 if state is None else state.count
        if progress is not None and start:
            progress(start)
        new = scan(source, spec, start, n, progress=progress, **opts)  # type: ignore[arg-type]
        state = new if state is None else state.pool(new, _SEED)
    elif progress is not None:
        progress(n)
    assert state is not None
    ready = state
    taken = {k: len(leaf.quantiles) for k, leaf in ready.leaves.items()}

    def save() -> None:
        added = any(len(leaf.quantiles) != taken[k] for k, leaf in ready.leaves.items())
        # A cache of more leaves is only replaced by one with new rows.
        added = added and set(cached) <= set(spec)
        if cache_file is not None and path is not None and (scanned or added):
            _save(cache_file, source, path, ready, sample_rows)

    return state, treedef, save


def _check_kinds(spec: dict[str, LeafSpec], where: str) -> None:
    bad = [f"{k!r} ({s.dtype})" for k, s in spec.items() if s.dtype.kind not in "biuf"]
    if bad:
        raise InvalidStoreError(
            f"{where}: leaves {', '.join(bad)} are not numeric, so they have no statistics. "
            "Fix: pass keys=[...] with the numeric leaves (bool, int, uint, float)."
        )


def _root(path: str) -> list[int]:
    """Device and inode of the store: a store rewritten by ``gr.write`` gets a new one."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino]


def _probe(source: Any, keys: Sequence[str], n: int) -> dict[str, bytes]:
    """Bytes of the first, middle and last of ``n`` rows of each leaf: a rewrite changes them."""
    rows = np.unique(np.array([0, n // 2, n - 1], dtype=np.int64)) if n else np.zeros(0, np.int64)
    got = LeafAccess(source).take(dict.fromkeys(keys, rows))
    return {k: np.ascontiguousarray(got[k]).tobytes() for k in keys}


def _load(
    file: str, source: Any, path: str, spec: dict[str, LeafSpec], sample_rows: int, n: int
) -> tuple[StoreState | None, list[str]]:
    """The cached statistics of a prefix of the store's current rows (any superset of the
    leaves serves), or None when there is none or the store was rewritten; and the leaves
    the cache holds."""
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            count = int(meta["count"])
            cached = {k: i for i, (k, _, _) in enumerate(meta["spec"])}
            described = {k: [d, s] for k, d, s in meta["spec"]}
            fresh = (
                meta["version"] == _CACHE_VERSION
                and meta["root"] == _root(path)
                and meta["sample_rows"] == sample_rows
                and count <= n
                and all(described.get(k) == [s.dtype.str, list(s.shape)] for k, s in spec.items())
            )
            if fresh:
                probe = _probe(source, list(spec), count)
                fresh = all(bytes(z[f"rows{cached[k]}"]) == probe[k] for k in spec)
            if not fresh:
                logger.info("%s: statistics cache is stale; recomputing", file)
                return None, []
            leaves = {}
            for k in spec:
                i = cached[k]
                leaves[k] = LeafState(
                    z[f"mean{i}"], z[f"m2{i}"], z[f"lo{i}"], z[f"hi{i}"], z[f"sample{i}"],
                    dict(zip(z[f"qp{i}"].tolist(), z[f"qv{i}"])),
                )  # fmt: skip
            return StoreState(count, dict(spec), leaves, sample_rows), list(cached)
    except FileNotFoundError:
        return None, []
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.info("%s: unreadable statistics cache (%s); recomputing", file, e)
        return None, []


def _save(file: str, source: Any, path: str, state: StoreState, sample_rows: int) -> None:
    meta = {
        "version": _CACHE_VERSION,
        "root": _root(path),
        "spec": [[k, s.dtype.str, list(s.shape)] for k, s in state.spec.items()],
        "sample_rows": sample_rows,
        "count": state.count,
    }
    arrays: dict[str, Any] = {"meta": np.str_(json.dumps(meta))}
    probe = _probe(source, list(state.spec), state.count)
    for i, (key, leaf) in enumerate(state.leaves.items()):
        arrays |= {f"mean{i}": leaf.mean, f"m2{i}": leaf.m2, f"lo{i}": leaf.lo,
                   f"hi{i}": leaf.hi, f"sample{i}": leaf.sample}  # fmt: skip
        arrays[f"rows{i}"] = np.frombuffer(probe[key], np.uint8)
        arrays[f"qp{i}"] = np.array(list(leaf.quantiles), dtype=np.float64)
        arrays[f"qv{i}"] = np.array(list(leaf.quantiles.values())).reshape(
            len(leaf.quantiles), leaf.mean.size
        )
    save_cache(file, arrays, "statistics cache", logger)
