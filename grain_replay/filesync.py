"""Durable file writes below the writers: ``fsync`` of a path, a text file replaced atomically.

``parts.py`` (manifests, owner files, the store file) and ``writers/atomic.py``
(``.partial`` swaps) both commit through these.
"""

from __future__ import annotations

import os

__all__ = ["fsync_path", "replace_text"]


def fsync_path(path: str) -> None:
    """``fsync`` of one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_text(path: str, text: str) -> None:
    """Replaces ``path`` with ``text``: tmp + fsync + rename + fsync of the directory."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))
