"""The device writer's second thread: the store's sync after writes, one run at a time.

A many-writer store commits the segments its writes filled (``fsync`` waits
included) in ``sync``; run here, those waits hold up neither the caller nor the
writer thread's next copies and writes (:mod:`grain_replay.writers.device.background`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from grain_replay.errors import BackgroundWriteError
from grain_replay.writers.write_errors import sync_error, thread_error

__all__ = ["SyncThread"]


class SyncThread:
    """Runs ``sync(caller_waits)`` on a thread of its own after writes, one run at a time.

    It shares the writer's lock: ``work`` (where the threads wait for work) and
    ``done`` (where callers wait for the threads) are the writer's two conditions on
    it, and the methods named ``*_locked`` are called with it held. ``held()``: the
    writer runs a commit, which a sync waits for; ``failed()``: the writer failed, so
    no sync runs again; ``fail_locked(error)`` hands it a sync's failure;
    ``caller_waits()``, passed to ``sync``: a caller waits for the threads (a sync may
    then leave the rest to the flush).
    """

    def __init__(
        self,
        sync: Callable[[Callable[[], bool]], None],
        where: str,
        work: threading.Condition,
        done: threading.Condition,
        *,
        held: Callable[[], bool],
        failed: Callable[[], bool],
        fail_locked: Callable[[BackgroundWriteError], None],
        caller_waits: Callable[[], bool],
    ) -> None:
        self._sync = sync
        self._where = where
        self._work = work
        self._done = done
        self._held = held
        self._failed = failed
        self._fail_locked = fail_locked
        self._caller_waits = caller_waits
        self.wanted = False  # a write finished since the last sync started
        self.running = False  # a sync runs now
        self._thread: threading.Thread | None = None

    def pending_locked(self) -> bool:
        """Whether a sync is asked for or running."""
        return self.wanted or self.running

    def start_locked(self) -> None:
        """Asks for one more sync, soon; starts the thread on the first."""
        self.wanted = True
        if self._thread is None:  # set once started: one that cannot start is not joined
            thread = threading.Thread(
                target=self._run, name="grain_replay-device-syncs", daemon=True
            )
            thread.start()
            self._thread = thread
        self._work.notify_all()

    def detach_locked(self) -> threading.Thread | None:
        """Lets the thread end once it runs the sync asked for, if any (the caller
        notifies ``work``); returns it, to join."""
        thread, self._thread = self._thread, None
        return thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # outside the sync (a bug): the writer fails, no one waits
            with self._done:
                self.running = False
                self._fail_locked(thread_error(self._where, "sync", e))
                self._done.notify_all()
            if not isinstance(e, Exception):
                raise

    def _loop(self) -> None:
        while True:
            with self._work:
                while (
                    (not self.wanted or self._held())
                    and self._thread is not None
                    and not self._failed()
                ):
                    self._work.wait()
                if not self.wanted or self._held() or self._failed():
                    return
                self.wanted, self.running = False, True
            error = None
            try:
                self._sync(self._caller_waits)
            except Exception as e:
                error = sync_error(self._where, e)
            with self._done:
                self.running = False
                if error is not None:
                    self._fail_locked(error)
                self._done.notify_all()
            if error is not None:
                return
