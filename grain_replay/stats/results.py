"""Results from mergeable states: quantiles (sorted samples), moments, mixtures of stores."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from grain_replay.pipeline import shutdown
from grain_replay.stats.accumulate import StoreState, quantile_name, worker_threads
from grain_replay.store.layout import LeafSpec

__all__ = ["finalize", "mix"]

# Values converted to float64 at a time when the quantiles are taken.
_QUANTILE_VALUES = 1 << 22


def finalize(state: StoreState, quantiles: Sequence[float]) -> dict[str, dict[str, np.ndarray]]:
    """``{key: {"count", "mean", "std", "min", "max", "q01", ...}}`` of a pooled state.

    The quantiles taken are kept in the leaves' states (and so in the cache).
    """
    out = {}
    for key, leaf in state.leaves.items():
        missing = [q for q in dict.fromkeys(quantiles) if q not in leaf.quantiles]
        if missing:
            leaf.quantiles |= dict(zip(missing, _quantiles(leaf.sample, missing, None)))
        qs = np.array([leaf.quantiles[q] for q in quantiles]).reshape(len(quantiles), -1)
        out[key] = _result(state.count, state.spec[key], leaf.mean, leaf.m2 / max(state.count, 1),
                           leaf.lo, leaf.hi, qs, quantiles)  # fmt: skip
    return out


def _quantiles(
    sample: np.ndarray, quantiles: Sequence[float], row_weights: np.ndarray | None
) -> np.ndarray:
    """``(len(quantiles), E)`` float64 quantiles of the columns of ``sample``.

    Taken in float64 (exact for integers), a slice of columns at a time so the
    float64 copy stays small. Without weights numpy's default linear method;
    with per-row weights its ``inverted_cdf``, the one it defines for weights.
    """
    k, e = sample.shape
    out = np.full((len(quantiles), e), np.nan)
    if not k or not quantiles:
        return out
    step = max(1, _QUANTILE_VALUES // k)

    def columns(a: int) -> None:
        # Columns made contiguous rows, each sorted along the last axis.
        cols = np.ascontiguousarray(sample[:, a : a + step].T, dtype=np.float64)
        if row_weights is None:
            out[:, a : a + step] = _linear_quantiles(cols, quantiles)
        else:
            w = np.broadcast_to(row_weights, cols.shape)
            out[:, a : a + step] = np.quantile(
                cols, list(quantiles), axis=1, method="inverted_cdf", weights=w
            )

    starts = range(0, e, step)
    if len(starts) == 1:
        columns(0)
    else:
        with shutdown.thread_pool(worker_threads(), "grain_replay-stats") as ex:
            for f in [shutdown.submit(ex, columns, a) for a in starts]:
                f.result()
    return out


def _linear_quantiles(rows: np.ndarray, quantiles: Sequence[float]) -> np.ndarray:
    """numpy's default (linear) quantiles along the last axis of ``rows`` (sorted in place),
    bit for bit: numpy's virtual index ``(n - 1) q`` and its two-sided lerp.

    ``np.quantile`` selects with ``np.partition``; a full ``np.sort`` (SIMD) of the
    sample's columns is several times faster for the sample sizes used here.
    """
    rows.sort(axis=-1)
    n = rows.shape[-1]
    q = np.asarray(quantiles, dtype=np.float64)
    virtual = (n - 1) * q
    prev = np.floor(virtual)
    above = virtual >= n - 1
    lo = np.where(above, n - 1, prev).astype(np.intp)
    hi = np.where(above, n - 1, prev + 1).astype(np.intp)
    gamma = (virtual - np.where(above, -1.0, prev))[:, None]
    a, b = rows[..., lo].T, rows[..., hi].T
    diff = b - a
    out = a + diff * gamma
    return np.where(gamma >= 0.5, b - diff * (1 - gamma), out)


def _result(
    count: int,
    spec: LeafSpec,
    mean: np.ndarray,
    var: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    qs: np.ndarray,
    quantiles: Sequence[float],
) -> dict[str, np.ndarray]:
    shape = tuple(spec.shape)
    if count == 0:
        nan = np.full(shape, np.nan)
        res = {"count": np.asarray(0, np.int64), "mean": nan, "std": nan.copy()}
        res |= {"min": nan.copy(), "max": nan.copy()}
        return res | {quantile_name(q): nan.copy() for q in quantiles}
    qs = np.asarray(qs, dtype=np.float64)
    if spec.dtype.kind == "f":
        # NaN propagates as in numpy: an element holding a NaN has NaN quantiles too,
        # even when the sample missed the row.
        qs[:, np.isnan(lo)] = np.nan
    res = {
        "count": np.asarray(count, np.int64),
        "mean": mean.reshape(shape),
        "std": np.sqrt(var).reshape(shape),
        "min": lo.reshape(shape),
        "max": hi.reshape(shape),
    }
    return res | {quantile_name(q): qs[i].reshape(shape) for i, q in enumerate(quantiles)}


def mix(
    states: Mapping[str, StoreState], weights: Mapping[str, float], quantiles: Sequence[float]
) -> dict[str, dict[str, np.ndarray]]:
    """Statistics of the mixture that draws a record from store ``s`` with probability ``w[s]``.

    Mean and variance are the mixture's (``sum w mean``, ``sum w (var + (mean -
    m)**2)``); min and max range over the stores with positive weight; the
    quantiles invert the mixture CDF ``sum w F_s`` built from the samples
    (numpy's ``inverted_cdf`` with per-row weights ``w[s] / k_s``); ``count``
    is the number of rows of all stores.
    """
    names = [s for s in states if weights[s] > 0]
    total = float(sum(weights[s] for s in names))
    w = {s: weights[s] / total for s in names}
    first = states[names[0]]
    out = {}
    for key, spec in first.spec.items():
        parts = [states[s] for s in names]
        means = [p.leaves[key].mean for p in parts]
        mean = sum(w[s] * m for s, m in zip(names, means))
        var = sum(
            w[s] * (p.leaves[key].m2 / max(p.count, 1) + (m - mean) ** 2)
            for s, p, m in zip(names, parts, means)
        )
        lo = np.asarray([p.leaves[key].lo for p in parts]).min(axis=0)
        hi = np.asarray([p.leaves[key].hi for p in parts]).max(axis=0)
        samples = [p.leaves[key].sample for p in parts]
        row_w = np.concatenate([np.full(len(x), w[s] / max(len(x), 1)) for s, x in
                                zip(names, samples)])  # fmt: skip
        qs = _quantiles(np.concatenate(samples), quantiles, row_w)
        count = sum(states[s].count for s in states)
        out[key] = _result(count, spec, np.asarray(mean), np.asarray(var), lo, hi, qs, quantiles)
    return out
