"""A seeded permutation of ``[0, n)`` evaluated on any slice in O(slice) time and O(1) memory.

Epoch ``e`` of a shuffled replay visits record ``permute(arange(n), n, seed, e)``.
A batch needs only its own slice of that order, so nothing of size ``n`` is
ever built: a balanced Feistel network over the next even power of two,
cycle-walked back into ``[0, n)``, is a bijection on ``[0, n)``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["permute"]

_MASK64 = (1 << 64) - 1
_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on a Python int (used to derive round keys)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized on uint64 (multiplication wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    base = _mix_int(_mix_int(seed & _MASK64) ^ (epoch & _MASK64))
    return [np.uint64(_mix_int(base + r)) for r in range(_ROUNDS)]


def _feistel(x: np.ndarray, half_bits: int, keys: list[np.uint64]) -> np.ndarray:
    shift = np.uint64(half_bits)
    mask = np.uint64((1 << half_bits) - 1)
    left, right = x >> shift, x & mask
    for k in keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    return (left << shift) | right


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Maps ``positions`` (ints in ``[0, n)``) through the permutation of ``(seed, epoch)``.

    Args:
      positions: positions in the shuffled order.
      n: size of the permuted range.
      seed, epoch: select the permutation; each epoch gets a fresh one.

    Returns:
      int64 record ids, a bijection of ``[0, n)`` when applied to ``arange(n)``.
    """
    pos = np.asarray(positions, dtype=np.int64)
    if n <= 1:
        return pos.copy()
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    keys = _round_keys(seed, epoch)
    out = _feistel(pos.astype(np.uint64), bits // 2, keys)
    outside = out >= np.uint64(n)
    while outside.any():  # cycle walking: at most a few rounds, domain < 4n
        out[outside] = _feistel(out[outside], bits // 2, keys)
        outside = out >= np.uint64(n)
    return out.astype(np.int64)
