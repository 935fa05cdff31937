"""One-shot, atomic writers of a pytree to HDF5, ``.npy`` and Zarr stores."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from grain_replay import layout as layout_lib
from grain_replay import tree as tree_lib
from grain_replay.sources.stitch import PAGE
from grain_replay.writers.atomic import atomic_path

__all__ = ["write", "write_hdf5", "write_npy", "write_zarr", "format_from_path", "FORMATS"]

FORMATS = ("hdf5", "npy", "zarr")

# Compressed or chunked layouts decode a whole chunk per random row: keep chunks
# small enough that a random batch decodes little it does not need.
COMPRESSED_CHUNK_BYTES = 64 * 2**10
ZARR_CHUNK_BYTES = 1 * 2**20
HDF5_COMPRESSIONS = ("gzip", "lzf")
ZARR_COMPRESSIONS = ("zstd", "gzip", "blosc")


def format_from_path(path: str | os.PathLike[str]) -> str:
    """Format ``write`` picks for ``path``: ``.h5``/``.hdf5`` hdf5, ``.zarr`` zarr, else npy."""
    p = os.fspath(path).rstrip("/").lower()
    if p.endswith((".h5", ".hdf5")):
        return "hdf5"
    if p.endswith(".zarr"):
        return "zarr"
    return "npy"


def chunk_rows_for(
    arr_shape: tuple[int, ...], itemsize: int, target_bytes: int, *, page_aligned: bool = False
) -> int:
    """Rows per chunk near ``target_bytes``.

    With ``page_aligned``, chunks are whole memory pages, so readers can map
    uncompressed chunks back to back into one array (see ``sources/stitch.py``).
    """
    row_bytes = max(1, itemsize * int(np.prod(arr_shape[1:], dtype=np.int64)))
    rows = max(1, target_bytes // row_bytes)
    if page_aligned:
        unit = PAGE // math.gcd(row_bytes, PAGE)
        return max(unit, rows // unit * unit)
    return max(1, min(max(arr_shape[0], 1), rows))


def _check_chunk_rows(chunk_rows: int | None, where: str) -> None:
    if chunk_rows is not None and (
        isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows <= 0
    ):
        raise ValueError(f"{where}: chunk_rows must be a positive int or None, got {chunk_rows!r}")


def _metadata(arrays: dict[str, np.ndarray], treedef: dict[str, Any], n: int) -> str:
    leaves = {k: layout_lib.LeafSpec(a.dtype, tuple(a.shape[1:])) for k, a in arrays.items()}
    return layout_lib.StoreMetadata(n, leaves, treedef).to_json()


def write_hdf5(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
) -> str:
    """Writes ``tree`` to an HDF5 file, atomically.

    The default layout is contiguous and uncompressed: readers memory-map it.
    ``compression`` (``"gzip"`` or ``"lzf"``) or ``chunk_rows`` give a chunked
    layout (default chunks of about 64 KiB).

    Returns:
      The absolute path written.
    """
    import h5py

    path = os.path.abspath(os.fspath(path))
    _check_chunk_rows(chunk_rows, path)
    if compression is not None and compression not in HDF5_COMPRESSIONS:
        raise ValueError(
            f"{path}: HDF5 compression must be one of {HDF5_COMPRESSIONS} or None, "
            f"got {compression!r}."
        )
    arrays, treedef, n = layout_lib.prepare_leaves(tree, where=path)
    with atomic_path(path, overwrite=overwrite) as partial:
        # Page-aligned chunks let readers map unfiltered chunks into one array.
        with h5py.File(partial, "w", alignment_threshold=PAGE, alignment_interval=PAGE) as f:
            for key, arr in arrays.items():
                kwargs: dict[str, Any] = {}
                # Zero-size records have nothing to chunk or compress.
                chunked = chunk_rows is not None or compression is not None
                if chunked and 0 not in arr.shape[1:]:
                    rows = chunk_rows or chunk_rows_for(
                        arr.shape, arr.itemsize, COMPRESSED_CHUNK_BYTES,
                        page_aligned=compression is None,
                    )  # fmt: skip
                    kwargs["chunks"] = (min(rows, max(n, 1)), *(max(1, d) for d in arr.shape[1:]))
                    kwargs["maxshape"] = (None, *arr.shape[1:])
                    kwargs["compression"] = compression
                f.create_dataset(layout_lib.disk_name(key), data=arr, **kwargs)
            f.attrs[layout_lib.METADATA_ATTR] = _metadata(arrays, treedef, n)
    return path


def write_npy(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
) -> str:
    """Writes ``tree`` as a directory of ``.npy`` files (one per leaf), atomically.

    A bare array written to a path ending in ``.npy`` becomes a single ``.npy``
    file. ``.npy`` stores are neither chunked nor compressed: pass
    ``chunk_rows``/``compression`` to the HDF5 or Zarr writers instead.

    Returns:
      The absolute path written.
    """
    path = os.path.abspath(os.fspath(path))
    if chunk_rows is not None or compression is not None:
        raise ValueError(
            f"{path}: .npy stores are memory-mapped and cannot be chunked or compressed. "
            "Fix: drop chunk_rows/compression, or write HDF5 (.h5) or Zarr (.zarr)."
        )
    arrays, treedef, n = layout_lib.prepare_leaves(tree, where=path)
    single_file = treedef["type"] == "leaf" and path.endswith(".npy")
    with atomic_path(path, overwrite=overwrite) as partial:
        if single_file:
            with open(partial, "wb") as f:
                np.save(f, arrays[tree_lib.ROOT_KEY], allow_pickle=False)
            return path
        os.makedirs(partial)
        for key, arr in arrays.items():
            file = os.path.join(partial, layout_lib.disk_name(key) + ".npy")
            os.makedirs(os.path.dirname(file), exist_ok=True)
            with open(file, "wb") as f:
                np.save(f, arr, allow_pickle=False)
        with open(os.path.join(partial, layout_lib.METADATA_FILE), "w") as f:
            f.write(_metadata(arrays, treedef, n))
    return path


def zarr_compressors(compression: str | None, where: str) -> Any:
    if compression is None:
        return None
    from zarr import codecs

    makers = {"zstd": codecs.ZstdCodec, "gzip": codecs.GzipCodec, "blosc": codecs.BloscCodec}
    if compression not in makers:
        raise ValueError(
            f"{where}: Zarr compression must be one of {ZARR_COMPRESSIONS} or None, "
            f"got {compression!r}."
        )
    return (makers[compression](),)


def write_zarr(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
) -> str:
    """Writes ``tree`` to a Zarr v3 group, atomically.

    Chunks split only the records axis (default about 1 MiB, or 64 KiB when
    compressed); ``compression`` is ``"zstd"``, ``"gzip"``, ``"blosc"`` or None.

    Returns:
      The absolute path written.
    """
    from grain_replay.sources.zarr import import_zarr

    zarr = import_zarr()
    path = os.path.abspath(os.fspath(path))
    _check_chunk_rows(chunk_rows, path)
    compressors = zarr_compressors(compression, path)
    arrays, treedef, n = layout_lib.prepare_leaves(tree, where=path)
    target = ZARR_CHUNK_BYTES if compression is None else COMPRESSED_CHUNK_BYTES
    with atomic_path(path, overwrite=overwrite) as partial:
        group = zarr.open_group(partial, mode="w", zarr_format=3)
        for key, arr in arrays.items():
            rows = chunk_rows or chunk_rows_for(
                arr.shape, arr.itemsize, target, page_aligned=compression is None
            )
            z = group.create_array(
                layout_lib.disk_name(key),
                shape=arr.shape,
                dtype=arr.dtype,
                chunks=(rows, *(max(1, d) for d in arr.shape[1:])),
                compressors=compressors,
                filters=None,
                fill_value=None,
                # Every chunk on disk, even all-zero ones, so readers can map them.
                config={"write_empty_chunks": True},
            )
            if arr.size:
                z[...] = arr
        group.attrs[layout_lib.METADATA_ATTR] = _metadata(arrays, treedef, n)
    return path


_WRITERS = {"hdf5": write_hdf5, "npy": write_npy, "zarr": write_zarr}


def write(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    format: str | None = None,
    chunk_rows: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
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

    Returns:
      The absolute path written.

    Raises:
      StoreExistsError: ``path`` exists and ``overwrite`` is False.
      InvalidTreeError: ``tree`` is empty, not a pytree, has object/string or
        scalar leaves, or leaves of different lengths.

    Example:
      >>> gr.write("replay.h5", {"obs": obs, "action": action, "reward": reward})
    """
    fmt = format or format_from_path(path)
    if fmt not in _WRITERS:
        raise ValueError(f"format must be one of {FORMATS} or None, got {format!r}.")
    return _WRITERS[fmt](
        path, tree, chunk_rows=chunk_rows, compression=compression, overwrite=overwrite
    )
