"""A compiled kernel loaded once a process, in a daemon thread, while callers go on.

Importing numba and loading a kernel from its cache takes ~0.5-1 s: too long for a
worker's first batch. So the first caller starts the load in a thread and takes the
uncompiled route meanwhile; later callers get the kernel once it is there. A process
forked after the load started starts its own (threads do not survive a fork).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["BackgroundLoad"]

logger = logging.getLogger(__name__)


class BackgroundLoad:
    """``compiled()`` (a kernel, or None without numba), warmed by ``warm(kernel)``.

    Args:
      compiled: makes the kernel (cached by the caller) or returns None.
      warm: dispatches it once on the usual argument types; an error there is
        logged, never raised (each call compiles what it needs).
      what: the kernel, in words, for that log line.
    """

    def __init__(self, compiled: Callable[[], Any], warm: Callable[[Any], None], what: str):
        self._compiled, self._warm, self._what = compiled, warm, what
        self._loaded: list[Any] = []  # [kernel or None] once this process has it
        self.started_in = 0  # the process whose thread is loading it
        self._lock = threading.Lock()

    def fresh(self) -> BackgroundLoad:
        """The same load, not started (for tests of the first call)."""
        return BackgroundLoad(self._compiled, self._warm, self._what)

    def loaded(self, wait: bool = False) -> Any:
        """The kernel once this process has loaded it, else None (the uncompiled route).

        The first call starts loading it in a daemon thread (``grain_replay-numba-load``);
        ``wait=True`` loads it here instead.
        """
        if self._loaded:
            return self._loaded[0]
        if wait:
            self._load()
            return self._loaded[0]
        with self._lock:
            if self.started_in != os.getpid():  # not started in this process (or before a fork)
                self.started_in = os.getpid()
                threading.Thread(
                    target=self._load, name="grain_replay-numba-load", daemon=True
                ).start()
        return None

    def _load(self) -> None:
        kernel = self._compiled()
        if kernel is not None:
            try:
                self._warm(kernel)
            except Exception:  # never fatal: each call compiles what it needs
                logger.exception("warming up %s failed", self._what)
        with self._lock:
            if not self._loaded:
                self._loaded.append(kernel)
