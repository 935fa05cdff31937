"""Durable file writes below the writers: the one temp-file naming rule, atomic replaces.

Every replacement of a file by a new version goes through here: it is written to
:func:`temp_path` beside the target (the same directory, so the rename is atomic
and never crosses a file system), then renamed over it. One naming rule,
``<name>.<pid>.<random>.partial``, serves every site: two processes or threads
replacing one path never write the same temp file, and the listings that read a
folder by suffix (``*.json`` progress files, ``*.npy`` leaves, the npy reader's
walk that skips ``*.partial`` folders) never see it.

- :func:`atomic_replace`: a context manager yielding the temp file, open; on a clean
  exit it is renamed over the target (``durable=True``: with ``fsync`` of the file,
  then of the directory); on an exception it is removed and the target is untouched.
- :func:`stage_text` / :func:`publish_text`: the same in two steps, for a caller that
  syncs many files in one round before renaming (a part's manifest, a segment's
  metadata); :func:`replace_text` is both in one call.

Two kinds of site keep their own rename logic but take their temp names from
:func:`temp_path`: ``writers/atomic.py`` swaps a whole store, which may be a
directory (``rename(2)`` cannot replace a directory: it exchanges the two), and the
create-if-absent files (``store/parts.py``'s store file, the RLDS frame cache),
which are ``link``ed into place so that an existing file is never replaced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
from collections.abc import Iterator
from typing import BinaryIO

__all__ = [
    "pid_alive",
    "StagedText",
    "atomic_replace",
    "fsync_path",
    "publish_text",
    "replace_text",
    "stage_text",
    "temp_path",
    "temp_siblings",
]


def fsync_path(path: str) -> None:
    """``fsync`` of one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: str, suffix: str = ".partial") -> str:
    """A fresh temp name beside ``path``: ``<path>.<pid>.<random><suffix>``.

    The pid and 32 random bits keep concurrent writers (processes, or threads of one)
    of one path apart; the suffix keeps listings by suffix from taking it for data.
    """
    return f"{path}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"


def temp_siblings(path: str) -> list[str]:
    """The temp files or folders of ``path`` (by :func:`temp_path`'s rule) beside it, sorted.

    Also matches ``<path>.<hex>.partial``, the name writes used before the rule.
    """
    parent, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"(\.[0-9a-f]+)+(\.npy)?\.partial")
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return sorted(os.path.join(parent, n) for n in names if pattern.fullmatch(n))


@contextlib.contextmanager
def atomic_replace(path: str, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Yields a new binary file that replaces ``path`` when the block exits cleanly.

    Readers of ``path`` see the old file or the new one, never a mix. On an
    exception the temp file is removed and ``path`` stays as it was.

    Args:
      path: the file to replace (or create).
      durable: ``fsync`` the new file before the rename and the directory after it,
        so that a crash (power loss) keeps the new file; False for a cache or a live
        hint, which a crash may lose or leave old.

    Raises:
      OSError: the temp file cannot be made (read-only folder, full disk), or the
        rename failed; ``path`` is untouched.
    """
    tmp = temp_path(path)
    f = open(tmp, "xb")  # exclusive: never another writer's temp file
    try:
        try:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        finally:
            f.close()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_path(os.path.dirname(os.path.abspath(path)))


def replace_text(path: str, text: str) -> None:
    """Replaces ``path`` with ``text``: tmp + fsync + rename + fsync of the directory."""
    staged = stage_text(path, text)
    try:
        os.fsync(staged.fd)
    except BaseException:
        staged.discard()
        raise
    publish_text(staged)


@dataclasses.dataclass
class StagedText:
    """A replacement of ``path`` written to ``tmp`` (open as ``fd``), not yet synced nor
    in place: :func:`publish_text` after an ``fsync`` of ``fd``, or :meth:`discard`."""

    path: str
    tmp: str
    fd: int

    def discard(self) -> None:
        """Closes and removes the replacement; ``path`` stays as it was."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def stage_text(path: str, text: str) -> StagedText:
    """Writes the replacement of ``path`` beside it; the caller syncs its ``fd`` (with
    other files, in one round) before :func:`publish_text`."""
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    staged = StagedText(path, tmp, fd)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data) :]
    except BaseException:
        staged.discard()
        raise
    return staged


def publish_text(staged: StagedText, *, sync_dir: bool = True) -> None:
    """Puts a staged replacement in place (its ``fd`` synced): rename + fsync of the
    directory (``sync_dir=False``: the caller syncs it, with others, in one round).
    On a failure the replacement is removed."""
    os.close(staged.fd)
    staged.fd = -1
    try:
        os.replace(staged.tmp, staged.path)
    except BaseException:
        staged.discard()
        raise
    if sync_dir:
        fsync_path(os.path.dirname(staged.path))


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True
