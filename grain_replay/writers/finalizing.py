"""Whether this thread is running the garbage collector's finalizers.

The collector runs a finalizer (``__del__``) of an object in a reference cycle inside
whatever its thread was doing when an allocation started the collection, with that
thread's locks held: a thread pool's while it submits (a commit's fsyncs), a registry's,
a writer's own. A finalizer that would take such locks or wait (a writer's close) asks
:func:`collecting` and hands that work to a thread of its own instead.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["close_forgotten", "collecting"]

_state = threading.local()


def _phase(phase: str, info: dict[str, Any]) -> None:
    # Called by the collecting thread before its collection ("start") and after ("stop").
    _state.collecting = phase == "start"


gc.callbacks.append(_phase)


def collecting() -> bool:
    """Whether the garbage collector runs in this thread now (finalizers included)."""
    return bool(getattr(_state, "collecting", False))


def close_forgotten(close: Callable[[], object], name: str) -> None:
    """Runs ``close`` (errors suppressed) for an object its owner forgot to close, from its
    ``__del__``: on a thread of its own (named ``name``) when the garbage collector runs it.

    The collector runs it inside whatever the collecting thread was doing, its locks held (the
    fsync pool's, while it submits a commit's fsyncs): a close, which takes such locks and
    waits, then runs on a thread of its own (non-daemon: the interpreter waits for the commit
    at exit). Not in the interpreter's last collections (finalizing: no Python frame runs, so
    no lock is held; a thread started then never runs, and start() waits for it forever): the
    close runs here.
    """

    def quietly() -> None:
        with contextlib.suppress(Exception):
            close()

    if collecting() and not sys.is_finalizing():
        closer = threading.Thread(target=quietly, name=name)
        try:
            closer.start()
            return
        except RuntimeError:  # no new thread while the interpreter exits: close here
            pass
    quietly()
