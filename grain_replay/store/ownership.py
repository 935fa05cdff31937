"""Who holds a writer id of a many-writer store: an exclusive ``flock`` on
``writers/<id>/lock``, released by the kernel when its holder dies, and ``owner.json`` (host,
pid, start time) naming the live holder in errors."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from typing import Any

from grain_replay.errors import WriterBusyError
from grain_replay.store.filesync import replace_text
from grain_replay.store.parts import writer_dir

__all__ = ["LOCK_FILE", "OWNER_FILE", "acquire_writer_lock", "live_holder", "read_owner"]

LOCK_FILE = "lock"
OWNER_FILE = "owner.json"


def read_owner(wdir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(wdir, OWNER_FILE)) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def live_holder(wdir: str) -> dict[str, Any] | None:
    """The owner of a writer id while a live process holds its lock, else None.

    Probes with a shared, non-blocking ``flock`` on ``lock``: it fails only while a
    writer holds the exclusive one (a dead writer's lock was released by the kernel).
    """
    try:
        fd = os.open(os.path.join(wdir, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return read_owner(wdir) or {"pid": None}
    finally:
        os.close(fd)  # closing also drops the probe's own shared lock
    return None


def acquire_writer_lock(store: str, writer_id: str) -> int:
    """Holds the writer id (exclusive ``flock`` on ``writers/<id>/lock``); returns the fd.

    The kernel releases the lock when its holder dies (any signal, SIGKILL
    included), so a dead holder's id is taken over by the next writer; a live
    one keeps it and the error names it from ``owner.json``.

    Raises:
      WriterBusyError: a live writer holds the id.
    """
    wdir = writer_dir(store, writer_id)
    os.makedirs(wdir, exist_ok=True)
    lock = os.path.join(wdir, LOCK_FILE)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        owner = read_owner(wdir)
        who = (
            f"pid {owner.get('pid')} on host {owner.get('host')!r}, since {owner.get('started')}"
            if owner
            else "an unknown process"
        )
        raise WriterBusyError(
            f"{store}: writer_id {writer_id!r} is held by a live writer ({who}). Fix: give "
            "this writer another writer_id, or close that writer first (the id of a writer "
            "that died is free again)."
        ) from e
    replace_text(
        os.path.join(wdir, OWNER_FILE),
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        ),
    )
    return fd
