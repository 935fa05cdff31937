"""What ``sharded_device_put(pinned=, packed=)`` gives on this backend: pinned host staging
where the backend has it and it was not measured to lose, packed transfers by default on TPU."""

from __future__ import annotations

import logging

import jax

from grain_replay.errors import InvalidArgumentError

__all__ = ["INLINE", "has_pinned_host", "inline_feed", "packed_default", "pinned_if_available"]

# Read ahead in the caller's thread (device/inline_feed.py) instead of a producer thread.
# None: where it was measured to pay (TPU: every jax call costs the host ~0.12 ms there and
# small steps are bound by their own dispatch), else the thread.
INLINE: bool | None = None

# the name sharded_device_put's warnings have always been logged under
logger = logging.getLogger("grain_replay.device.put")


def has_pinned_host() -> bool:
    """Whether the default backend's devices have a ``pinned_host`` memory space."""
    return any(m.kind == "pinned_host" for m in jax.local_devices()[0].addressable_memories())


def pinned_if_available(pinned: bool) -> bool:
    """``pinned``, unless the backend has no pinned host memory or it was measured to lose
    there (TPU): then False, with a warning saying why."""
    if pinned and not has_pinned_host():
        logger.warning(
            "sharded_device_put(pinned=True): the %s backend has no pinned_host memory; "
            "putting pageable host batches instead",
            jax.default_backend(),
        )
        return False
    if pinned and jax.default_backend() == "tpu":
        logger.warning(
            "sharded_device_put(pinned=True) is off on TPU: measured slower than pageable "
            "puts on a v5e (numpy -> pinned_host runs at 0.4-0.6 GB/s; even a reused pinned "
            "buffer filled in place then moved to HBM reached 4.3 GB/s for frame batches, "
            "against 13.3 GB/s for a packed pageable buffer, 4 in flight; "
            "benchmarks/probe_link.py). Putting pageable host batches instead; "
            "docs/loader.md has the numbers."
        )
        return False
    return pinned


def packed_default(packed: bool | None) -> bool:
    """``packed=None``: on where it was measured to pay (TPU, batches that go several to
    a transfer), else off."""
    if packed is None:
        return jax.default_backend() == "tpu"
    if not isinstance(packed, bool):
        raise InvalidArgumentError(
            f"packed must be True, False or None (None: on for TPU), got {packed!r}. "
            "Fix: packed=None."
        )
    return packed


def inline_feed() -> bool:
    """Whether ``sharded_device_put`` reads ahead in the caller's thread (see ``INLINE``)."""
    return jax.default_backend() == "tpu" if INLINE is None else INLINE
