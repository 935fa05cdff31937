"""HDF5 data source: memory-mapped contiguous datasets, chunk-aware reads otherwise."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from grain_replay import layout as layout_lib
from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.sources.base import ArrayReader, Handle, Layout, ReplaySource, is_url
from grain_replay.sources.chunked import (
    DEFAULT_CACHE_BYTES,
    ChunkCache,
    ChunkedLeafReader,
    mapped_reader,
)
from grain_replay.sources.decode import hdf5_direct_block_reader

if TYPE_CHECKING:
    from grain_replay.sources.remote import RetryOptions

__all__ = ["HDF5DataSource"]

logger = logging.getLogger(__name__)

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _h5py() -> Any:
    import h5py

    return h5py


class _HDF5Handle(Handle):
    def __init__(self, source: HDF5DataSource):
        h5py = _h5py()
        self._fileobj: Any = None
        self.file: Any = None
        if is_url(source.path):
            from grain_replay.sources import remote as remote_lib
            from grain_replay.sources import remote_hdf5

            # One fsspec file object per process; h5py reads through it under its
            # global lock, each read retried on transient failures.
            remote = remote_hdf5.new_remote(source)
            opts = remote_lib.effective_storage_options(source.path, source._storage_options)
            self._fileobj = remote_hdf5.RetryingFile(source.path, opts, remote)
            self.file = remote_hdf5.open_remote_file(h5py, self._fileobj, remote)
        else:
            self.file = open_h5(source.path)
        self.cache = ChunkCache(source._cache_bytes)
        n = len(source)
        self.readers = {}
        for key, loc in source._layout.locations.items():
            dset = self.file[loc]
            spec = source._layout.spec[key]
            local = self._fileobj is None
            offset = _memmap_offset(dset) if local else None
            chunks = _chunk_offsets(dset, n) if local and offset is None else None
            if offset is not None and n > 0 and spec.dtype.itemsize > 0:
                array = np.memmap(
                    source.path, dtype=dset.dtype, mode="r", offset=offset, shape=dset.shape
                )
                self.readers[key] = ArrayReader(array[:n])
            elif chunks:
                self.readers[key] = mapped_reader(
                    [(source.path, off) for off in chunks],
                    dset.chunks[0], spec.dtype, spec.shape, n,
                )  # fmt: skip
            else:
                chunk_rows = dset.chunks[0] if dset.chunks else _rows_per(dset, 1 << 20)
                read_blocks = (
                    hdf5_direct_block_reader(dset, chunk_rows, n) if local else None
                ) or _block_reader(dset, chunk_rows, n)
                if self._fileobj is not None:
                    from grain_replay.sources.remote_hdf5 import reraise_file_errors

                    read_blocks = reraise_file_errors(read_blocks, self._fileobj)
                self.readers[key] = ChunkedLeafReader(
                    key, n, chunk_rows, spec.shape, spec.dtype, read_blocks, self.cache,
                )  # fmt: skip
        if not any(isinstance(r, ChunkedLeafReader) for r in self.readers.values()):
            # Every leaf is memory-mapped: the h5py handle is not needed, and
            # keeping it would stop a ReplayWriter in this process from opening
            # the file for writing (HDF5 shares one handle per file per process).
            self._close_file()

    def _close_file(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self._fileobj is not None:
            self._fileobj.close()
            self._fileobj = None

    def close(self) -> None:
        self.readers = {}
        self._close_file()


def open_h5(path: str) -> Any:
    """Opens read-only with HDF5's default file locking, or without it if that is refused.

    Locking stays on for compatibility with other h5py users in the process; a
    file already opened without locking (a ReplayWriter) refuses a locking open.
    """
    h5py = _h5py()
    try:
        return h5py.File(path, "r")
    except OSError as e:
        if "lock" not in str(e).lower():
            raise
        return h5py.File(path, "r", locking=False)


def _rows_per(dset: Any, target_bytes: int) -> int:
    row_bytes = max(1, dset.dtype.itemsize * int(np.prod(dset.shape[1:], dtype=np.int64)))
    return max(1, target_bytes // row_bytes)


def _memmap_offset(dset: Any) -> int | None:
    """File offset of a contiguous, unfiltered, allocated dataset, else None."""
    if dset.chunks is not None or dset.compression is not None or dset.external:
        return None
    try:
        if dset.is_virtual:
            return None
    except AttributeError:
        pass
    if dset.dtype.hasobject or dset.dtype.kind == "V":
        return None
    offset = dset.id.get_offset()
    return None if offset is None else int(offset)


# Beyond this many chunks, decoding through h5py is cheaper than mapping them.
_MAX_RUNS = 4096


def _chunk_offsets(dset: Any, n: int) -> list[int] | None:
    """File offsets of the row-chunks of an unfiltered dataset, or None if not mappable."""
    if n == 0 or dset.chunks is None or dset.dtype.hasobject or dset.dtype.kind == "V":
        return None
    if tuple(dset.chunks[1:]) != tuple(dset.shape[1:]) or 0 in dset.chunks:
        return None
    if dset.id.get_create_plist().get_nfilters() or dset.external or dset.is_virtual:
        return None
    rows = dset.chunks[0]
    needed = -(-n // rows)
    if needed > _MAX_RUNS:
        return None
    offsets: dict[int, int] = {}
    for i in range(dset.id.get_num_chunks()):
        info = dset.id.get_chunk_info(i)
        c = info.chunk_offset[0] // rows
        if c < needed and info.filter_mask == 0:
            offsets[c] = info.byte_offset
    if len(offsets) < needed:  # unwritten chunks read as the fill value: let h5py do it
        return None
    return [offsets[c] for c in range(needed)]


def _block_reader(dset: Any, chunk_rows: int, n: int) -> Any:
    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        return [dset[c * chunk_rows : min((c + 1) * chunk_rows, n)] for c in chunk_ids]

    return read_blocks


class HDF5DataSource(ReplaySource):
    """Random-access grain source over an HDF5 file.

    Contiguous uncompressed datasets are memory-mapped at their file offset
    (no h5py call, no global lock on the read path); chunked or compressed
    datasets are read chunk by chunk, each needed chunk decoded once per batch
    and kept in a bounded cache.

    Args:
      path: the ``.h5`` file, or an fsspec URL (``s3://...``).
      keys: leaves (or groups) to read; default all.
      storage_options: fsspec options for URLs (see :class:`ZarrDataSource`).
      cache_bytes: bound of the decoded-chunk cache per process.
      retries: retries of a failed remote read (an int, or ``RetryOptions``);
        0 fails at once. Ignored for local files.

    Example:
      >>> src = gr.HDF5DataSource("replay.h5")
      >>> batch = src.read_batch([3, 1, 3])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        retries: int | RetryOptions = 3,
    ):
        from grain_replay.sources import remote as remote_lib

        self._cache_bytes = cache_bytes
        self._retry = remote_lib.retry_options(retries)
        super().__init__(path, keys, storage_options=storage_options)

    def _open(self) -> Handle:
        return _HDF5Handle(self)

    def _inspect(self) -> Layout:
        h5py = _h5py()
        if not is_url(self._path):
            if not os.path.exists(self._path):
                raise StoreNotFoundError(
                    f"No HDF5 file at {self._path}. Fix: check the path, or write one with "
                    "gr.write_hdf5(path, tree)."
                )
            with open(self._path, "rb") as f:
                if f.read(8) != HDF5_SIGNATURE:
                    raise InvalidStoreError(
                        f"{self._path} is not an HDF5 file (no HDF5 signature). Fix: pass an "
                        "HDF5 file, or use gr.open_source(path) to detect the format."
                    )
        if is_url(self._path):
            from grain_replay.sources.remote_hdf5 import inspect_remote

            return inspect_remote(self, h5py)
        try:
            with open_h5(self._path) as f:
                return self._layout_of(f)
        except (OSError, ValueError) as e:
            if isinstance(e, InvalidStoreError):
                raise
            if isinstance(e, FileNotFoundError):
                raise StoreNotFoundError(f"No HDF5 file at {self._path}: {e}") from e
            raise InvalidStoreError(
                f"{self._path}: h5py cannot open the file ({e}). It may be truncated or "
                "corrupt. Fix: re-create it."
            ) from e

    def _layout_of(self, f: Any) -> Layout:
        h5py = _h5py()
        raw = f.attrs.get(layout_lib.METADATA_ATTR_NEXT)  # only while a commit grows it
        if raw is None:
            raw = f.attrs.get(layout_lib.METADATA_ATTR)
        if raw is not None:
            meta = layout_lib.StoreMetadata.from_json(raw, where=self._path)
            locations = {k: layout_lib.disk_name(k) for k in meta.leaves}
            for key, loc in locations.items():
                dset = f.get(loc)
                if not isinstance(dset, h5py.Dataset):
                    raise InvalidStoreError(
                        f"{self._path}: leaf {key!r} is listed in the metadata but dataset "
                        f"{loc!r} is missing. The file is corrupt; re-create it."
                    )
                self._check_dataset(key, dset, meta.num_records, meta.leaves[key].shape)
            return Layout(
                meta.num_records, dict(meta.leaves), meta.treedef, locations, meta.checksums
            )
        # A foreign file: every dataset with a records axis is a leaf.
        found: dict[str, Any] = {}

        def visit(name: str, obj: Any) -> None:
            if isinstance(obj, h5py.Dataset):
                if obj.ndim == 0 or obj.shape is None:
                    logger.warning("%s: skipping scalar dataset %r", self._path, name)
                else:
                    found[name] = obj

        f.visititems(visit)
        if not found:
            raise InvalidStoreError(
                f"{self._path}: the file holds no dataset with a records axis. Fix: write "
                "one with gr.write_hdf5(path, tree)."
            )
        keys = layout_lib.foreign_keys(found, self._requested_keys)
        spec = {}
        for k in keys:
            dtype = layout_lib.check_dtype(found[k].dtype, k, self._path)
            spec[k] = layout_lib.LeafSpec(dtype, tuple(found[k].shape[1:]))
        n = layout_lib.common_length(self._path, {k: found[k].shape[0] for k in keys})
        return Layout(n, spec, tree_lib.treedef_from_keys(keys), {k: k for k in keys})

    def _check_dataset(self, key: str, dset: Any, n: int, shape: tuple[int, ...]) -> None:
        if dset.shape[0] < n or tuple(dset.shape[1:]) != shape:
            raise InvalidStoreError(
                f"{self._path}: leaf {key!r} has shape {dset.shape} but the metadata says "
                f"({n}, {', '.join(map(str, shape))}). The file is corrupt; re-create it."
            )
