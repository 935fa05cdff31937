"""Each format's layout on disk, and a store of it written whole: HDF5, ``.npy``, Zarr.

The chunk sizes and compression codecs a store gets (shared with the appending
backends, :mod:`grain_replay.writers.backends`), the fix sentence of a choice
outside them, and one function a format that fills a ``.partial`` store from
blocks of rows in row order (:data:`STORES`); :mod:`grain_replay.writers.oneshot`
checks the arguments and commits the store atomically.
"""

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
from grain_replay.store.formats import PAGE, import_h5py, import_zarr
from grain_replay.store.integrity import Checksummer, as_bytes

__all__ = [
    "COMPRESSED_CHUNK_BYTES",
    "HDF5_COMPRESSIONS",
    "STORES",
    "ZARR_CHUNK_BYTES",
    "ZARR_COMPRESSIONS",
    "Blocks",
    "choice_fix",
    "chunk_rows_for",
    "create_zarr_leaf",
    "zarr_compressors",
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


# A store written whole from its blocks, by format (a .partial path; oneshot commits it).
STORES = {"hdf5": _write_hdf5_store, "npy": _write_npy_store, "zarr": _write_zarr_store}
