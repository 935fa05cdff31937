"""One-shot, atomic writers of a pytree to HDF5, ``.npy`` and Zarr stores."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidArgumentError
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import (
    FORMATS,
    PAGE,
    format_from_path,
    import_h5py,
    import_zarr,
    is_url,
)
from grain_replay.store.integrity import Checksummer, as_bytes
from grain_replay.writers.atomic import atomic_path

__all__ = [
    "write",
    "write_hdf5",
    "write_npy",
    "write_zarr",
    "write_blocks",
    "create_zarr_leaf",
]

# Compressed or chunked layouts decode a whole chunk per random row: keep chunks
# small enough that a random batch decodes little it does not need.
COMPRESSED_CHUNK_BYTES = 64 * 2**10
ZARR_CHUNK_BYTES = 1 * 2**20
HDF5_COMPRESSIONS = ("gzip", "lzf")
ZARR_COMPRESSIONS = ("zstd", "gzip", "blosc")


def choice_fix(name: str, value: object, allowed: Iterable[str]) -> str:
    """The fix sentence for ``name=value`` outside ``allowed``: the nearest name, if any."""
    allowed = tuple(allowed)
    near = difflib.get_close_matches(str(value), allowed, n=1) if isinstance(value, str) else []
    if near:
        return f"Fix: {name}={near[0]!r} (did you mean it?), or another of {allowed}, or None."
    return f"Fix: pass {name}= one of {allowed}, or None."


# Rows of every leaf handed to a format writer at a time: (start, {key: rows}).
Blocks = Iterable[tuple[int, dict[str, np.ndarray]]]


def chunk_rows_for(
    arr_shape: tuple[int, ...], itemsize: int, target_bytes: int, *, page_aligned: bool = False
) -> int:
    """Rows per chunk near ``target_bytes``.

    With ``page_aligned``, chunks are whole memory pages, so readers can map
    uncompressed chunks back to back into one array (see ``sources/reading/stitch.py``).
    """
    row_bytes = max(1, itemsize * int(np.prod(arr_shape[1:], dtype=np.int64)))
    rows = max(1, target_bytes // row_bytes)
    if page_aligned:
        unit = PAGE // math.gcd(row_bytes, PAGE)
        return max(unit, rows // unit * unit)
    return max(1, min(max(arr_shape[0], 1), rows))


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


def _checksummed(
    blocks: Blocks, summer: Checksummer | None
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    for start, arrays in blocks:
        if summer is not None:
            summer.update(arrays)
        yield start, arrays


def _write_hdf5_store(
    partial: str,
    meta: layout_lib.StoreMetadata,
    blocks: Blocks,
    summer: Checksummer | None,
    chunk_rows: int | None,
    compression: str | None,
) -> None:
    h5py = import_h5py()
    n = meta.num_records
    with h5py.File(partial, "w", alignment_threshold=PAGE, alignment_interval=PAGE) as f:
        dsets = {}
        for key, spec in meta.leaves.items():
            kwargs: dict[str, Any] = {}
            # Zero-size records have nothing to chunk or compress.
            if (chunk_rows is not None or compression is not None) and 0 not in spec.shape:
                rows = chunk_rows or chunk_rows_for(
                    (n, *spec.shape), spec.dtype.itemsize, COMPRESSED_CHUNK_BYTES,
                    page_aligned=compression is None,
                )  # fmt: skip
                kwargs["chunks"] = (min(rows, max(n, 1)), *spec.shape)
                kwargs["maxshape"] = (None, *spec.shape)
                kwargs["compression"] = compression
            dsets[key] = f.create_dataset(
                layout_lib.disk_name(key), shape=(n, *spec.shape), dtype=spec.dtype, **kwargs
            )
        for start, arrays in _checksummed(blocks, summer):
            for key, arr in arrays.items():
                if arr.size:
                    dsets[key][start : start + len(arr)] = arr
        f.attrs[layout_lib.METADATA_ATTR] = _final(meta, summer).to_json()


def _write_npy_store(
    partial: str,
    meta: layout_lib.StoreMetadata,
    blocks: Blocks,
    summer: Checksummer | None,
    chunk_rows: int | None,
    compression: str | None,
) -> None:
    n = meta.num_records
    # A bare array written to `x.npy` is one plain .npy file, without metadata.
    single_file = meta.treedef["type"] == "leaf" and partial.endswith(".npy.partial")
    if single_file:
        files = {tree_lib.ROOT_KEY: open(partial, "wb")}
    else:
        os.makedirs(partial)
        files = {}
        for key in meta.leaves:
            file = os.path.join(partial, layout_lib.disk_name(key) + ".npy")
            os.makedirs(os.path.dirname(file), exist_ok=True)
            files[key] = open(file, "wb")
    try:
        for key, f in files.items():
            spec = meta.leaves[key]
            header = {
                "descr": np.lib.format.dtype_to_descr(spec.dtype),
                "fortran_order": False,
                "shape": (n, *spec.shape),
            }
            np.lib.format.write_array_header_2_0(f, header) if _needs_v2(
                header
            ) else np.lib.format.write_array_header_1_0(f, header)
        for _, arrays in _checksummed(blocks, summer):  # blocks arrive in row order
            for key, arr in arrays.items():
                files[key].write(as_bytes(arr))
    finally:
        for f in files.values():
            f.close()
    if not single_file:
        with open(os.path.join(partial, layout_lib.METADATA_FILE), "w") as meta_file:
            meta_file.write(_final(meta, summer).to_json())


def _needs_v2(header: dict[str, Any]) -> bool:
    return len(repr(header)) > 65000


def zarr_compressors(compression: str | None, where: str) -> Any:
    if compression is None:
        return None
    codecs = import_zarr().codecs
    makers = {"zstd": codecs.ZstdCodec, "gzip": codecs.GzipCodec, "blosc": codecs.BloscCodec}
    if compression not in makers:
        raise InvalidArgumentError(
            f"{where}: Zarr compression must be one of {ZARR_COMPRESSIONS} or None, "
            f"got {compression!r}. {choice_fix('compression', compression, ZARR_COMPRESSIONS)}"
        )
    return (makers[compression](),)


def create_zarr_leaf(
    group: Any, key: str, spec: layout_lib.LeafSpec, n: int, chunk_rows: int, compressors: Any
) -> Any:
    """The Zarr array of leaf ``key``: ``n`` rows, chunks of ``chunk_rows`` whole rows."""
    return group.create_array(
        layout_lib.disk_name(key),
        shape=(n, *spec.shape),
        dtype=spec.dtype,
        chunks=(chunk_rows, *(max(1, d) for d in spec.shape)),
        compressors=compressors,
        filters=None,
        fill_value=None,
        # Every chunk on disk, even all-zero ones, so readers can map them.
        config={"write_empty_chunks": True},
    )


def _write_zarr_store(
    partial: str,
    meta: layout_lib.StoreMetadata,
    blocks: Blocks,
    summer: Checksummer | None,
    chunk_rows: int | None,
    compression: str | None,
) -> None:
    zarr = import_zarr()
    n = meta.num_records
    compressors = zarr_compressors(compression, partial)
    target = ZARR_CHUNK_BYTES if compression is None else COMPRESSED_CHUNK_BYTES
    group = zarr.open_group(partial, mode="w", zarr_format=3)
    arrays_out = {}
    for key, spec in meta.leaves.items():
        rows = chunk_rows or chunk_rows_for(
            (n, *spec.shape), spec.dtype.itemsize, target, page_aligned=compression is None
        )
        arrays_out[key] = create_zarr_leaf(group, key, spec, n, rows, compressors)
    for start, arrays in _checksummed(blocks, summer):
        for key, arr in arrays.items():
            if arr.size:
                arrays_out[key][start : start + len(arr)] = arr
    group.attrs[layout_lib.METADATA_ATTR] = _final(meta, summer).to_json()


def _final(meta: layout_lib.StoreMetadata, summer: Checksummer | None) -> layout_lib.StoreMetadata:
    checksums = summer.state() if summer is not None else None
    return dataclasses.replace(meta, checksums=checksums)


_STORES = {"hdf5": _write_hdf5_store, "npy": _write_npy_store, "zarr": _write_zarr_store}


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
        _STORES[format](partial, meta, blocks, summer, chunk_rows, compression)
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
