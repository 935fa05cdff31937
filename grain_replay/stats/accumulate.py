"""The statistics' arithmetic: streaming moments, quantile samples, exact merges, results."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.pipeline import shutdown
from grain_replay.sources.access import LeafAccess
from grain_replay.store.layout import LeafSpec

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_QUANTILES",
    "DEFAULT_SAMPLE_ROWS",
    "SAMPLE_BYTES",
    "LeafState",
    "StoreState",
    "describe_spec",
    "quantile_error",
    "quantile_name",
    "scan",
    "stats_cache_path",
    "worker_threads",
]

# LeRobot's quantiles (its stats.json has q01, q10, q50, q90, q99).
DEFAULT_QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
# Rows kept per store for the quantiles (uniform sample without replacement). The quantiles
# are exact up to this many rows; beyond, see quantile_error().
DEFAULT_SAMPLE_ROWS = 1 << 16
# Bound of the bytes of one store's quantile sample: stores of large records keep fewer rows.
SAMPLE_BYTES = 64 << 20
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
                f"cannot pool statistics of leaves {describe_spec(self.spec)} with "
                f"{describe_spec(other.spec)}. Fix: pool stores with the same leaves, dtypes and "
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


def describe_spec(spec: Mapping[str, LeafSpec]) -> str:
    """``{key: "dtype[shape]"}`` of a spec, for error messages."""
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


def worker_threads() -> int:
    """Threads that reduce a block (numpy's kernels release the GIL)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cpus))


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
    threads = worker_threads()
    # One accumulator per leaf and thread: each thread reduces its slice of every block.
    moments = [{key: _Moments(spec[key].dtype, sizes[key]) for key in keys} for _ in range(threads)]
    samples: dict[str, list[np.ndarray]] = {key: [] for key in keys}
    access = LeafAccess(source)
    blocks = [(a, min(a + block, stop)) for a in range(start, stop, block)]

    def load(a: int, b: int) -> dict[str, np.ndarray]:
        got = access.take(dict.fromkeys(keys, np.arange(a, b, dtype=np.int64)))
        return {key: np.asarray(got[key]).reshape(b - a, sizes[key]) for key in keys}

    def reduce(t: int, got: dict[str, np.ndarray], a: int, b: int) -> None:
        for key in keys:
            moments[t][key].update(got[key][a:b])

    # shutdown.submit: a task the pool refuses (at interpreter exit, from a non-daemon
    # thread) runs in this thread.
    with shutdown.thread_pool(threads + 1, "grain_replay-stats") as ex:
        pending = shutdown.submit(ex, load, *blocks[0]) if blocks else None
        for i, (a, b) in enumerate(blocks):
            assert pending is not None
            got = pending.result()
            pending = shutdown.submit(ex, load, *blocks[i + 1]) if i + 1 < len(blocks) else None
            parts = min(threads, max(1, (b - a) // _MIN_THREAD_ROWS))
            cuts = np.linspace(0, b - a, parts + 1).astype(int)
            reducing = [
                shutdown.submit(ex, reduce, t, got, cuts[t], cuts[t + 1]) for t in range(parts)
            ]
            for f in reducing:
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
