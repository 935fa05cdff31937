"""Checks of a local Zarr store before zarr reads it: regular files, inside it, honest sizes."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.files import check_inside

__all__ = [
    "MAX_CHUNK_BYTES",
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
