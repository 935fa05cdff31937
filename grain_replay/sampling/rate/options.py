"""The four rate-limit options of the replay samplers, checked, and the default tolerance."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from grain_replay.errors import InvalidSamplingError

__all__ = [
    "TOLERANCE_FRACTION",
    "check_rate_limit",
    "default_tolerance",
    "is_rate_limited",
    "least_tolerance",
    "set_rate_limit",
]

# Acme's default error buffer: 10 % of min_size * samples_per_insert.
TOLERANCE_FRACTION = 0.1


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise InvalidSamplingError(f"{owner}: {name} must be a number, got {value!r}")
    return float(value)


def check_rate_limit(
    owner: str,
    min_size: Any,
    samples_per_insert: Any,
    tolerance: Any,
    timeout: Any,
) -> tuple[int, float | None, float | None, float | None]:
    """The four rate-limit options, checked; the error names the option and the fix."""
    if isinstance(min_size, bool) or not isinstance(min_size, int):
        try:
            min_size = operator.index(min_size)
        except TypeError:
            raise InvalidSamplingError(
                f"{owner}: min_size must be an int (rows live before the first batch), got "
                f"{min_size!r}"
            ) from None
    if min_size < 0:
        raise InvalidSamplingError(f"{owner}: min_size must be >= 0 rows, got {min_size}")
    r = None
    if samples_per_insert is not None:
        r = _number(owner, "samples_per_insert", samples_per_insert)
        if not (math.isfinite(r) and r > 0):
            raise InvalidSamplingError(
                f"{owner}: samples_per_insert must be a positive finite number (rows handed "
                f"out per row inserted), got {samples_per_insert!r}. Fix: e.g. "
                "samples_per_insert=8.0, or None for no ratio."
            )
    e = None
    if tolerance is not None:
        if r is None:
            raise InvalidSamplingError(
                f"{owner}: tolerance={tolerance!r} bounds the samples_per_insert ratio, but "
                "samples_per_insert is None. Fix: pass samples_per_insert= too, or drop "
                "tolerance."
            )
        e = _number(owner, "tolerance", tolerance)
        if not (math.isfinite(e) and e >= 0):
            raise InvalidSamplingError(
                f"{owner}: tolerance must be a finite number of rows >= 0, got {tolerance!r}"
            )
    t = None
    if timeout is not None:
        t = _number(owner, "timeout", timeout)
        if not (math.isfinite(t) and t > 0):
            raise InvalidSamplingError(
                f"{owner}: timeout must be positive seconds, or None (wait as long as it "
                f"takes), got {timeout!r}"
            )
    return int(min_size), r, e, t


def set_rate_limit(options: Any) -> None:
    """Checks and normalizes the four rate-limit fields of a frozen sampling dataclass."""
    values = check_rate_limit(
        type(options).__name__,
        options.min_size,
        options.samples_per_insert,
        options.tolerance,
        options.timeout,
    )
    for name, value in zip(("min_size", "samples_per_insert", "tolerance", "timeout"), values):
        object.__setattr__(options, name, value)


def is_rate_limited(options: Any) -> bool:
    """Whether a sampling option asks for ``min_size`` or ``samples_per_insert``."""
    return bool(getattr(options, "min_size", 0)) or (
        getattr(options, "samples_per_insert", None) is not None
    )


def least_tolerance(batch: int, r: float) -> float:
    """The smallest tolerance that can make progress: a band of ``2e`` rows must hold a
    whole batch and one row's samples, ``2e >= B + r``, and ``e >= B``."""
    return max(float(batch), (batch + r) / 2)


def default_tolerance(batch: int, r: float, min_size: int) -> float:
    """Acme's 10 % of ``min_size * r``, but at least two batches and ``B + r`` rows."""
    return max(TOLERANCE_FRACTION * min_size * r, 2.0 * batch, batch + r)
