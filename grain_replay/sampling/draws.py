"""Counter-based random numbers: the draws of a step are a pure function of (seed, stream, step).

A sampler that must resume at the identical next batch, or draw a batch's indices
in one process and read them in another, needs no generator state: step ``t``'s
numbers are splitmix64 of a key derived from ``(seed, stream, t)`` plus a counter.
"""

from __future__ import annotations

import functools

import numpy as np

from grain_replay.pipeline.shuffle import _MASK64, _mix, _mix_int

__all__ = ["uniforms", "integers"]

_GOLDEN = 0x9E3779B97F4A7C15


@functools.lru_cache(maxsize=8)
def _counter(count: int) -> np.ndarray:
    counter = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    counter.flags.writeable = False
    return counter


def _bits(seed: int, stream: int, step: int, count: int) -> np.ndarray:
    key = _mix_int(_mix_int(_mix_int(seed & _MASK64) ^ (stream & _MASK64)) ^ (step & _MASK64))
    return _mix(_counter(count) + np.uint64(key))


def uniforms(seed: int, stream: int, step: int, count: int) -> np.ndarray:
    """``count`` float64 numbers in ``[0, 1)`` (53 random bits) for ``(seed, stream, step)``."""
    return (_bits(seed, stream, step, count) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def integers(seed: int, stream: int, step: int, count: int, n: int) -> np.ndarray:
    """``count`` int64 numbers uniform in ``[0, n)`` (Lemire's multiply-shift, n < 2**32 exact)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if n < 2**32:
        hi = _bits(seed, stream, step, count) >> np.uint64(32)
        return ((hi * np.uint64(n)) >> np.uint64(32)).astype(np.int64)
    return np.minimum((uniforms(seed, stream, step, count) * n).astype(np.int64), n - 1)
