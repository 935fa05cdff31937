"""A rate-limited learner's progress, published into the store for the writers that wait on it.

One file per learner process (``learners/process-<i>-of-<n>.json``, see
:mod:`grain_replay.store.progress`): written when the counts change (coalesced over
``PUBLISH_EVERY_S``), at least every ``HEARTBEAT_S`` while the limiter lives, and
withdrawn when it goes away, so writers never wait on a learner that is gone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from grain_replay.errors import InvalidSamplingError
from grain_replay.pipeline import shutdown
from grain_replay.store import progress as learners_lib

__all__ = ["HEARTBEAT_S", "PUBLISH_EVERY_S", "ProgressPublisher"]

logger = logging.getLogger(__name__)

# Progress is published at most this often (hand-outs in between are coalesced) ...
PUBLISH_EVERY_S = 0.005
# ... and at least this often (the heartbeat), while the limiter lives.
HEARTBEAT_S = 2.0


class ProgressPublisher:
    """Writes one learner process's progress file in ``directory``, with a heartbeat thread.

    The limiter that owns it (anything with ``publish()``) is held only weakly by
    the thread: when the limiter goes away, the thread stops and the file is withdrawn.
    At interpreter exit :mod:`grain_replay.pipeline.shutdown` closes it, if still open.
    """

    def __init__(self, directory: str, name: str) -> None:
        self.directory = directory
        self.name = name
        self.started = False
        self._thread: threading.Thread | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def start(self, owner: Any) -> None:
        """Claims the file (refusing a live learner publishing under the same name), starts
        the heartbeat and withdraws the file once ``owner`` is gone."""
        other = learners_lib.read_progress(self.directory, self.name)
        if (
            other is not None
            and (other.pid, other.host) != (os.getpid(), socket.gethostname())
            and other.dead(time.time()) is None
        ):
            raise InvalidSamplingError(
                f"{self.directory}: another rate-limited learner publishes as {self.name}: "
                f"{other.describe()}. Fix: one rate-limited learner per store (stop the other; "
                f"a learner that died is taken over once its heartbeat is "
                f"{other.stale_after:g} s old)."
            )
        self.started = True
        self._stop = threading.Event()
        owner.publish()
        self._thread = threading.Thread(
            target=_heartbeat,
            args=(weakref.ref(owner), self._dirty, self._stop),
            name="grain_replay-rate-limit",
            daemon=True,
        )
        self._thread.start()
        shutdown.register(self, ProgressPublisher.close)
        # Withdraw the file when the owner goes away (or the interpreter exits).
        self._finalizer = weakref.finalize(
            owner, _stop_and_withdraw, self._stop, self._dirty, self._lock, self.directory,
            self.name,
        )  # fmt: skip

    def changed(self) -> None:
        """The counts changed: the heartbeat thread publishes them soon."""
        self._dirty.set()

    def write(self, progress: learners_lib.Progress) -> None:
        """Writes ``progress`` now, unless the file was withdrawn."""
        with self._lock:
            if self._stop.is_set():  # withdrawn: a late heartbeat must not bring it back
                return
            try:
                learners_lib.publish(self.directory, progress)
            except OSError as e:  # a full disk must not stop training; writers go on
                logger.warning(
                    "%s: could not publish the learner's progress: %s", self.directory, e
                )

    def close(self) -> None:
        """Stops publishing and withdraws the file (writers stop waiting on it)."""
        if not self.started:
            return
        self.started = False
        shutdown.unregister(self)
        self._finalizer()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


def _heartbeat(
    ref: weakref.ReferenceType[Any], dirty: threading.Event, stop: threading.Event
) -> None:
    """Publishes coalesced changes, and a heartbeat, while the owner lives."""
    while not stop.is_set():
        dirty.wait(HEARTBEAT_S)
        if stop.is_set():
            return
        time.sleep(PUBLISH_EVERY_S)
        dirty.clear()
        owner = ref()
        if owner is None:
            return
        owner.publish()
        del owner


def _stop_and_withdraw(
    stop: threading.Event,
    dirty: threading.Event,
    lock: threading.Lock,
    directory: str,
    name: str,
) -> None:
    with lock:
        stop.set()
        learners_lib.withdraw(directory, name)
    dirty.set()
