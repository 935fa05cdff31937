"""Atomic commits: write to a ``.partial`` path, then swap it into place."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import uuid
from collections.abc import Iterator

from grain_replay.errors import StoreExistsError
from grain_replay.store.filesync import fsync_path, temp_path

__all__ = ["atomic_path", "fsync_path", "fsync_tree", "remove_path"]

logger = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _syncfs(path: str) -> bool:
    """One ``syncfs(2)`` for the file system holding ``path``; False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syncfs = libc.syncfs
    except (OSError, AttributeError):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return syncfs(fd) == 0
    finally:
        os.close(fd)


# Above this many files, one syncfs beats an fsync (and a journal commit) per file.
_SYNCFS_MIN_FILES = 16


def fsync_tree(path: str) -> None:
    """Flushes a file, or every file and directory below ``path``, to stable storage."""
    if not os.path.isdir(path):
        fsync_path(path)
        return
    entries = [(d, files) for d, _, files in os.walk(path)]
    if sum(len(f) for _, f in entries) >= _SYNCFS_MIN_FILES and _syncfs(path):
        return
    for dirpath, filenames in entries:
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def _exchange(a: str, b: str) -> bool:
    """Atomically swaps two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _commit(partial: str, path: str) -> None:
    replaceable = not os.path.lexists(path) or (os.path.isfile(partial) and not os.path.isdir(path))
    if replaceable or os.path.islink(path):
        os.replace(partial, path)  # atomic for a file, or onto nothing
        return
    # rename(2) cannot replace a directory, nor a file by a directory: swap the
    # two atomically, then delete the old store, which now sits at `partial`.
    if _exchange(partial, path):
        remove_path(partial)
        return
    old = f"{path}.{uuid.uuid4().hex[:8]}.old"
    logger.warning("renameat2 unsupported here; replacing %s in two renames", path)
    os.rename(path, old)
    os.rename(partial, path)
    remove_path(old)


@contextlib.contextmanager
def atomic_path(
    path: str, *, overwrite: bool, suffix: str = ".partial", sync: bool = True
) -> Iterator[str]:
    """Yields a ``.partial`` path to write; on success it replaces ``path`` atomically.

    A crash or an exception leaves ``path`` untouched (the old store or nothing)
    and removes the partial write.

    ``sync=False`` skips the fsyncs, for a store whose durability a later commit
    provides (a segment of a many-writer store, named only by a later manifest).

    Raises:
      StoreExistsError: ``path`` exists and ``overwrite`` is False.
    """
    if os.path.lexists(path) and not overwrite:
        raise StoreExistsError(
            f"{path} already exists. Fix: pass overwrite=True to replace it, or choose "
            "another path."
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    # filesync's naming rule; the swap itself is not filesync.atomic_replace, since a
    # store may be a directory, which rename(2) cannot replace (see _commit).
    partial = temp_path(path, suffix)
    try:
        yield partial
        if sync:
            fsync_tree(partial)
        _commit(partial, path)
        if sync:
            fsync_path(parent)
    except BaseException:
        remove_path(partial)
        raise
