"""The end of an appending writer: the store's lock held from construction to close/abandon."""

from __future__ import annotations

import abc
import os

from grain_replay.errors import GrainReplayError

__all__ = ["LockedWriter"]


class LockedWriter(abc.ABC):
    """``closed``, ``close()`` and the lock of a writer that holds its store's lock file open.

    ``close()`` commits what is pending (:meth:`_finish`), then, even when that
    fails, lets go of the open files (:meth:`_let_go`) and of the lock; once closed,
    ``close()`` does nothing. ``abandon()`` stays each writer's own.
    """

    _lock_fd: int | None

    @abc.abstractmethod
    def _finish(self) -> None:
        """Commits the pending rows (the part of ``close()`` that may fail)."""

    @abc.abstractmethod
    def _let_go(self) -> None:
        """Drops the writer's open files, whether or not :meth:`_finish` succeeded."""

    @property
    def closed(self) -> bool:
        return self._lock_fd is None

    def close(self) -> None:
        """Commits pending rows and releases the store."""
        if self._lock_fd is None:
            return
        try:
            self._finish()
        finally:
            self._let_go()
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            # The lock file stays: deleting it would let a writer waiting on the
            # old inode and a new one on a fresh file both hold "the" lock.
            os.close(self._lock_fd)
            self._lock_fd = None

    def _check_open(self, where: str) -> None:
        if self._lock_fd is None:
            raise GrainReplayError(
                f"{where}: the ReplayWriter is closed. Fix: append before close() (or the "
                "end of its with-block), or open a new gr.ReplayWriter on the same path: "
                "it continues after the committed rows."
            )
