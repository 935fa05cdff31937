"""A rate-limited learner's progress, published into the store for the writers that wait on it.

One file per learner process (``learners/process-<i>-of-<n>.json``, see
:mod:`grain_replay.store.progress`): written when the loader is built (the loader's
limiter holds it until its first iterator takes it over, :meth:`ProgressPublisher.rebind`),
when the counts change (coalesced over ``PUBLISH_EVERY_S``), at least every
``HEARTBEAT_S`` while the limiter lives, and withdrawn when it goes away, so writers
never wait on a learner that is gone (where the store declares a limit, the file stays,
marked closed: its writers hold at what the learner handed out).

One rate-limited learner per store, whatever process it runs in: a publisher
refuses to start while another learner's file is live (one of another process,
or of this one: each publisher holds a random token, written into its file), and
withdraws only the file that holds its own token.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import re
import secrets
import socket
import threading
import time
import weakref
from typing import Any

from grain_replay.errors import InvalidSamplingError
from grain_replay.pipeline import shutdown
from grain_replay.store import progress as learners_lib
from grain_replay.store.object_folder import ObjectFolder
from grain_replay.store.rate_limit import LIMIT_FILE

__all__ = ["HEARTBEAT_S", "PUBLISH_EVERY_S", "ProgressPublisher"]

logger = logging.getLogger(__name__)

# Progress is published at most this often (hand-outs in between are coalesced) ...
PUBLISH_EVERY_S = 0.005
# Into a bucket each publish is a PUT: coalesced over a longer while (writers there poll
# every 0.25 s at most).
OBJECT_PUBLISH_EVERY_S = 0.05
# ... and at least this often (the heartbeat), while the limiter lives.
HEARTBEAT_S = 2.0

# The tokens of this process's publishers that hold their file (claimed, not withdrawn).
_CLAIMED: set[str] = set()
_CLAIMED_LOCK = threading.Lock()
_NUMBERS = itertools.count(1)
_NAME = re.compile(r"process-(\d+)-of-(\d+)\.json")


def _processes(name: str) -> str | None:
    """The learner's process count a file name says (``process-<p>-of-<P>.json``)."""
    m = _NAME.fullmatch(name)
    return None if m is None else m.group(2)


def _read_all(directory: str | ObjectFolder) -> list[learners_lib.Progress]:
    try:
        if isinstance(directory, ObjectFolder):
            found = [name for name, _ in directory.entries()]
        else:
            found = [e.name for e in os.scandir(directory)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = sorted(
        n for n in found if n.endswith(".json") and not n.startswith(".") and n != LIMIT_FILE
    )
    out = []
    for name in names:
        p = learners_lib.read_progress(directory, name)
        if p is not None:
            out.append(p)
    return out


class ProgressPublisher:
    """Writes one learner process's progress file in ``directory``, with a heartbeat thread.

    The limiter that owns it (anything with ``publish()``) is held only weakly by
    the thread: when the limiter goes away, the thread stops and the file is withdrawn.
    At interpreter exit :mod:`grain_replay.pipeline.shutdown` closes it, if still open.
    """

    def __init__(
        self, directory: str | ObjectFolder, name: str, what: str = "rate-limited"
    ) -> None:
        self.directory = directory
        self.name = name
        self._every = (
            OBJECT_PUBLISH_EVERY_S if isinstance(directory, ObjectFolder) else PUBLISH_EVERY_S
        )
        # Identifies this learner among the learners of its process (and its file's owner).
        self.token = secrets.token_hex(8)
        self.label = f"{what} learner #{next(_NUMBERS)} of its process"
        self.started = False
        self._thread: threading.Thread | None = None
        # The owner the heartbeat thread publishes for, held weakly (one slot: rebind).
        self._owner: list[weakref.ReferenceType[Any]] = []
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def check(self) -> None:
        """Refuses to start while another rate-limited learner publishes into ``directory``.

        Another learner is a live file (fresh heartbeat, process alive) under this
        publisher's name that holds another token, in any process, this one included,
        or one whose name says another number of learner processes. A file of this
        process whose publisher is gone (garbage not yet collected, or a process
        before this one with the same pid) is taken over.

        Raises:
          InvalidSamplingError: naming the other learner (host, pid, label and token).
        """
        other = self._other()
        if other is not None and (other.host, other.pid) == (socket.gethostname(), os.getpid()):
            gc.collect()  # a learner dropped in a reference cycle withdraws its file now
            other = self._other()
        if other is not None:
            here = (other.host, other.pid) == (socket.gethostname(), os.getpid())
            where = "in this process" if here else f"in process {other.pid} on {other.host!r}"
            raise InvalidSamplingError(
                f"{self.directory}: another rate-limited learner samples this store {where}: "
                f"{other.describe()}. Expected one rate-limited learner per store (this one, "
                f"{self.label}, would publish as {self.name}). Fix: close() the other "
                "learner's iterator (or stop its process) before building or iterating this "
                "one; a learner that died is taken over once its heartbeat is "
                f"{other.stale_after:g} s old."
            )

    def _other(self) -> learners_lib.Progress | None:
        now = time.time()
        me = (socket.gethostname(), os.getpid())
        for p in _read_all(self.directory):
            if p.token == self.token or p.dead(now) is not None:
                continue
            if (p.host, p.pid) == me:
                with _CLAIMED_LOCK:
                    if p.token not in _CLAIMED:
                        continue  # withdrawn, or a leftover of an earlier process
            if p.name == self.name or _processes(p.name) != _processes(self.name):
                return p
        return None

    def start(self, owner: Any) -> None:
        """Claims the file (refusing another live learner, see :meth:`check`), starts
        the heartbeat and withdraws the file once ``owner`` is gone."""
        self.check()
        self.started = True
        self._stop = threading.Event()
        with _CLAIMED_LOCK:
            _CLAIMED.add(self.token)
        owner.publish()
        # Two learners starting at once both find no file: the last to write holds it.
        held = learners_lib.read_progress(self.directory, self.name)
        if held is not None and held.token != self.token:
            self.started = False
            self._stop.set()
            with _CLAIMED_LOCK:
                _CLAIMED.discard(self.token)
            self.check()  # raises, naming it (or the next change claims the file again)
            return
        self._owner = [weakref.ref(owner)]
        self._thread = threading.Thread(
            target=_heartbeat,
            args=(self._owner, self._dirty, self._stop, self._every),
            name="grain_replay-rate-limit",
            daemon=True,
        )
        self._thread.start()
        shutdown.register(self, ProgressPublisher.close)
        self._watch(owner)

    def _watch(self, owner: Any) -> None:
        # Withdraw the file when the owner goes away (or the interpreter exits).
        self._finalizer = weakref.finalize(
            owner, _stop_and_withdraw, self._stop, self._dirty, self._lock, self.directory,
            self.name, self.token,
        )  # fmt: skip

    def rebind(self, owner: Any) -> None:
        """Publishes for ``owner`` from now on (the file, its token and the heartbeat stay):
        the loader's limiter hands its file to its first iterator's, with no gap."""
        if not self.started:
            return
        self._finalizer.detach()
        self._owner[0] = weakref.ref(owner)
        self._watch(owner)
        owner.publish()

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
    ref: list[weakref.ReferenceType[Any]],
    dirty: threading.Event,
    stop: threading.Event,
    every: float,
) -> None:
    """Publishes coalesced changes, and a heartbeat, while the owner (``ref[0]``) lives."""
    while not stop.is_set():
        dirty.wait(HEARTBEAT_S)
        if stop.is_set():
            return
        time.sleep(every)
        dirty.clear()
        owner = ref[0]()
        if owner is None:
            return
        owner.publish()
        del owner


def _stop_and_withdraw(
    stop: threading.Event,
    dirty: threading.Event,
    lock: threading.Lock,
    directory: str | ObjectFolder,
    name: str,
    token: str,
) -> None:
    with lock:
        stop.set()
        learners_lib.withdraw(directory, name, token)  # only if the file is still ours
        with _CLAIMED_LOCK:
            _CLAIMED.discard(token)
    dirty.set()
