"""Checks of a local Zarr store before zarr reads it: regular files, inside it, honest sizes."""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.files import check_inside

__all__ = [
    "MAX_CHUNK_BYTES",
    "ChunkGuard",
    "check_array",
    "check_chunk_files",
    "check_foreign_tree",
    "check_node",
]

# Metadata files zarr may open in a node folder (v3, then v2).
_META_NAMES = ("zarr.json", ".zgroup", ".zarray", ".zattrs", ".zmetadata")

# A decoded chunk above this many bytes (and the cache bound) is refused, not allocated.
MAX_CHUNK_BYTES = 2 * 2**30


def _not_regular(path: str, key: str | None) -> InvalidStoreError:
    leaf = f" (leaf {key!r})" if key else ""
    return InvalidStoreError(
        f"{path}{leaf} is not a regular file (a FIFO, device or socket); reading it could "
        "block forever. Fix: re-create the store with regular files."
    )


def check_node(store: str, folder: str, key: str | None, allow_external: bool) -> None:
    """Refuses a node folder that leads out of the store, and metadata files zarr would block on.

    Args:
      store: the store's root folder.
      folder: the group's or array's folder (``store`` itself for the root group).
      key: the leaf it holds, if any (named in errors).
      allow_external: follow symlinks out of the store.

    Raises:
      InvalidStoreError: the folder or a metadata file resolves outside ``store``
        (unless ``allow_external``), or a metadata file is not a regular file.
    """
    name = key or "<group>"
    if folder != store:
        check_inside(store, folder, name, allow_external)
    for meta in _META_NAMES:
        path = os.path.join(folder, meta)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, key)
        check_inside(store, path, name, allow_external)


def check_foreign_tree(store: str, allow_external: bool) -> None:
    """``check_node`` for every node zarr's ``members()`` would open below ``store``.

    Mirrors zarr's walk: every folder of a group is a candidate node, and only
    groups are descended into (an array's chunk folders are never listed).
    """
    todo = [store]
    while todo:
        folder = todo.pop()
        check_node(store, folder, None, allow_external)
        if not _is_group(folder):
            continue
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue  # zarr reports what it cannot list
        for entry in entries:
            if entry.is_dir(follow_symlinks=True):
                key = os.path.relpath(entry.path, store)
                check_node(store, entry.path, key, allow_external)
                todo.append(entry.path)


def _is_group(folder: str) -> bool:
    if os.path.isfile(os.path.join(folder, ".zgroup")):
        return True
    try:
        with open(os.path.join(folder, "zarr.json"), "rb") as f:
            meta = json.loads(f.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return False  # zarr reports a broken node itself
    return isinstance(meta, dict) and meta.get("node_type") == "group"


def check_array(arr: Any, key: str, want: np.dtype | None, where: str, cache_bytes: int) -> None:
    """Refuses an array whose zarr metadata disagrees with grain_replay's, or whose chunks are huge.

    Args:
      arr: the ``zarr.Array``.
      key: the leaf key.
      want: the dtype grain_replay's metadata records (None for a foreign store).
      where: the array's metadata file, named in errors.
      cache_bytes: the source's decoded-chunk cache bound.

    Raises:
      InvalidStoreError: naming ``where``, the leaf, both values and the fix.
    """
    got = np.dtype(arr.dtype)
    # Zarr 3 keeps no byte order in data_type: compare values' types, not byte orders.
    if want is not None and got.newbyteorder("=") != np.dtype(want).newbyteorder("="):
        raise InvalidStoreError(
            f"{where}: leaf {key!r} is stored as {got} but the grain_replay metadata says "
            f"{np.dtype(want)}. One of them lies; the store is corrupt. Fix: re-create it."
        )
    chunk_bytes = got.itemsize
    for c in arr.chunks:
        chunk_bytes *= int(c)
    bound = max(cache_bytes, MAX_CHUNK_BYTES)
    if chunk_bytes > bound:
        raise InvalidStoreError(
            f"{where}: leaf {key!r} declares chunks of shape {tuple(arr.chunks)} "
            f"({chunk_bytes} bytes decoded), above the {bound}-byte bound on one chunk. "
            "Fix: re-chunk the array (e.g. gr.write(path, tree, chunk_rows=...))."
        )


def check_chunk_files(
    files: list[str], root: str, key: str, chunk_bytes: int, store: str, allow_external: bool
) -> bool:
    """Checks the raw chunk files about to be memory-mapped.

    Each must be a regular file inside the store of exactly ``chunk_bytes``:
    an uncompressed Zarr chunk always holds the full chunk shape. One ``stat``
    per file; symlinks (of the file or of a folder below the array's) are
    resolved only where ``lstat`` finds one.

    Args:
      files: the chunk files, in row order.
      root: the array's folder (already checked to be inside the store).
      key: the leaf key.
      chunk_bytes: the exact size the bytes codec gives a chunk.
      store: the store's root folder.
      allow_external: follow symlinks out of the store.

    Returns:
      False when a chunk file is missing (zarr reads it as the fill value, so
      the caller reads through zarr instead of mapping).

    Raises:
      InvalidStoreError: a chunk file that is not a regular file, leads out of
        the store, or whose size is not ``chunk_bytes``.
    """
    seen: set[str] = {root}
    for path in files:
        folder = os.path.dirname(path)
        while folder not in seen and folder.startswith(root + os.sep):
            seen.add(folder)
            try:
                if stat.S_ISLNK(os.lstat(folder).st_mode):
                    check_inside(store, folder, key, allow_external)
            except FileNotFoundError:
                return False
            folder = os.path.dirname(folder)
        try:
            lst = os.lstat(path)
            st = os.stat(path) if stat.S_ISLNK(lst.st_mode) else lst
        except FileNotFoundError:  # never written (or a dangling link): the fill value
            return False
        if stat.S_ISLNK(lst.st_mode):
            check_inside(store, path, key, allow_external)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, key)
        if st.st_size != chunk_bytes:
            raise InvalidStoreError(
                f"{path} (leaf {key!r}) holds {st.st_size} bytes, but its zarr.json declares "
                f"uncompressed chunks of {chunk_bytes} bytes. The chunk is truncated or the "
                "chunk shape lies. Fix: re-create the store."
            )
    return True


class ChunkGuard:
    """Refuses a chunk file that leads out of the store or is not a regular file, before a read.

    Every read path of a local array goes through it, ours and zarr's: a FIFO
    would block a read forever, and a symlink out of the store would read any
    file on the machine. The array folder is checked once; below it, one
    ``lstat`` per folder not seen before (a full ``realpath`` only for a link).

    Args:
      store: the store's root folder.
      root: the array's folder.
      key: the leaf (named in errors).
      allow_external: follow symlinks out of the store.
    """

    def __init__(self, store: str, root: str, key: str, allow_external: bool):
        self.store = store
        self.root = root
        self.key = key
        self.allow_external = allow_external
        self._checked_dirs: set[str] = set()

    def _check_folder(self, folder: str) -> None:
        if not self._checked_dirs:
            check_inside(self.store, self.root, self.key, self.allow_external)
            self._checked_dirs.add(self.root)
        rel = os.path.relpath(folder, self.root)
        prefix = self.root
        for part in rel.split(os.sep) if rel != os.curdir else ():
            prefix = os.path.join(prefix, part)
            if prefix in self._checked_dirs:
                continue
            try:
                mode = os.lstat(prefix).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return  # no chunk below: read as unwritten, nothing to remember
            if stat.S_ISLNK(mode):
                check_inside(self.store, prefix, self.key, self.allow_external)
            self._checked_dirs.add(prefix)

    def check(self, path: str) -> bool:
        """Checks chunk file ``path`` before zarr reads it; False when it does not exist.

        Raises:
          InvalidStoreError: the file (or a folder above it) leads out of the
            store, or it is not a regular file.
        """
        folder = os.path.dirname(path)
        if folder not in self._checked_dirs:
            self._check_folder(folder)
        try:
            lst = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        st = lst
        if stat.S_ISLNK(lst.st_mode):
            check_inside(self.store, path, self.key, self.allow_external)
            try:
                st = os.stat(path)
            except FileNotFoundError:  # a dangling link: zarr reads it as unwritten
                return False
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, self.key)
        return True

    def read(self, path: str) -> bytes | None:
        """The bytes of chunk file ``path``, checked as it is opened; None when never written."""
        folder = os.path.dirname(path)
        if folder not in self._checked_dirs:
            self._check_folder(folder)
        flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if e.errno != errno.ELOOP:  # ELOOP: the chunk file is a symlink
                raise
            check_inside(self.store, path, self.key, self.allow_external)
            try:
                fd = os.open(path, flags)
            except FileNotFoundError:  # a dangling link: zarr reads it as unwritten too
                return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _not_regular(path, self.key)
            parts = []
            left = st.st_size
            while left > 0:
                part = os.read(fd, left)
                if not part:
                    break
                parts.append(part)
                left -= len(part)
            return b"".join(parts) if len(parts) != 1 else parts[0]
        finally:
            os.close(fd)

    def check_tree(self) -> None:
        """Checks every file below the array's folder (a grid whose chunk keys are not computed).

        Raises:
          InvalidStoreError: as :meth:`check`, for the first such file found.
        """
        check_inside(self.store, self.root, self.key, self.allow_external)
        seen: set[str] = set()
        todo = [self.root]
        while todo:
            folder = todo.pop()
            real = os.path.realpath(folder)
            if real in seen:
                continue
            seen.add(real)
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue  # zarr reports what it cannot list
            for entry in entries:
                if entry.is_symlink():
                    check_inside(self.store, entry.path, self.key, self.allow_external)
                if entry.is_dir(follow_symlinks=True):
                    todo.append(entry.path)
                elif os.path.exists(entry.path) and not entry.is_file(follow_symlinks=True):
                    raise _not_regular(entry.path, self.key)
