"""``compute_stats``: one store, pooled stores or a weighted mixture, from the cache or a pass."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError
from grain_replay.stats.accumulate import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_QUANTILES,
    DEFAULT_SAMPLE_ROWS,
    StoreState,
    describe_spec,
)
from grain_replay.stats.cache import store_state
from grain_replay.stats.results import finalize, mix

__all__ = ["compute_stats", "iter_json"]


def compute_stats(
    source: Any,
    *,
    weights: Mapping[str, float] | None = None,
    keys: Sequence[str] | str | None = None,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    sample_rows: int = DEFAULT_SAMPLE_ROWS,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    cache: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Any:
    """Per-leaf count, mean, std, min, max and quantiles, for normalizing inputs.

    One streaming pass reads the store in sequential blocks of about
    ``block_bytes`` with ``read_batch`` (the next block is read while the
    current one is reduced), so memory is bounded by two blocks plus the
    quantile sample. Statistics are per element of the record shape (an
    ``obs`` leaf of shape ``(17,)`` gets 17 means), as LeRobot's
    ``stats.json``; moments accumulate in float64.

    - ``count``: rows (0-d int64). ``mean``, ``std`` (population, ``ddof=0``):
      float64 of the record shape. ``min``, ``max``: the leaf's dtype.
    - Quantiles (``q01``, ``q10``, ``q50``, ``q90``, ``q99`` by default, see
      :func:`quantile_name`): float64, numpy's linear method over a uniform
      sample of ``sample_rows`` rows: exact for stores of at most that many
      rows, otherwise within the rank error :func:`quantile_error`.
    - NaN propagates as in numpy: an element with a NaN in any row has NaN
      mean, std, min, max and quantiles. ±inf gives ±inf means and NaN stds.

    The statistics of a local store are cached in :func:`stats_cache_path`.
    When rows were appended since (``gr.ReplayWriter``), only the new rows are
    read and merged exactly into the cached ones; a store that was rewritten
    is read again.

    Args:
      source: a grain_replay source (or anything with ``spec``, ``__len__``
        and ``read_batch``), a path for :func:`grain_replay.open_source`, or a
        mapping ``{name: source}`` of stores with the same leaves.
      weights: with a mapping, ``{name: share}``: the statistics of the
        mixture ``make_data_loader(sources, weights=...)`` draws from. Without,
        the stores are pooled (as one concatenated store, exactly).
      keys: leaves or groups to compute; default all.
      quantiles: probabilities in ``[0, 1]``.
      sample_rows: rows per store kept for the quantiles.
      block_bytes: bytes read per ``read_batch``.
      cache: read and write the cache file.
      progress: called with the number of rows after each block.

    Returns:
      The source's tree structure with, at each leaf, a dict of numpy arrays.

    Raises:
      InvalidStoreError: a leaf is not numeric, or the stores of a mapping
        differ in leaves (each message names the leaf and the fix).
      ValueError: bad quantiles, weights or sizes.

    Examples:
      >>> stats = gr.compute_stats(gr.open_source("replay.h5"))
      >>> obs = (batch["obs"] - stats["obs"]["mean"]) / (stats["obs"]["std"] + 1e-8)
    """
    quantiles = [float(q) for q in quantiles]
    bad = [q for q in quantiles if not 0 <= q <= 1]
    if bad:
        raise ValueError(f"quantiles must lie in [0, 1], got {bad}")
    if sample_rows <= 0:
        raise ValueError(f"sample_rows must be positive, got {sample_rows}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    opts: dict[str, Any] = {"sample_rows": sample_rows, "block_bytes": block_bytes, "cache": cache,
            "progress": progress}  # fmt: skip
    if isinstance(source, Mapping):
        return _compute_many(source, weights, keys, quantiles, opts)
    if weights is not None:
        raise ValueError("weights= is for a mapping {name: source} of stores; got one source.")
    state, treedef, save = store_state(_as_source(source), keys, **opts)
    out = tree_lib.unflatten(treedef, finalize(state, quantiles))
    save()  # after finalize: the cache keeps the quantiles taken
    return out


def _as_source(source: Any) -> Any:
    if isinstance(source, (str, os.PathLike)):
        from grain_replay.opening import open_source

        return open_source(source)
    return source


def _compute_many(
    sources: Mapping[str, Any],
    weights: Mapping[str, float] | None,
    keys: Sequence[str] | str | None,
    quantiles: list[float],
    opts: dict[str, Any],
) -> Any:
    if not sources:
        raise ValueError("compute_stats got an empty mapping of sources.")
    if weights is not None:
        if callable(weights) or not isinstance(weights, Mapping):
            raise TypeError(
                "weights must be a mapping {name: share}; a schedule (callable) has no single "
                "mixture. Fix: pass the shares of the step you normalize for."
            )
        if set(weights) != set(sources):
            raise ValueError(
                f"weights names {sorted(weights)} but the sources are {sorted(sources)}. "
                "Fix: give one share per source."
            )
        vals = [float(v) for v in weights.values()]
        if any(not math.isfinite(v) or v < 0 for v in vals) or sum(vals) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0, got {dict(weights)}")
    states: dict[str, StoreState] = {}
    treedef: dict[str, Any] | None = None
    first = ""
    for name, src in sources.items():
        state, tdef, save = store_state(_as_source(src), keys, **opts)
        save()
        if treedef is None:
            treedef, first = tdef, name
        elif state.spec != states[first].spec:
            raise InvalidStoreError(
                f"compute_stats: store {name!r} has leaves {describe_spec(state.spec)} but store "
                f"{first!r} has {describe_spec(states[first].spec)}. Fix: mix stores with the same "
                "leaves, dtypes and per-record shapes (select them with keys=[...])."
            )
        states[name] = state
    assert treedef is not None
    if weights is None:
        pooled: StoreState | None = None
        for i, state in enumerate(states.values()):
            pooled = state if pooled is None else pooled.pool(state, [7, i])
        assert pooled is not None
        return tree_lib.unflatten(treedef, finalize(pooled, quantiles))
    empty = [name for name, state in states.items() if state.count == 0 and weights[name] > 0]
    if empty:
        raise ValueError(
            f"compute_stats: stores {empty} have no rows but a positive share in {dict(weights)}. "
            "Fix: give them weight 0 or leave them out."
        )
    return tree_lib.unflatten(
        treedef, mix(states, {k: float(v) for k, v in weights.items()}, quantiles)
    )


def iter_json(stats: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(leaf key, {stat: nested lists})`` pairs of a :func:`compute_stats` result."""
    flat, _ = tree_lib.flatten(stats, where="stats")
    grouped: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        leaf, _, stat = key.rpartition("/")
        grouped.setdefault(leaf, {})[stat] = np.asarray(value).tolist()
    yield from grouped.items()
