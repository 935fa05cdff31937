"""Checks of what a read is given: record indices, and the arrays ``read_into`` fills."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    RecordIndexError,
    UnknownLeafError,
)
from grain_replay.store.layout import LeafSpec

__all__ = ["as_record_index", "record_in_range", "check_indices", "check_out", "window_starts"]


def as_record_index(index: Any, owner: object) -> int:
    """``operator.index(index)``, or a TypeError naming ``owner``'s class and the fix."""
    try:
        return operator.index(index)
    except TypeError as e:
        raise ArgumentTypeError(
            f"{type(owner).__name__} indices must be integers, got {type(index).__name__}. "
            "Fix: use read_batch(indices) for several records."
        ) from e


def record_in_range(i: int, n: int, where: str) -> int:
    """Record ``i`` of a store of ``n`` as a number in ``[0, n)``; negative counts from the end.

    Raises:
      RecordIndexError: ``i`` is outside ``[-n, n)``, naming it, ``n`` and ``where``.
    """
    if not -n <= i < n:
        raise RecordIndexError(
            f"{where}: record index {i} is out of range for a store of {n} records "
            f"(valid: -{n} <= index < {n})."
        )
    return i + n if i < 0 else i


def check_indices(indices: Any, n: int, where: str) -> np.ndarray:
    """Record indices as int64 in ``[0, n)``; negative ones count from the end.

    Raises:
      TypeError: the indices are not integers.
      RecordIndexError: an index is outside ``[-n, n)``, naming it, ``n`` and ``where``.
    """
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        if idx.size:
            raise ArgumentTypeError(
                f"{where}: indices must be integers, got dtype {idx.dtype}. "
                "Fix: pass a sequence or array of ints."
            )
        idx = idx.astype(np.int64)
    if idx.ndim != 1:
        idx = idx.reshape(-1)
    if not idx.size:
        return idx.astype(np.int64, copy=False)
    lo, hi = idx.min(), idx.max()
    if lo < -n or hi >= n:
        first = int(idx[np.argmax((idx < -n) | (idx >= n))])
        raise RecordIndexError(
            f"{where}: record index {first} is out of range for a store of "
            f"{n} records (valid: -{n} <= index < {n})."
        )
    idx = idx.astype(np.int64, copy=False)
    return np.where(idx < 0, idx + n, idx) if lo < 0 else idx


def window_starts(
    starts: Sequence[int] | np.ndarray, length: int, n: int, where: str
) -> np.ndarray:
    """``starts`` as int64, checked to hold windows of ``length`` rows inside ``n`` records
    (``where``: the store, for the error)."""
    idx = np.asarray(starts)
    if idx.dtype.kind not in "iu" and idx.size:
        idx = check_indices(idx, n, where)  # raises the ArgumentTypeError
    idx = idx.astype(np.int64, copy=False).reshape(-1)
    if length < 1 or (idx.size and (idx.min() < 0 or idx.max() > n - length)):  # type: ignore[call-overload, unused-ignore]
        raise RecordIndexError(
            f"{where}: windows of {length} rows from starts "
            f"{np.min(idx) if idx.size else ''}..{np.max(idx) if idx.size else ''} do not "
            f"fit a store of {n} records (valid: length >= 1, "
            f"0 <= start <= {n - length}). Fix: clip the starts."
        )
    return idx


def check_out(
    out: Mapping[str, np.ndarray], spec: Mapping[str, LeafSpec], n: int, where: str
) -> None:
    """Checks ``read_into``'s ``out``: known leaves, ``(n, *shape)``, the dtype, writeable.

    Raises:
      UnknownLeafError: a leaf the source lacks.
      InvalidArgumentError: an array that cannot take the rows unchanged.
    """
    for k, dst in out.items():
        want = spec.get(k)
        if want is None:
            raise UnknownLeafError(
                f"{where}: read_into got an array for leaf {k!r}, which the source lacks. "
                f"Leaves: {list(spec)}. Fix: name leaves from that list."
            )
        if (
            type(dst) is np.ndarray
            and dst.shape == (n, *want.shape)
            and (dst.dtype == want.dtype or _native(dst.dtype) == _native(want.dtype))
            and dst.flags.writeable
        ):
            continue
        got = (
            f"{'' if dst.flags.writeable else 'read-only '}{dst.dtype}{list(dst.shape)}"
            if isinstance(dst, np.ndarray)
            else type(dst).__name__
        )
        raise InvalidArgumentError(
            f"{where}: read_into's array for leaf {k!r} is {got}; {n} rows of it need a "
            f"writeable numpy array {want.dtype}{[n, *want.shape]}. Fix: allocate it with "
            f"np.empty(({n}, *spec[{k!r}].shape), spec[{k!r}].dtype)."
        )


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=")
