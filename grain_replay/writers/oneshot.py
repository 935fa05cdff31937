"""One-shot, atomic writers of a pytree to HDF5, ``.npy`` and Zarr stores.

The arguments are checked here, the store is written under a ``.partial`` path by
its format's function (:mod:`grain_replay.writers.layouts`) and committed atomically.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from grain_replay.errors import InvalidArgumentError
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import FORMATS, format_from_path, is_url
from grain_replay.store.integrity import Checksummer
from grain_replay.writers.atomic import atomic_path
from grain_replay.writers.layouts import (
    HDF5_COMPRESSIONS,
    STORES,
    ZARR_COMPRESSIONS,
    Blocks,
    choice_fix,
)

__all__ = [
    "write",
    "write_hdf5",
    "write_npy",
    "write_zarr",
    "write_blocks",
    # The compressions each format takes, as the CLI imports them from here.
    "HDF5_COMPRESSIONS",
    "ZARR_COMPRESSIONS",
]


def _check_options(fmt: str, path: str, chunk_rows: int | None, compression: str | None) -> None:
    if chunk_rows is not None and (
        isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows <= 0
    ):
        raise InvalidArgumentError(
            f"{path}: chunk_rows must be a positive int or None, got {chunk_rows!r}. Fix: "
            "chunk_rows=None (about 1 MiB of rows a chunk) or a row count >= 1."
        )
    allowed = {"hdf5": HDF5_COMPRESSIONS, "zarr": ZARR_COMPRESSIONS, "npy": ()}[fmt]
    if fmt == "npy" and (chunk_rows is not None or compression is not None):
        raise InvalidArgumentError(
            f"{path}: .npy stores are memory-mapped and cannot be chunked or compressed. "
            "Fix: drop chunk_rows/compression, or write HDF5 (.h5) or Zarr (.zarr)."
        )
    if compression is not None and compression not in allowed:
        raise InvalidArgumentError(
            f"{path}: {fmt} compression must be one of {allowed} or None, got "
            f"{compression!r}. {choice_fix('compression', compression, allowed)}"
        )


def _local(path: str | os.PathLike[str]) -> str:
    """The absolute path of a store to write; URLs are refused, not written to a
    local folder named after the scheme."""
    text = os.fspath(path)
    if is_url(text):
        raise InvalidArgumentError(
            f"{text}: gr.write, write_hdf5/npy/zarr and grain-replay convert write to a "
            "local or shared file system only (the atomic commit renames a directory). "
            "Fix: write to a local path, then upload the Zarr store and read it with "
            "gr.ZarrDataSource(url, storage_options=...)."
        )
    return os.path.abspath(text)


def write_blocks(
    path: str | os.PathLike[str],
    meta: layout_lib.StoreMetadata,
    blocks: Blocks,
    *,
    format: str,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
    checksum: bool = True,
) -> str:
    """Writes a store of known size from blocks of rows arriving in row order, atomically.

    The streaming core of :func:`write` and of ``grain-replay convert``: memory
    is bounded by one block. ``meta`` gives N, the leaves and the structure.
    """
    path = _local(path)
    _check_options(format, path, chunk_rows, compression)
    return _write_checked(path, meta, blocks, format, chunk_rows, compression, overwrite, checksum)


def _write_checked(
    path: str,
    meta: layout_lib.StoreMetadata,
    blocks: Blocks,
    format: str,
    chunk_rows: int | None,
    compression: str | None,
    overwrite: bool,
    checksum: bool,
) -> str:
    """:func:`write_blocks` past its checks: ``path`` is absolute and local, the options valid."""
    summer = Checksummer(meta.leaves) if checksum else None
    if meta.store_id is None:  # a new store: its own id
        meta = dataclasses.replace(meta, store_id=layout_lib.new_store_id())
    single_npy = format == "npy" and meta.treedef["type"] == "leaf" and path.endswith(".npy")
    with atomic_path(
        path, overwrite=overwrite, suffix=".npy.partial" if single_npy else ".partial"
    ) as partial:
        STORES[format](partial, meta, blocks, summer, chunk_rows, compression)
    return path


def _write(
    fmt: str,
    path: str | os.PathLike[str],
    tree: Any,
    chunk_rows: int | None,
    compression: str | None,
    overwrite: bool,
    checksum: bool,
) -> str:
    where = _local(path)
    _check_options(fmt, where, chunk_rows, compression)
    arrays, treedef, n = layout_lib.prepare_leaves(tree, where=where)
    leaves = {k: layout_lib.LeafSpec(a.dtype, tuple(a.shape[1:])) for k, a in arrays.items()}
    meta = layout_lib.StoreMetadata(n, leaves, treedef)
    # Checked above, before the leaves are fetched: not again.
    return _write_checked(
        where, meta, [(0, arrays)], fmt, chunk_rows, compression, overwrite, checksum
    )


def write_hdf5(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
    checksum: bool = True,
) -> str:
    """Writes ``tree`` to an HDF5 file, atomically.

    The default layout is contiguous and uncompressed: readers memory-map it.
    ``compression`` (``"gzip"`` or ``"lzf"``) or ``chunk_rows`` give a chunked
    layout (default chunks of about 64 KiB). See :func:`write`.

    Returns:
      The absolute path written.
    """
    return _write("hdf5", path, tree, chunk_rows, compression, overwrite, checksum)


def write_npy(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
    checksum: bool = True,
) -> str:
    """Writes ``tree`` as a directory of ``.npy`` files (one per leaf), atomically.

    A bare array written to a path ending in ``.npy`` becomes a single ``.npy``
    file (no metadata, so no checksums). ``.npy`` stores are neither chunked nor
    compressed. See :func:`write`.

    Returns:
      The absolute path written.
    """
    return _write("npy", path, tree, chunk_rows, compression, overwrite, checksum)


def write_zarr(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
    checksum: bool = True,
) -> str:
    """Writes ``tree`` to a Zarr v3 group, atomically.

    Chunks split only the records axis (default about 1 MiB, whole pages, or
    64 KiB when compressed); ``compression`` is ``"zstd"``, ``"gzip"``,
    ``"blosc"`` or None. See :func:`write`.

    Returns:
      The absolute path written.
    """
    return _write("zarr", path, tree, chunk_rows, compression, overwrite, checksum)


def write(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    format: str | None = None,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
    checksum: bool = True,
) -> str:
    """Writes a pytree of numpy or jax arrays to a replay store, atomically.

    Args:
      path: destination; with ``format=None``, ``.h5``/``.hdf5`` -> HDF5,
        ``.zarr`` -> Zarr, anything else -> a directory of ``.npy`` files.
      tree: dict / list / tuple / NamedTuple tree of arrays sharing the leading
        (records) dimension. jax arrays are fetched once per leaf.
      format: ``"hdf5"``, ``"npy"`` or ``"zarr"`` to override the suffix.
      chunk_rows: rows per chunk (HDF5/Zarr); default picked for random access.
      compression: codec name (HDF5: gzip, lzf; Zarr: zstd, gzip, blosc).
      overwrite: replace an existing store.
      checksum: record a CRC32 per ~1 MiB of each leaf for ``grain-replay verify``.

    Returns:
      The absolute path written.

    Raises:
      StoreExistsError: ``path`` exists and ``overwrite`` is False.
      InvalidTreeError: ``tree`` is empty, not a pytree, has object/string or
        scalar leaves, or leaves of different lengths.

    Examples:
      >>> gr.write("replay.h5", {"obs": obs, "action": action, "reward": reward})
    """
    fmt = format or format_from_path(path)
    if fmt not in FORMATS:
        raise InvalidArgumentError(
            f"format must be one of {FORMATS} or None, got {format!r}. "
            f"{choice_fix('format', format, FORMATS)}"
        )
    return _write(fmt, path, tree, chunk_rows, compression, overwrite, checksum)
