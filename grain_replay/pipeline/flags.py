"""Lets grain start worker processes from a plain script (no ``absl.app.run``)."""

from __future__ import annotations

__all__ = ["ensure_absl_flags_parsed"]


def ensure_absl_flags_parsed() -> None:
    """Marks absl flags as parsed if nobody parsed them, keeping their defaults.

    grain 0.2.x reads absl flags when it starts workers and raises
    ``UnparsedFlagAccessError`` in a script that never ran ``absl.app.run``.
    Flags a user already parsed are left untouched.
    """
    try:
        from absl import flags
    except ImportError:  # grain depends on absl; nothing to do without it
        return
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
