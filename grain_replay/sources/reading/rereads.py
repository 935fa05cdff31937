"""Reading a file again while its writer rewrites it: one loop for every format.

A reader may open a file that a ReplayWriter in another process is rewriting: an HDF5
file's metadata mid-flush (HDF5 without SWMR), a ``.npy`` leaf's header rewritten in
place at every commit. Such a read can fail, or succeed with a torn value (a mix of the
old and the new bytes). :func:`read_while_written` reads again on a schedule of pauses
and, when the reads never come out whole, raises what the last one showed.

The formats share the mechanism (the loop, the pauses, the gate, the final error), not
one schedule, because their premises differ:

* HDF5 (:data:`grain_replay.sources.hdf5.raw.OPEN_REREADS`): a failed open is read again
  only while the file is seen being written (its mtime or size moved during the read, or
  it was written within the last 0.2 s): a broken file nobody writes fails at once, not
  after a pointless wait. A writer's flush takes milliseconds, so the pauses double
  from 5 ms (6 reads, 155 ms in all). What a reader gets of a file another process
  holds open for writing (the flushed rows and a warning, SWMR, a refusal) is
  ``grain_replay.sources.hdf5.held``'s.
* ``.npy`` (``grain_replay.sources.npy``): a read of the page cache is not ordered
  against a write to it, so a header can read torn with no change of mtime or size
  visible to ``stat``: it is read again whatever ``stat`` says. A header rewrite takes
  microseconds, so the pauses grow by 0.5 ms (8 reads, 14 ms in all).

Each site passes its :class:`RereadPolicy`; the errors and their messages are the site's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["RereadPolicy", "doubling", "growing", "read_while_written"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RereadPolicy:
    """When and how often a read that failed, or read torn, is made again.

    Attributes:
      pauses_s: the pause before each read again (seconds); the reads are one more.
      retried: the exceptions of a read that may be torn (others propagate at once).
      never_retried: subclasses of ``retried`` that never are (a missing file, a refusal).
      while_written_s: None: read again whatever the file's state. Otherwise read again
        only while the file is seen being written: its mtime or size changed during the
        read, or its mtime is less than this many seconds old.
    """

    pauses_s: tuple[float, ...]
    retried: tuple[type[Exception], ...]
    never_retried: tuple[type[Exception], ...] = ()
    while_written_s: float | None = None

    @property
    def reads(self) -> int:
        """Reads at most, the first included."""
        return len(self.pauses_s) + 1


def doubling(first_s: float, reads: int) -> tuple[float, ...]:
    """The pauses between ``reads`` reads, doubling from ``first_s``."""
    return tuple(first_s * 2**i for i in range(reads - 1))


def growing(step_s: float, reads: int) -> tuple[float, ...]:
    """The pauses between ``reads`` reads, growing by ``step_s`` from ``step_s``."""
    return tuple(step_s * (i + 1) for i in range(reads - 1))


def _written(path: str, before: os.stat_result, within_s: float) -> bool:
    """Whether ``path`` changed since ``before`` or was written within ``within_s``."""
    after = os.stat(path)
    if (after.st_mtime_ns, after.st_size) != (before.st_mtime_ns, before.st_size):
        return True
    return time.time() - after.st_mtime <= within_s


def read_while_written(
    read: Callable[[], T],
    policy: RereadPolicy,
    *,
    path: str,
    check: Callable[[T], Exception | None] | None = None,
) -> T:
    """``read()``, made again while it fails or reads torn, as ``policy`` says.

    Args:
      read: reads ``path`` (or what lies in it); may raise ``policy.retried``.
      policy: the schedule, the exceptions read again, and the gate on the file's state.
      path: the file being read (``stat``ed when the policy gates on writes; named in
        the debug log).
      check: None for a value that is whole; else the error to raise if every read
        comes out like this one (a torn value, or a file that is corrupt for good).

    Returns:
      The first value read whole.

    Raises:
      The last read's exception when no read succeeded, or ``check``'s error for the
      last value when none was whole; at once when the gate says nobody writes ``path``.
    """
    gated = policy.while_written_s is not None
    for attempt in range(policy.reads):
        if attempt:
            time.sleep(policy.pauses_s[attempt - 1])
        # The file's state before the read: a change during it means a writer is at work.
        # (a missing file raises FileNotFoundError here, as the read would)
        before = os.stat(path) if gated else None
        last = attempt + 1 == policy.reads
        try:
            value = read()
        except policy.retried as e:
            if last or isinstance(e, policy.never_retried) or not _again(path, before, policy):
                raise
            logger.debug("%s: read failed while the file may be written (%s); again", path, e)
            continue
        error = None if check is None else check(value)
        if error is None:
            return value
        if last or not _again(path, before, policy):
            raise error
        logger.debug("%s: read torn while the file may be written (%s); again", path, error)
    raise AssertionError("unreachable")  # the last read returns or raises


def _again(path: str, before: os.stat_result | None, policy: RereadPolicy) -> bool:
    """Whether the gate lets a failed read be made again."""
    if before is None or policy.while_written_s is None:
        return True
    return _written(path, before, policy.while_written_s)
