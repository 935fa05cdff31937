"""Durable file writes below the writers: ``fsync`` of a path, a text file replaced atomically.

``parts.py`` (manifests, owner files, the store file) and ``writers/atomic.py``
(``.partial`` swaps) both commit through these.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["StagedText", "fsync_path", "publish_text", "replace_text", "stage_text"]


def fsync_path(path: str) -> None:
    """``fsync`` of one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    staged = StagedText(path, tmp, fd)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data) :]
    except BaseException:
        staged.discard()
        raise
    return staged


def publish_text(staged: StagedText) -> None:
    """Puts a staged replacement in place (its ``fd`` synced): rename + fsync of the
    directory."""
    os.close(staged.fd)
    staged.fd = -1
    try:
        os.replace(staged.tmp, staged.path)
    except BaseException:
        staged.discard()
        raise
    fsync_path(os.path.dirname(staged.path))
