"""Counter-based random numbers: the draws of a step are a pure function of (seed, stream, step).

A sampler that must resume at the identical next batch, or draw a batch's indices
in one process and read them in another, needs no generator state: step ``t``'s
numbers are splitmix64 of a key derived from ``(seed, stream, t)`` plus a counter.

:class:`Draws` computes the same numbers for ``BLOCK`` steps at once (one
vectorized hash over ``BLOCK * count`` counters instead of ten small ufunc calls
per step), so a sampler's per-step cost is a slice and a multiply.
"""

from __future__ import annotations

import functools

import numpy as np

from grain_replay.pipeline.shuffle import MASK64, mix, mix_int

__all__ = ["Draws", "uniforms", "integers"]

_GOLDEN = 0x9E3779B97F4A7C15
_U32 = np.uint64(32)
_U11 = np.uint64(11)
# Steps whose bits one Draws block computes at once.
BLOCK = 16


@functools.lru_cache(maxsize=8)
def _counter(count: int) -> np.ndarray:
    counter = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
    counter.flags.writeable = False
    return counter


def _prefix(seed: int, stream: int) -> int:
    """The part of a step's key that all steps of ``(seed, stream)`` share."""
    return mix_int(mix_int(seed & MASK64) ^ (stream & MASK64))


def _key(seed: int, stream: int, step: int) -> int:
    return mix_int(_prefix(seed, stream) ^ (step & MASK64))


def _bits(seed: int, stream: int, step: int, count: int) -> np.ndarray:
    return mix(_counter(count) + np.uint64(_key(seed, stream, step)))


def _to_unit(bits: np.ndarray) -> np.ndarray:
    return (bits >> _U11).astype(np.float64) * 2.0**-53


def _to_range(bits: np.ndarray, n: int) -> np.ndarray:
    """Lemire's multiply-shift of the high 32 bits: uniform in ``[0, n)`` for n < 2**32."""
    hi = bits >> _U32
    hi *= np.uint64(n)
    hi >>= _U32
    return hi.view(np.int64)


def uniforms(seed: int, stream: int, step: int, count: int) -> np.ndarray:
    """``count`` float64 numbers in ``[0, 1)`` (53 random bits) for ``(seed, stream, step)``."""
    return _to_unit(_bits(seed, stream, step, count))


def integers(seed: int, stream: int, step: int, count: int, n: int) -> np.ndarray:
    """``count`` int64 numbers uniform in ``[0, n)`` (Lemire's multiply-shift, n < 2**32 exact)."""
    return _integers(_bits(seed, stream, step, count), n)


def _integers(bits: np.ndarray, n: int) -> np.ndarray:
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if n < 2**32:
        return _to_range(bits, n)
    return np.minimum((_to_unit(bits) * n).astype(np.int64), n - 1)


class Draws:
    """The numbers of :func:`integers` / :func:`uniforms` for one ``(seed, stream, count)``.

    Identical to those functions, step by step, whatever order steps are asked
    in; computes them ``BLOCK`` steps at a time and keeps the latest block.
    """

    def __init__(self, seed: int, stream: int, count: int) -> None:
        self._count = count
        self._first = -1
        self._block = np.empty((0, count), dtype=np.uint64)
        # The block's integers in [0, n) for the last n asked (made on first use).
        self._ranged = np.empty((0, count), dtype=np.int64)
        self._ranged_n, self._ranged_first = 0, -1
        self._units, self._units_first = np.empty((0, count)), -1
        # The per-step keys differ only in the step: hash the common prefix once.
        self._prefix = _prefix(seed, stream)

    def bits(self, step: int) -> np.ndarray:
        """The ``count`` 64-bit words of ``step`` (read-only)."""
        first = step - step % BLOCK
        if first != self._first:
            steps = np.arange(first, first + BLOCK, dtype=np.uint64)
            # mix_int on the array: add the golden ratio, then the finalizer (wrapping).
            keys = mix((steps ^ np.uint64(self._prefix)) + np.uint64(_GOLDEN))
            block = mix(_counter(self._count)[None, :] + keys[:, None])
            block.flags.writeable = False
            self._block, self._first = block, first
        return self._block[step - first]

    def integers(self, step: int, n: int) -> np.ndarray:
        """``integers(seed, stream, step, count, n)`` (a read-only view of a cached block)."""
        bits = self.bits(step)
        if not 0 < n < 2**32:
            return _integers(bits, n)
        if self._ranged_n != n or self._ranged_first != self._first:
            # The whole block at once: n rarely changes between steps.
            self._ranged = _to_range(self._block, n)
            self._ranged.flags.writeable = False
            self._ranged_n, self._ranged_first = n, self._first
        return self._ranged[step - self._first]

    def uniforms(self, step: int) -> np.ndarray:
        """``uniforms(seed, stream, step, count)``."""
        return _to_unit(self.bits(step))

    def units(self, step: int) -> np.ndarray:
        """``uniforms(seed, stream, step, count)`` as a read-only view of a cached block."""
        self.bits(step)
        if self._units_first != self._first:
            self._units = _to_unit(self._block)  # the whole block at once, as integers
            self._units.flags.writeable = False
            self._units_first = self._first
        return self._units[step - self._first]
