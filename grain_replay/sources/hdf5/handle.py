"""An open HDF5 file: one reader per leaf (mapped at its offset, read as raw chunks, or
through h5py), grown in place as a writer appends."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import GrainReplayError, InvalidStoreError
from grain_replay.remote import RetryOptions
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.hdf5 import filters as hdf5_filters
from grain_replay.sources.hdf5 import raw as hdf5_raw
from grain_replay.sources.hdf5 import refs as hdf5_refs
from grain_replay.sources.hdf5.codecs import hdf5_direct_block_reader
from grain_replay.sources.hdf5.held import Access, fresh, open_h5
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.chunked import ChunkedLeafReader, grow_stitched, stitched_map
from grain_replay.sources.reading.files import Descriptor, MappedFile
from grain_replay.sources.reading.readers import ArrayReader, Handle
from grain_replay.store.formats import STORE_FAULTS, damaged_store, is_url

__all__ = ["HDF5Handle", "HDF5Opening"]


@dataclasses.dataclass(frozen=True)
class HDF5Opening:
    """What an :class:`HDF5Handle` needs of the HDF5DataSource that opens it, handed over
    by that source (source.py imports this module: the handle reads none of its state).

    Attributes:
      path: the file's path or URL.
      layout: the file's layout (the selected leaves) as the source inspected it.
      cache_bytes: bound of the decoded-chunk cache.
      storage_options: fsspec options of a remote file.
      retry: retries of a failed remote read.
    """

    path: str
    layout: Layout
    cache_bytes: int
    storage_options: Mapping[str, Any]
    retry: RetryOptions


class HDF5Handle(Handle):
    """An open HDF5 file: a reader per leaf (mapped, raw chunks, or h5py), grown in place
    as a writer appends (:meth:`grow`)."""

    def __init__(self, opening: HDF5Opening):
        path, layout = opening.path, opening.layout
        self._path = path
        self._fileobj: Any = None
        self._guards: list[MappedFile] = []  # descriptors of raw chunk reads
        self.file: Any = None
        access = Access.FREE
        if is_url(path):
            from grain_replay.sources.hdf5 import remote as remote_hdf5

            # One fsspec file object per process; h5py reads through it under its
            # global lock, each read retried on transient failures.
            self._fileobj, self.file = remote_hdf5.open_remote(
                path, opening.storage_options, opening.retry
            )
        else:
            self.file, access = open_h5(path)
        self.cache = ChunkCache(opening.cache_bytes)
        n = layout.num_records
        self._n = n
        self._descriptor: Descriptor | None = None  # the one all mapped leaves share
        self.readers = {}
        self.mapped_files = {}
        needs_h5py = False
        # One descriptor and one map of the whole file for all its leaves: a map
        # per leaf would hold a descriptor per leaf (mmap keeps a dup), and a
        # foreign file with hundreds of datasets, times the workers, runs out.
        descriptor: Descriptor | None = None
        whole: mmap.mmap | None = None

        def shared() -> Descriptor:
            nonlocal descriptor
            if descriptor is None:
                descriptor = Descriptor(path)
            return descriptor

        def whole_file() -> mmap.mmap:
            nonlocal whole
            if whole is None:
                whole = mmap.mmap(shared().fd, 0, access=mmap.ACCESS_READ)
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    whole.madvise(mmap.MADV_RANDOM)  # random rows: no read-ahead per fault
            return whole

        def open_leaf(key: str, loc: str) -> bool:
            """Opens one leaf's reader; True if it reads through h5py."""
            uses_h5py = False
            dset = fresh(self.file[loc], access)
            hdf5_filters.require_filters(dset, path, key)  # loads hdf5plugin in workers
            spec = layout.spec[key]
            row_bytes = spec.dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64))
            # Only the store file itself is mapped or read raw: a dataset behind an
            # external link (allow_external=True) lives at offsets of another file.
            local = self._fileobj is None and hdf5_refs.is_own_file(dset, path)
            offset = hdf5_raw.memmap_offset(dset) if local else None
            chunks = hdf5_raw.chunk_table(dset, n) if local and offset is None else None
            if n == 0 or row_bytes == 0:
                # Nothing to read: no map, and no h5py handle kept for it.
                self.readers[key] = ArrayReader(np.zeros((n, *spec.shape), spec.dtype))
            elif offset is not None:
                reach = offset + n * row_bytes
                mapping = whole_file()
                if len(mapping) < reach:
                    raise InvalidStoreError(
                        f"{path}: leaf {key!r} lies at bytes {offset:,}..{reach:,} but "
                        f"the file holds {len(mapping):,} bytes: it is truncated. Fix: copy "
                        "the file again from its source."
                    )
                array = np.ndarray((n, *spec.shape), dset.dtype, buffer=mapping, offset=offset)
                self.readers[key] = ArrayReader(array)
                self.mapped_files[key] = [MappedFile(path, reach, shared())]
            elif chunks is not None:
                reader, file, mapped = hdf5_raw.raw_chunk_reader(
                    path, key, spec, dset, chunks, n, self.cache, shared(), whole_file
                )
                self.readers[key] = reader
                (self.mapped_files.setdefault(key, []) if mapped else self._guards).append(file)
            else:
                uses_h5py = True
                chunk_rows = dset.chunks[0] if dset.chunks else _rows_per(dset, 1 << 20)
                read_blocks = (
                    hdf5_direct_block_reader(dset, chunk_rows, n) if local else None
                ) or _block_reader(dset, chunk_rows, n)
                if self._fileobj is not None:
                    from grain_replay.sources.hdf5.remote import reraise_file_errors

                    read_blocks = reraise_file_errors(read_blocks, self._fileobj)
                self.readers[key] = ChunkedLeafReader(
                    key, n, chunk_rows, spec.shape, spec.dtype, read_blocks, self.cache,
                )  # fmt: skip
            return uses_h5py

        for key, loc in layout.locations.items():
            try:
                needs_h5py = open_leaf(key, loc) or needs_h5py
            except BaseException as e:
                self._close_file()  # else HDF5 keeps the file open until collected
                if isinstance(e, STORE_FAULTS) and not isinstance(e, GrainReplayError):
                    raise damaged_store(path, e, leaf=key, doing=f"opening {loc!r}") from e
                raise
        self._descriptor = descriptor
        if not needs_h5py:
            # Every leaf is mapped or read raw: the h5py handle is not needed, and
            # keeping it would stop a ReplayWriter in this process from opening
            # the file for writing (HDF5 shares one handle per file per process).
            self._close_file()

    def grow(self, source: ReplaySource, layout: Layout) -> bool:
        """Maps the chunks a growing store added in place; False: reopen instead.

        HDF5 writes a chunk where it was allocated: the chunks mapped stay, and
        only those past them are mapped (from the chunk that held the old end,
        in case its place changed). Every leaf must be a stitched map of this
        same file (not replaced since it was opened). ``source`` (the one that opened
        this handle, as the Handle protocol passes it) is not read: its path is the
        handle's own.
        """
        if self.file is not None or self._fileobj is not None or self._descriptor is None:
            return False
        try:
            if os.stat(self._path).st_ino != os.fstat(self._descriptor.fd).st_ino:
                return False
        except OSError:
            return False
        n = layout.num_records
        plans = []
        f, access = open_h5(self._path)
        with f:
            for key, loc in layout.locations.items():
                reader = self.readers.get(key)
                stitched = stitched_map(reader)
                guards = self.mapped_files.get(key, [])
                if stitched is None:
                    return False
                spec = layout.spec[key]
                row_bytes = spec.dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64))
                dset = fresh(f[loc], access)
                if dset.chunks is None or dset.chunks[0] * row_bytes != stitched.chunk_bytes:
                    return False
                parts = hdf5_raw.chunk_parts(dset, self._path, n, row_bytes)
                first = self._n // dset.chunks[0]
                if parts is None or parts[:first] != stitched.parts[:first] or len(guards) != 1:
                    return False
                reach = hdf5_raw.chunk_reach(
                    ((c, off) for c, (_, off) in enumerate(parts)),
                    stitched.chunk_bytes,
                    n * row_bytes,
                )
                plans.append((reader, parts, first, spec, reach, guards[0]))
        if os.stat(self._path).st_ino != os.fstat(self._descriptor.fd).st_ino:
            return False  # replaced while planned: the parts may be another file's
        size = os.fstat(self._descriptor.fd).st_size
        for reader, parts, first, spec, reach, guard in plans:
            if size < reach or not grow_stitched(reader, parts, first, spec.dtype, spec.shape, n):
                return False
            guard.needed = max(guard.needed, reach)
        self._n = n
        return True

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
        self._guards = []  # each descriptor closes when its last reader is gone


def _rows_per(dset: Any, target_bytes: int) -> int:
    row_bytes = max(1, dset.dtype.itemsize * int(np.prod(dset.shape[1:], dtype=np.int64)))
    return max(1, target_bytes // row_bytes)


def _block_reader(dset: Any, chunk_rows: int, n: int) -> Any:
    def read_blocks(chunk_ids: Sequence[int]) -> list[np.ndarray]:
        return [dset[c * chunk_rows : min((c + 1) * chunk_rows, n)] for c in chunk_ids]

    return read_blocks
