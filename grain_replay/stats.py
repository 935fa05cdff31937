"""Per-leaf statistics for normalization: one streaming pass, mergeable, cached beside the store."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError
from grain_replay.layout import LeafSpec

__all__ = [
    "DEFAULT_QUANTILES",
    "LeafState",
    "StoreState",
    "compute_stats",
    "iter_json",
    "quantile_error",
    "quantile_name",
    "stats_cache_path",
]

# LeRobot's quantiles (its stats.json has q01, q10, q50, q90, q99).
DEFAULT_QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
# Rows kept per store for the quantiles (uniform sample without replacement). The quantiles
# are exact up to this many rows; beyond, see quantile_error().
DEFAULT_SAMPLE_ROWS = 1 << 16
# Bound of the bytes of one store's quantile sample: stores of large records keep fewer rows.
SAMPLE_BYTES = 64 << 20
# Values converted to float64 at a time when the quantiles are taken.
_QUANTILE_VALUES = 1 << 22
# Bytes of records read at a time (one read_batch), bounded to at least one row.
DEFAULT_BLOCK_BYTES = 64 << 20
# Values per step of the moment kernel: keeps its float64 scratch in the L2 cache.
_KERNEL_VALUES = 1 << 16
# Record sizes from which numpy's own axis-0 reductions are fast (measured).
_AXIS_REDUCE = 256
# Threads that reduce a block, and the fewest rows worth a thread.
_MAX_THREADS = 8
_MIN_THREAD_ROWS = 4096


def quantile_name(q: float) -> str:
    """The result key of quantile ``q``: 0.01 -> ``q01``, 0.5 -> ``q50``, 0.999 -> ``q99.9``."""
    pct = f"{q * 100:.10g}"
    return f"q{'0' if q * 100 < 10 else ''}{pct}"


def quantile_error(sample_rows: int, delta: float = 1e-6) -> float:
    """Rank error bound of the quantiles of a store with more rows than ``sample_rows``.

    The quantiles come from a uniform sample of ``k = sample_rows`` rows drawn
    without replacement. By the Dvoretzky-Kiefer-Wolfowitz inequality (which
    sampling without replacement only tightens), with probability at least
    ``1 - delta`` the sample's CDF is within ``eps = sqrt(ln(2 / delta) / (2 k))``
    of the store's everywhere, so every reported ``q_p`` lies between the store's
    exact quantiles at ranks ``p - eps`` and ``p + eps``. For the default
    ``k = 2**16`` and ``delta = 1e-6``: ``eps = 0.0105``. That bound holds for all
    ``p`` at once; the rank error of one quantile is typically far smaller, its
    standard deviation ``sqrt(p (1 - p) / k)`` (0.0004 for ``q01``). Stores with at
    most ``k`` rows get exact quantiles (numpy's default linear method).
    """
    if sample_rows <= 0 or not 0 < delta < 1:
        raise ValueError(f"need sample_rows > 0 and 0 < delta < 1, got {sample_rows}, {delta}")
    return math.sqrt(math.log(2 / delta) / (2 * sample_rows))


def stats_cache_path(path: str) -> str:
    """Where the statistics of the store at ``path`` are cached (beside the episode index)."""
    if os.path.isdir(path):
        return os.path.join(path, ".stats.npz")
    return path + ".stats.npz"


@dataclasses.dataclass
class LeafState:
    """Mergeable statistics of one leaf over some rows, per element of the record shape.

    Attributes:
      mean: float64, record shape flattened to ``(E,)``.
      m2: float64 ``(E,)``, sum of squared deviations from ``mean``.
      lo, hi: ``(E,)`` in the leaf's dtype (NaN propagates, as in ``np.min``).
      sample: ``(k, E)`` rows of a uniform sample without replacement of the rows.
    """

    mean: np.ndarray
    m2: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    sample: np.ndarray
    # Quantiles already taken of ``sample``: probability -> ``(E,)`` float64.
    quantiles: dict[float, np.ndarray] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StoreState:
    """Mergeable statistics of every leaf of a store over ``count`` rows.

    Each leaf's sample holds ``min(count, sample_rows)`` rows.
    """

    count: int
    spec: dict[str, LeafSpec]
    leaves: dict[str, LeafState]
    sample_rows: int

    def pool(self, other: StoreState, seed: Sequence[int]) -> StoreState:
        """The exact statistics of the rows of ``self`` followed by those of ``other``.

        Moments merge with Chan et al.'s parallel formulas, extremes with
        min/max, and the samples into a uniform sample of the union: the number
        drawn from ``self`` is hypergeometric, so the union keeps the error
        bound of a single pass (no error accumulates over appended parts).
        """
        if other.spec != self.spec:
            raise InvalidStoreError(
                f"cannot pool statistics of leaves {_describe(self.spec)} with "
                f"{_describe(other.spec)}. Fix: pool stores with the same leaves, dtypes and "
                "per-record shapes (select them with keys=[...])."
            )
        na, nb = self.count, other.count
        if nb == 0 or na == 0:
            return other if na == 0 else self
        n = na + nb
        rng = np.random.default_rng([*seed, na, nb])
        sample_rows = min(self.sample_rows, other.sample_rows)
        k = min(sample_rows, n)
        ka = int(rng.hypergeometric(na, nb, k))
        out = {}
        pick_a = pick_b = None
        for key, a in self.leaves.items():
            b = other.leaves[key]
            if pick_a is None:
                pick_a = np.sort(rng.choice(len(a.sample), ka, replace=False))
                pick_b = np.sort(rng.choice(len(b.sample), k - ka, replace=False))
            mean, m2 = _chan(na, a.mean, a.m2, nb, b.mean, b.m2)
            out[key] = LeafState(
                mean=mean,
                m2=m2,
                lo=np.minimum(a.lo, b.lo),
                hi=np.maximum(a.hi, b.hi),
                sample=_gather_pair(a.sample, pick_a, b.sample, pick_b),
            )
        return StoreState(n, self.spec, out, sample_rows)


def _gather_pair(a: np.ndarray, pick_a: Any, b: np.ndarray, pick_b: Any) -> np.ndarray:
    """``concatenate([a[pick_a], b[pick_b]])`` written into one new array (no temporaries)."""
    out = np.empty((len(pick_a) + len(pick_b), *a.shape[1:]), dtype=a.dtype)
    np.take(a, pick_a, axis=0, out=out[: len(pick_a)])
    np.take(b, pick_b, axis=0, out=out[len(pick_a) :])
    return out


def _describe(spec: Mapping[str, LeafSpec]) -> str:
    return str({k: f"{s.dtype}{list(s.shape)}" for k, s in spec.items()})


# -- one streaming pass ------------------------------------------------------------------


def _halve(buf: np.ndarray, op: Any, m: int) -> np.ndarray:
    """Reduces rows ``[0, m)`` of ``buf`` along axis 0 in place (pairwise) and returns row 0.

    Each step is one long contiguous ufunc call, so a reduction over many rows
    of a few elements runs at memory speed (numpy's own axis-0 reduction loops
    over the rows with a short inner loop); the pairwise order also keeps
    float64 sums accurate.
    """
    while m > 1:
        h = m // 2
        op(buf[:h], buf[m - h : m], out=buf[:h])
        m -= h
    return buf[0]


def _chan(
    na: int, mean_a: np.ndarray, m2_a: np.ndarray, nb: int, mean_b: np.ndarray, m2_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Mean and M2 of two parts of ``na`` and ``nb`` rows (Chan, Golub and LeVeque)."""
    n = na + nb
    delta = mean_b - mean_a
    # The weighted mean (not mean_a + delta * nb / n) keeps +-inf means finite-safe as numpy's.
    mean = mean_a * (na / n) + mean_b * (nb / n)
    return mean, m2_a + m2_b + delta * delta * (na * nb / n)


class _Moments:
    """Running count, mean, M2, min and max of a leaf, fed block by block (one per thread)."""

    def __init__(self, dtype: np.dtype[Any], size: int):
        self.count = 0
        self.mean = np.zeros(size)
        self.m2 = np.zeros(size)
        self.lo = np.zeros(size, dtype)
        self.hi = np.zeros(size, dtype)
        rows = max(2, _KERNEL_VALUES // max(size, 1))
        self._d = np.empty((rows, size))
        self._ext = np.empty((rows, size), dtype) if 1 < size < _AXIS_REDUCE else None

    def update(self, x: np.ndarray) -> None:
        """Adds the rows of ``x`` (``(b, E)``), in steps that fit the cache."""
        if x.shape[1] == 0:  # a leaf of zero values per record: only rows to count
            self.count += len(x)
            return
        step = len(self._d)
        for a in range(0, len(x), step):
            self._add(*self._reduce(x[a : a + step]))

    def _reduce(self, x: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Count, mean, M2, min and max of the rows of ``x``."""
        m, e = x.shape
        # Shifted sums: subtracting a row of the data keeps s2 - s1**2/m free of cancellation.
        shift = x[0].astype(np.float64)
        d = self._d[:m]
        np.subtract(x, shift, out=d, casting="unsafe")
        if e == 1:
            # One column: numpy's contiguous 1-D reductions (pairwise sums, SIMD min/max).
            flat, x1 = d.reshape(m), x.reshape(m)
            s1 = np.array([flat.sum()])
            s2 = np.array([np.einsum("i,i->", flat, flat)])
            lo, hi = x1.min(keepdims=True), x1.max(keepdims=True)
        elif e >= _AXIS_REDUCE:
            # Long rows: numpy's axis-0 reductions already run along contiguous rows.
            s1 = d.sum(axis=0)
            s2 = np.einsum("ij,ij->j", d, d)
            lo, hi = x.min(axis=0), x.max(axis=0)
        else:
            # Short rows: numpy's axis-0 reduction would loop over rows of a few elements;
            # halving runs long contiguous ufunc calls instead.
            assert self._ext is not None
            s2 = np.einsum("ij,ij->j", d, d)
            s1 = _halve(d, np.add, m).copy()
            ext = self._ext[:m]
            ext[...] = x
            lo = _halve(ext, np.minimum, m).copy()
            ext[...] = x
            hi = _halve(ext, np.maximum, m).copy()
        return m, shift + s1 / m, np.maximum(s2 - s1 * s1 / m, 0.0), lo, hi

    def _add(
        self, m: int, mean: np.ndarray, m2: np.ndarray, lo: np.ndarray, hi: np.ndarray
    ) -> None:
        if self.count == 0:
            self.count, self.mean, self.m2, self.lo, self.hi = m, mean, m2, lo, hi
            return
        if m == 0:
            return
        self.mean, self.m2 = _chan(self.count, self.mean, self.m2, m, mean, m2)
        self.lo = np.minimum(self.lo, lo)
        self.hi = np.maximum(self.hi, hi)
        self.count += m

    def merge(self, other: _Moments) -> None:
        self._add(other.count, other.mean, other.m2, other.lo, other.hi)


def _threads() -> int:
    """Threads that reduce a block (numpy's kernels release the GIL)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cpus))


def _flat_reader(source: Any, keys: Sequence[str]) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """rows -> ``{key: array}``: the source's ``read_flat`` if it has one, else ``read_batch``."""
    read_flat = getattr(source, "read_flat", None)
    if read_flat is not None and list(getattr(source, "keys", ())) == list(keys):
        return read_flat  # type: ignore[no-any-return]
    read_leaf = getattr(source, "read_leaf", None)
    if read_leaf is not None:
        return lambda rows: {k: read_leaf(k, rows) for k in keys}

    def read(rows: np.ndarray) -> dict[str, np.ndarray]:
        flat, _ = tree_lib.flatten(source.read_batch(rows))
        return {k: np.asarray(flat[k]) for k in keys}

    return read


def scan(
    source: Any,
    spec: Mapping[str, LeafSpec],
    start: int,
    stop: int,
    *,
    sample_rows: int,
    block_bytes: int,
    seed: Sequence[int],
    progress: Callable[[int], None] | None = None,
) -> StoreState:
    """Statistics of rows ``[start, stop)``: one pass of sequential ``read_batch`` blocks.

    The next block is read in a background thread while the current one is
    reduced (reads and numpy kernels release the GIL), so the pass runs at the
    speed of the slower of the two.
    """
    spec = dict(spec)
    keys = list(spec)
    sizes = {k: int(np.prod(s.shape, dtype=np.int64)) for k, s in spec.items()}
    row_bytes = sum(s.dtype.itemsize * sizes[k] for k, s in spec.items())
    block = max(1, block_bytes // max(1, row_bytes))
    n = stop - start
    rng = np.random.default_rng([*seed, start, stop])
    k = min(sample_rows, n)
    pick = start + np.sort(rng.choice(n, size=k, replace=False)) if k < n else None
    threads = _threads()
    # One accumulator per leaf and thread: each thread reduces its slice of every block.
    moments = [{key: _Moments(spec[key].dtype, sizes[key]) for key in keys} for _ in range(threads)]
    samples: dict[str, list[np.ndarray]] = {key: [] for key in keys}
    read = _flat_reader(source, keys)
    blocks = [(a, min(a + block, stop)) for a in range(start, stop, block)]

    def load(a: int, b: int) -> dict[str, np.ndarray]:
        got = read(np.arange(a, b, dtype=np.int64))
        return {key: np.asarray(got[key]).reshape(b - a, sizes[key]) for key in keys}

    def reduce(t: int, got: dict[str, np.ndarray], a: int, b: int) -> None:
        for key in keys:
            moments[t][key].update(got[key][a:b])

    with concurrent.futures.ThreadPoolExecutor(
        threads + 1, thread_name_prefix="grain_replay-stats"
    ) as ex:
        pending = ex.submit(load, *blocks[0]) if blocks else None
        for i, (a, b) in enumerate(blocks):
            assert pending is not None
            got = pending.result()
            pending = ex.submit(load, *blocks[i + 1]) if i + 1 < len(blocks) else None
            parts = min(threads, max(1, (b - a) // _MIN_THREAD_ROWS))
            cuts = np.linspace(0, b - a, parts + 1).astype(int)
            for f in [ex.submit(reduce, t, got, cuts[t], cuts[t + 1]) for t in range(parts)]:
                f.result()
            lo, hi = (0, b - a) if pick is None else np.searchsorted(pick, [a, b])
            for key in keys:
                x = got[key]
                samples[key].append(x[lo:hi] if pick is None else x[pick[lo:hi] - a])
            if progress is not None:
                progress(b - a)
    leaves = {}
    for key in keys:
        mo = moments[0][key]
        for t in range(1, threads):
            mo.merge(moments[t][key])
        empty = np.zeros((0, sizes[key]), spec[key].dtype)
        sample = np.concatenate(samples[key]) if samples[key] else empty
        leaves[key] = LeafState(mo.mean, mo.m2, mo.lo, mo.hi, sample)
    return StoreState(n, spec, leaves, sample_rows)


# -- results --------------------------------------------------------------------------------


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
        with concurrent.futures.ThreadPoolExecutor(_threads()) as ex:
            list(ex.map(columns, starts))
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
        lo = np.minimum.reduce([p.leaves[key].lo for p in parts])
        hi = np.maximum.reduce([p.leaves[key].hi for p in parts])
        samples = [p.leaves[key].sample for p in parts]
        row_w = np.concatenate([np.full(len(x), w[s] / max(len(x), 1)) for s, x in
                                zip(names, samples)])  # fmt: skip
        qs = _quantiles(np.concatenate(samples), quantiles, row_w)
        count = sum(states[s].count for s in states)
        out[key] = _result(count, spec, np.asarray(mean), np.asarray(var), lo, hi, qs, quantiles)
    return out


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

    Example:
      >>> stats = gr.compute_stats(gr.open_source("replay.h5"))
      >>> obs = (batch["obs"] - stats["obs"]["mean"]) / (stats["obs"]["std"] + 1e-8)
    """
    from grain_replay.stats_store import store_state

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
        import grain_replay as gr

        return gr.open_source(source)
    return source


def _compute_many(
    sources: Mapping[str, Any],
    weights: Mapping[str, float] | None,
    keys: Sequence[str] | str | None,
    quantiles: list[float],
    opts: dict[str, Any],
) -> Any:
    from grain_replay.stats_store import store_state

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
                f"compute_stats: store {name!r} has leaves {_describe(state.spec)} but store "
                f"{first!r} has {_describe(states[first].spec)}. Fix: mix stores with the same "
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
