"""The rate-limit options of the replay samplers, checked: the four flat fields or one
:class:`~grain_replay.store.rate_limit.RateLimit`, and the default tolerance."""

from __future__ import annotations

from typing import Any

from grain_replay.errors import ArgumentTypeError, InvalidSamplingError
from grain_replay.store.rate_limit import (
    TOLERANCE_FRACTION,
    RateLimit,
    check_rate_limit,
    default_tolerance,
    least_tolerance,
)

__all__ = [
    "TOLERANCE_FRACTION",
    "check_rate_limit",
    "default_tolerance",
    "is_rate_limited",
    "least_tolerance",
    "limit_of",
    "set_rate_limit",
]

_FIELDS = ("min_size", "samples_per_insert", "tolerance", "timeout")
# The flat fields' defaults: a field at its default was not given (the RateLimit names it).
_DEFAULTS = {"min_size": 0, "samples_per_insert": None, "tolerance": None, "timeout": None}


def set_rate_limit(options: Any) -> None:
    """Checks and normalizes the rate-limit fields of a frozen sampling dataclass.

    ``rate_limit=RateLimit(...)`` fills the four flat fields; a flat field given too (not at
    its default) must say the same, else the options are refused, naming both (a flat
    ``timeout`` may fill a limit's ``timeout=None``: it is this side's own wait).
    """
    owner = type(options).__name__
    limit = getattr(options, "rate_limit", None)
    if limit is not None and not isinstance(limit, RateLimit):
        raise ArgumentTypeError(
            f"{owner}: rate_limit must be a gr.RateLimit or None, got {limit!r} "
            f"({type(limit).__name__}). Fix: rate_limit=gr.RateLimit(min_size=..., "
            "samples_per_insert=...), or the flat fields min_size=, samples_per_insert=, ..."
        )
    values = check_rate_limit(owner, *(getattr(options, name) for name in _FIELDS))
    if limit is not None:
        differ = [
            f"{name}={value!r} but rate_limit.{name}={getattr(limit, name)!r}"
            for name, value in zip(_FIELDS, values)
            if value != _DEFAULTS[name]
            and value != getattr(limit, name)
            # timeout is this side's own wait: a flat one fills a limit's None
            and not (name == "timeout" and limit.timeout is None)
        ]
        if differ:
            raise InvalidSamplingError(
                f"{owner}: {'; '.join(differ)}: the flat fields are a shorthand for one "
                f"RateLimit, and these two disagree. Fix: pass rate_limit={limit!r} alone "
                "(or only the flat fields)."
            )
        timeout = limit.timeout if limit.timeout is not None else values[3]
        values = (limit.min_size, limit.samples_per_insert, limit.tolerance, timeout)
    for name, value in zip(_FIELDS, values):
        object.__setattr__(options, name, value)


def limit_of(options: Any) -> RateLimit | None:
    """The rate limit a sampling option asks for (its ``rate_limit``, or its flat fields),
    None without ``min_size`` or ``samples_per_insert``."""
    if not is_rate_limited(options):
        return None
    given = getattr(options, "rate_limit", None)
    if isinstance(given, RateLimit) and given.timeout == options.timeout:
        return given
    return RateLimit(**{name: getattr(options, name) for name in _FIELDS})


def is_rate_limited(options: Any) -> bool:
    """Whether a sampling option asks for ``min_size`` or ``samples_per_insert``."""
    return bool(getattr(options, "min_size", 0)) or (
        getattr(options, "samples_per_insert", None) is not None
    )
