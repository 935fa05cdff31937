"""Opening an HDF5 file read-only when another process may hold it open for writing.

HDF5 tells a reader about a writer in two ways, and h5py's errors say which:

* the file lock (``flock``): a writer that opened the file with locking (h5py's
  default) holds it exclusively, and a reader's locking open fails ("unable to lock
  file"). Read without locking, such a file serves what the writer has flushed so far;
  HDF5 orders nothing against that writer's later flushes (no SWMR), so a reader keeps
  that prefix until the writer lets go (:attr:`Access.HELD`).
* the superblock's status flags (files of ``libver='latest'``): "file is already open
  for write". A writer in SWMR mode (``f.swmr_mode = True``) released the lock and
  lets a reader in with ``swmr=True``, which sees the rows it flushes later after
  ``Dataset.refresh()`` (:attr:`Access.SWMR`); any other such writer lets no reader in
  until it closes the file, and a writer that died with the file open leaves the flags
  set until ``h5clear -s`` (both refused, with the fix).

A writer that opens without locking (grain_replay's ReplayWriter, or
``HDF5_USE_FILE_LOCKING=FALSE``) shows neither: ReplayWriter's stores are read through
their own commit protocol (metadata rewritten in place after the rows), not SWMR.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import os
from collections.abc import Mapping
from typing import Any

from grain_replay.errors import InvalidStoreError, WriterBusyError
from grain_replay.store.optional import import_h5py

__all__ = ["Access", "fresh", "lock_held", "open_h5", "say_written", "written_prefix"]

logger = logging.getLogger(__name__)


class Access(enum.Enum):
    """Who else has an HDF5 file open, as a reader opening it can tell."""

    FREE = "free"  # no writer holds HDF5's lock (or one writes without locking)
    HELD = "held"  # a writer holds the lock, not in SWMR mode: the flushed prefix only
    SWMR = "swmr"  # a writer in SWMR mode: opened with swmr=True, refresh() sees more


def lock_held(path: str) -> bool:
    """Whether a process holds HDF5's exclusive lock on ``path`` (an open for writing).

    Probes with a shared, non-blocking ``flock`` on a descriptor of its own, as HDF5
    locks (``flock`` locks belong to the open file description: this probe neither
    disturbs nor is disturbed by this process's own read-only HDF5 handles). False
    where the filesystem has no ``flock``.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _flagged(e: OSError) -> bool:
    """Whether h5py refused the open for the superblock's "open for write" flags."""
    return "already open for write" in str(e)


def _open(path: str, **kwargs: Any) -> tuple[Any, bool]:
    """Read-only, with HDF5's file locking, or without it where the lock is refused;
    and whether it was refused.

    Locking stays on for compatibility with other h5py users in this process. A file
    this process already opened without locking (a ReplayWriter here) refuses a locking
    open ("locking flag values don't match"), as does a writer's lock, or a filesystem
    without ``flock``: all three are opened again without locking.
    """
    h5py = import_h5py()
    try:
        return h5py.File(path, "r", **kwargs), False
    except OSError as e:
        if "lock" not in str(e).lower():
            raise
        return h5py.File(path, "r", locking=False, **kwargs), True


def open_h5(path: str) -> tuple[Any, Access]:
    """``path`` opened read-only (an ``h5py.File``), and what holds it for writing.

    Raises:
      WriterBusyError: a writer holds the file open and its format (``libver='latest'``,
        not in SWMR mode) lets no reader in until it closes it.
      InvalidStoreError: the file says it is open for writing but nobody holds it: its
        writer died before closing it.
      OSError: what h5py raised otherwise.
    """
    try:
        f, refused = _open(path)
    except OSError as e:
        if not _flagged(e):
            raise
        try:
            f, _ = _open(path, swmr=True)
        except OSError as again:
            if not _flagged(again) and "not already open for SWMR" not in str(again):
                raise
            raise _flagged_error(path) from again
        return f, Access.SWMR
    if f.swmr_mode:  # shared with this process's SWMR handle on the file
        return f, Access.SWMR
    if not refused:  # HDF5 took the shared lock: no writer holds the exclusive one
        return f, Access.FREE
    # Refused by a writer's lock, or for one of the other reasons: ask the lock itself.
    try:
        held = lock_held(path)
    except BaseException:
        f.close()
        raise
    return f, Access.HELD if held else Access.FREE


def _flagged_error(path: str) -> Exception:
    """The refusal of a file whose superblock says a writer has it open, SWMR aside."""
    if lock_held(path):
        return WriterBusyError(
            f"{path} is open for writing in another process (an HDF5 file of "
            "libver='latest' not in SWMR mode), and HDF5 lets no reader open it until that "
            "writer closes it. Fix: read it after the writer closes the file; or have the "
            "writer switch to SWMR mode (f.swmr_mode = True once its datasets exist), "
            "which lets readers in and shows them the rows it flushes; or read a copy "
            "taken after the writer's flush()."
        )
    return InvalidStoreError(
        f"{path} is marked as open for writing (HDF5 superblock status flags) but no "
        "process holds it: its writer died before closing it. Fix: if no process "
        f"writes it any more, clear the flags with `h5clear -s {path}` (HDF5's tools), "
        "then check it with `grain-replay verify`; or re-write it."
    )


def fresh(dset: Any, access: Access) -> Any:
    """``dset`` with its shape and chunk index read again when SWMR lets it change.

    A file opened again in one process shares HDF5's metadata cache with the open
    already there: without ``refresh()`` its datasets show the extent of that first open.
    """
    if access is Access.SWMR:
        dset.refresh()
    return dset


def written_prefix(path: str, found: Mapping[str, Any], lengths: dict[str, int]) -> int | None:
    """The rows every leaf holds of a file being written, whose leaves grow one by one.

    A writer extends its datasets one after another: a reader may see some longer than
    others. Their common rows are the consistent prefix, if each leaf that is behind can
    still grow (else the lengths differ for good: None, and the usual error).
    """
    n = min(lengths.values())
    if n == max(lengths.values()):
        return n
    behind = [k for k, rows in lengths.items() if rows == n]
    if any(found[k].maxshape[0] is not None and found[k].maxshape[0] <= n for k in behind):
        return None
    logger.debug(
        "%s: being written, leaves of %s rows: reading the %d rows all of them hold",
        path,
        sorted(set(lengths.values())),
        n,
    )
    return n


def say_written(path: str, access: Access, rows: int) -> None:
    """Logs that ``path`` is open for writing in another process, and what a reader sees.

    A writer holding HDF5's lock (not SWMR) is a warning: the rows it flushes later
    will not be seen. A SWMR writer is information: ``refresh()`` reads them.
    """
    if access is Access.HELD:
        logger.warning(
            "%s is open for writing in another process (it holds HDF5's file lock, not in "
            "SWMR mode): reading the %d rows it has flushed. Rows it flushes later will "
            "not be seen, not even after refresh(), until it closes the file (HDF5 "
            "without SWMR orders nothing between its flushes and a reader). Fix: to read "
            "rows while they are written, have the writer open the file with "
            "libver='latest' and set f.swmr_mode = True; or read the file after the "
            "writer closes it.",
            path,
            rows,
        )
    elif access is Access.SWMR:
        logger.info(
            "%s is being written in SWMR mode by another process: reading the %d rows it "
            "has flushed; refresh() reads the rows it flushes later.",
            path,
            rows,
        )
