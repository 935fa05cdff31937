"""Whether this thread is running the garbage collector's finalizers.

The collector runs a finalizer (``__del__``) of an object in a reference cycle inside
whatever its thread was doing when an allocation started the collection, with that
thread's locks held: a thread pool's while it submits (a commit's fsyncs), a registry's,
a writer's own. A finalizer that would take such locks or wait (a writer's close) asks
:func:`collecting` and hands that work to a thread of its own instead.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

__all__ = ["collecting"]

_state = threading.local()


def _phase(phase: str, info: dict[str, Any]) -> None:
    # Called by the collecting thread before its collection ("start") and after ("stop").
    _state.collecting = phase == "start"


gc.callbacks.append(_phase)


def collecting() -> bool:
    """Whether the garbage collector runs in this thread now (finalizers included)."""
    return bool(getattr(_state, "collecting", False))
