"""Per-format storage of a growing store: rows beyond the committed N are invisible.

Each backend keeps the same invariant: rows ``[0, N)`` of every leaf are on
disk before the metadata says ``N``, and nothing a later append does touches
them. A crash therefore leaves the committed rows intact, and reopening drops
whatever was written after the last commit. The commit primitives (fsync of
many files, in-place headers and metadata) are in :mod:`grain_replay.writers.durable`.
"""

from __future__ import annotations

import abc
import os
from typing import Any

import numpy as np

from grain_replay import layout as layout_lib
from grain_replay.errors import InvalidArgumentError, InvalidStoreError, StoreExistsError
from grain_replay.formats import (
    PAGE,
    import_h5py,
    import_zarr,
    metadata_from_attrs,
    read_npy_header,
    read_npy_metadata,
)
from grain_replay.integrity import as_bytes
from grain_replay.writers.atomic import atomic_path, fsync_path
from grain_replay.writers.background import LeafWriteError
from grain_replay.writers.durable import (
    NPY_HEADER,
    commit_metadata,
    fixed_metadata,
    fsync_all,
    npy_header,
    open_h5,
    row_bytes,
)
from grain_replay.writers.oneshot import chunk_rows_for, create_zarr_leaf, zarr_compressors

__all__ = [
    "Backend",
    "NpyBackend",
    "NpySegmentBackend",
    "ZarrBackend",
    "HDF5Backend",
    "BACKENDS",
    "write_by_leaf",
]

# Chunks of growing HDF5/Zarr stores: ~1 MiB, whole pages, so readers map them.
APPEND_CHUNK_BYTES = 1 << 20


class Backend(abc.ABC):
    """Storage for one growing store. ``meta`` holds the committed N and the leaves."""

    def __init__(self, path: str, meta: layout_lib.StoreMetadata):
        self.path = path
        self.meta = meta

    @classmethod
    @abc.abstractmethod
    def read_metadata(cls, path: str) -> layout_lib.StoreMetadata | None:
        """The committed metadata, or None for a store without it (foreign)."""

    @abc.abstractmethod
    def write(self, arrays: dict[str, np.ndarray], start: int) -> None:
        """Writes rows ``[start, start + len)`` of every leaf (not yet committed)."""

    @abc.abstractmethod
    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of leaf ``key`` as written (to recompute a checksum)."""

    @abc.abstractmethod
    def commit(self, n: int, checksums: dict[str, Any] | None) -> None:
        """Makes rows ``[0, n)`` durable, then records ``n`` (and checksums) in the metadata."""

    @classmethod
    @abc.abstractmethod
    def create_open(
        cls,
        path: str,
        meta: layout_lib.StoreMetadata,
        chunk_rows: int | None,
        compression: str | None,
        *,
        sync: bool = True,
    ) -> Backend:
        """Creates an empty store (N = 0) atomically (durably unless ``sync=False``) and
        returns it opened for appending, without re-reading what was just written where
        the backend can keep it open."""

    def stage_commit(self, n: int, checksums: dict[str, Any] | None) -> list[int]:
        """The first half of a commit whose commit point is elsewhere (a writer part's
        manifest): records ``n`` and returns the descriptors whose ``fsync`` makes rows
        ``[0, n)`` and that record durable; the caller syncs them (with its own, in one
        round), then calls :meth:`finish_commit`. Readers may see ``n`` before the sync,
        as with :meth:`commit`. Here: the whole commit, nothing left to sync."""
        self.commit(n, checksums)
        return []

    def finish_commit(self) -> str | None:
        """After :meth:`stage_commit`'s descriptors are synced: the rest of the commit;
        returns a directory whose ``fsync`` makes it durable, or None."""
        return None

    def close(self) -> None:  # noqa: B027 - optional
        """Releases file handles."""

    def _meta_with(self, n: int, checksums: dict[str, Any] | None) -> layout_lib.StoreMetadata:
        m = self.meta
        return layout_lib.StoreMetadata(n, m.leaves, m.treedef, checksums, m.version)


def write_by_leaf(backend: Backend, arrays: dict[str, np.ndarray], start: int) -> None:
    """``backend.write`` one leaf at a time; a failure is raised as a
    :class:`~grain_replay.writers.background.LeafWriteError` naming the leaf."""
    for key, arr in arrays.items():
        try:
            backend.write({key: arr}, start)
        except Exception as e:
            raise LeafWriteError(key) from e


# -- .npy directory -------------------------------------------------------------


class NpyBackend(Backend):
    """A directory of ``.npy`` files grown in place; headers and metadata follow the data."""

    HEADER = NPY_HEADER  # bytes before the rows: fixed, so it is rewritten in place

    def __init__(self, path: str, meta: layout_lib.StoreMetadata):
        self._setup(path, meta)
        n = meta.num_records
        for key, file in self._files.items():
            spec = meta.leaves[key]
            if read_npy_header(file, key, check_size=False)[3] != self.HEADER:
                self._rewrite_with_fixed_header(file, spec, n)
            fd = os.open(file, os.O_RDWR)
            header = npy_header(spec.dtype, (n, *spec.shape), self.HEADER)
            size = self.HEADER + n * row_bytes(spec)
            # A file that is exactly this header and n rows (e.g. a segment just made
            # empty) needs neither; else header first: a crash between the two steps
            # leaves a header of n rows over a file of at least n rows, which every
            # reader accepts.
            if os.fstat(fd).st_size != size or os.pread(fd, self.HEADER, 0) != header:
                os.pwrite(fd, header, 0)
                os.fsync(fd)
                os.truncate(fd, size)  # drop uncommitted rows
            self._fds[key] = fd

    def _setup(self, path: str, meta: layout_lib.StoreMetadata) -> None:
        super().__init__(path, meta)
        self._files = {k: os.path.join(path, layout_lib.disk_name(k) + ".npy") for k in meta.leaves}
        self._fds: dict[str, int] = {}
        self.row_bytes = {k: row_bytes(spec) for k, spec in meta.leaves.items()}
        self._staged: tuple[str, int] | None = None  # metadata written, not yet in place

    @classmethod
    def _rewrite_with_fixed_header(cls, file: str, spec: layout_lib.LeafSpec, n: int) -> None:
        """One-time copy of a file written by np.save into the growable layout."""
        data = np.load(file, mmap_mode="r", allow_pickle=False)[:n]
        tmp = file + ".partial"
        with open(tmp, "wb") as f:
            f.write(npy_header(spec.dtype, (n, *spec.shape), cls.HEADER))
            f.write(np.ascontiguousarray(data).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)

    @classmethod
    def create_open(cls, path, meta, chunk_rows, compression, *, sync=True):  # type: ignore[no-untyped-def]
        # The leaf files stay open across the swap into place, and they hold exactly an
        # empty header: nothing to re-read or repair (see __init__).
        fds = cls._create(path, meta, chunk_rows, compression, sync)
        backend = cls.__new__(cls)
        backend._setup(path, meta)
        backend._fds = fds
        return backend

    @classmethod
    def _create(
        cls,
        path: str,
        meta: layout_lib.StoreMetadata,
        chunk_rows: int | None,
        compression: str | None,
        sync: bool,
    ) -> dict[str, int]:
        """Creates the store (N = 0, as :meth:`create_open`); returns its leaf files, open."""
        if chunk_rows is not None or compression is not None:
            raise InvalidArgumentError(
                f"{path}: .npy stores cannot be chunked or compressed. Fix: drop "
                "chunk_rows/compression, or use format='zarr'."
            )
        assert meta.num_records == 0
        fds: dict[str, int] = {}
        try:
            with atomic_path(path, overwrite=False, sync=sync) as partial:
                os.mkdir(partial)
                for key, spec in meta.leaves.items():
                    name = layout_lib.disk_name(key) + ".npy"
                    if "/" in name:
                        os.makedirs(os.path.join(partial, os.path.dirname(name)), exist_ok=True)
                    fd = os.open(os.path.join(partial, name), os.O_RDWR | os.O_CREAT | os.O_EXCL)
                    fds[key] = fd
                    os.write(fd, npy_header(spec.dtype, (0, *spec.shape), cls.HEADER))
                with open(os.path.join(partial, layout_lib.METADATA_FILE), "w") as f:
                    f.write(meta.to_json())
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds

    @classmethod
    def read_metadata(cls, path: str) -> layout_lib.StoreMetadata | None:
        return read_npy_metadata(path)

    def write(self, arrays: dict[str, np.ndarray], start: int) -> None:
        for key, arr in arrays.items():
            offset = self.HEADER + start * self.row_bytes[key]
            view = as_bytes(arr)
            while view:
                written = os.pwrite(self._fds[key], view, offset)
                view, offset = view[written:], offset + written

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        spec = self.meta.leaves[key]
        size = row_bytes(spec)
        raw = os.pread(self._fds[key], (stop - start) * size, self.HEADER + start * size)
        return np.frombuffer(raw, dtype=spec.dtype).reshape(stop - start, *spec.shape)

    def commit(self, n: int, checksums: dict[str, Any] | None) -> None:
        fsync_all(list(self._fds.values()))
        for key, fd in self._fds.items():
            spec = self.meta.leaves[key]
            os.pwrite(fd, npy_header(spec.dtype, (n, *spec.shape), self.HEADER), 0)
        fsync_all(list(self._fds.values()))
        self.meta = self._meta_with(n, checksums)
        meta_file = os.path.join(self.path, layout_lib.METADATA_FILE)
        tmp = meta_file + ".partial"
        with open(tmp, "w") as f:
            f.write(self.meta.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, meta_file)
        fsync_path(self.path)

    def stage_commit(self, n: int, checksums: dict[str, Any] | None) -> list[int]:
        # Data and headers are synced in one round with the caller's commit point staged
        # beside them: a crash before that point leaves headers (and metadata) at most
        # ahead of the commit point over rows not all on disk, which readers never read
        # (they read the rows the commit point names) and reopening cuts back.
        if self._staged is not None:  # the last one failed before finishing: redone
            os.close(self._staged[1])
            self._staged = None
        for key, fd in self._fds.items():
            spec = self.meta.leaves[key]
            os.pwrite(fd, npy_header(spec.dtype, (n, *spec.shape), self.HEADER), 0)
        self.meta = self._meta_with(n, checksums)
        tmp = os.path.join(self.path, layout_lib.METADATA_FILE) + ".partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.write(fd, self.meta.to_json().encode())
        except BaseException:
            os.close(fd)
            raise
        self._staged = (tmp, fd)
        return [*self._fds.values(), fd]

    def finish_commit(self) -> str | None:
        assert self._staged is not None, "stage_commit() was not called"
        (tmp, fd), self._staged = self._staged, None
        os.close(fd)
        os.replace(tmp, os.path.join(self.path, layout_lib.METADATA_FILE))
        return self.path

    def close(self) -> None:
        if self._staged is not None:  # a commit that did not finish: as after a crash
            os.close(self._staged[1])
            self._staged = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


class NpySegmentBackend(NpyBackend):
    """A segment of a many-writer ``.npy`` store: rows start at a page boundary, so a
    reader maps the segments of a writer back to back into one array per leaf."""

    HEADER = max(PAGE, NPY_HEADER)


# -- Zarr -----------------------------------------------------------------------


class ZarrBackend(Backend):
    """Zarr v3 group: chunk and metadata files are each replaced atomically by zarr."""

    def __init__(self, path: str, meta: layout_lib.StoreMetadata):
        super().__init__(path, meta)
        # Its members are arrays by construction.
        group: Any = import_zarr().open_group(path, mode="r+")
        self._group = group
        # Every chunk on disk, even all-zero ones, so readers can map them.
        self._arrays: dict[str, Any] = {
            k: group[layout_lib.disk_name(k)].with_config({"write_empty_chunks": True})
            for k in meta.leaves
        }
        n = meta.num_records
        for arr in self._arrays.values():
            if arr.shape[0] != n:  # rows written after the last commit
                arr.resize((n, *arr.shape[1:]))

    @classmethod
    def create_open(cls, path, meta, chunk_rows, compression, *, sync=True):  # type: ignore[no-untyped-def]
        if sync:  # zarr's arrays name their path: the swap into place would orphan them
            with atomic_path(path, overwrite=False, sync=sync) as partial:
                cls._make(partial, meta, chunk_rows, compression)
            return cls(path, meta)
        # Not durable until a later commit point names it (a writer part's segment): made
        # in place, which a crash leaves unnamed, so that reopening removes it as it
        # removes an unswapped .partial; the arrays just made are kept, not re-read.
        if os.path.lexists(path):
            raise StoreExistsError(f"{path} already exists (a segment made twice).")
        group, arrays = cls._make(path, meta, chunk_rows, compression)
        backend = cls.__new__(cls)
        Backend.__init__(backend, path, meta)
        backend._group, backend._arrays = group, arrays
        return backend

    @classmethod
    def _make(
        cls,
        path: str,
        meta: layout_lib.StoreMetadata,
        chunk_rows: int | None,
        compression: str | None,
    ) -> tuple[Any, dict[str, Any]]:
        """An empty group at ``path`` (N = 0); returns it and its arrays."""
        zarr = import_zarr()
        compressors = zarr_compressors(compression, path)
        group = zarr.open_group(path, mode="w", zarr_format=3)
        arrays = {}
        for key, spec in meta.leaves.items():
            shape = (1, *spec.shape)
            rows = chunk_rows or chunk_rows_for(
                shape, spec.dtype.itemsize, APPEND_CHUNK_BYTES, page_aligned=compression is None
            )
            arrays[key] = create_zarr_leaf(group, key, spec, 0, rows, compressors)
        group.attrs[layout_lib.METADATA_ATTR] = meta.to_json()
        return group, arrays

    @classmethod
    def read_metadata(cls, path: str) -> layout_lib.StoreMetadata | None:
        return metadata_from_attrs(import_zarr().open_group(path, mode="r").attrs, path)

    def write(self, arrays: dict[str, np.ndarray], start: int) -> None:
        stop = start + len(next(iter(arrays.values())))
        for key, arr in arrays.items():
            z = self._arrays[key]
            if z.shape[0] < stop:
                z.resize((stop, *z.shape[1:]))
            z[start:stop] = arr

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        return np.asarray(self._arrays[key][start:stop])

    def commit(self, n: int, checksums: dict[str, Any] | None) -> None:
        self.meta = self._meta_with(n, checksums)
        self._group.attrs[layout_lib.METADATA_ATTR] = self.meta.to_json()


# -- HDF5 -----------------------------------------------------------------------


class HDF5Backend(Backend):
    """Chunked, uncompressed datasets with chunks allocated ahead of the rows.

    Chunks are allocated when capacity grows (geometrically, rarely), so an
    append writes raw chunk bytes only and changes no HDF5 structure; the
    committed N is a fixed-size attribute rewritten in place.
    """

    def __init__(self, path: str, meta: layout_lib.StoreMetadata):
        super().__init__(path, meta)

        self._file = open_h5(
            path, "r+", alignment_threshold=PAGE, alignment_interval=PAGE, locking=False
        )
        self._dsets = {k: self._file[layout_lib.disk_name(k)] for k in meta.leaves}
        attrs = self._file.attrs
        if layout_lib.METADATA_ATTR_NEXT in attrs:  # finish a commit that died growing it
            attrs.create(layout_lib.METADATA_ATTR, attrs[layout_lib.METADATA_ATTR_NEXT])
            self._file.flush()
            del attrs[layout_lib.METADATA_ATTR_NEXT]
        for key, d in self._dsets.items():
            if d.compression is not None or d.id.get_create_plist().get_nfilters():
                raise InvalidStoreError(
                    f"{path}: leaf {key!r} is compressed; appending to compressed HDF5 is not "
                    "crash-safe (rewritten chunks move on disk). Fix: convert to an "
                    "uncompressed store, or append to a Zarr store with compression."
                )
            if d.chunks is None or d.maxshape[0] is not None:
                raise InvalidStoreError(
                    f"{path}: leaf {key!r} is not resizable (written by gr.write, or by "
                    "another tool), so rows cannot be appended. Fix: convert it, e.g. "
                    "`grain-replay convert` into a new store, or append to a Zarr store."
                )

    @classmethod
    def create_open(cls, path, meta, chunk_rows, compression, *, sync=True):  # type: ignore[no-untyped-def]
        # The file stays open across the swap into place (its handle follows the inode):
        # what was just made is neither reopened nor checked again (see __init__).
        h5py = import_h5py()
        if compression is not None:
            raise InvalidArgumentError(
                f"{path}: a growing HDF5 store must be uncompressed (compressed chunks move "
                "on disk when rewritten, which a crash could leave half done). Fix: drop "
                "compression, or use format='zarr' with compression."
            )
        f = None
        try:
            with atomic_path(path, overwrite=False, sync=sync) as partial:
                f = h5py.File(
                    partial, "w", alignment_threshold=PAGE, alignment_interval=PAGE, locking=False
                )
                for key, spec in meta.leaves.items():
                    rows = chunk_rows or chunk_rows_for(
                        (1, *spec.shape), spec.dtype.itemsize, APPEND_CHUNK_BYTES,
                        page_aligned=True,
                    )  # fmt: skip
                    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                    f.create_dataset(
                        layout_lib.disk_name(key),
                        shape=(0, *spec.shape),
                        # A zero-size dim cannot hold a chunk of 1 unless it is unlimited.
                        maxshape=(None, *(None if d == 0 else d for d in spec.shape)),
                        chunks=(rows, *(max(1, d) for d in spec.shape)),
                        dtype=spec.dtype,
                        dcpl=dcpl,
                    )
                f.attrs.create(layout_lib.METADATA_ATTR, fixed_metadata(meta))
                f.flush()  # on disk (in the OS) before the swap and its fsync
        except BaseException:
            if f is not None:
                f.close()
            raise
        backend = cls.__new__(cls)
        Backend.__init__(backend, path, meta)
        backend._file = f
        backend._dsets = {k: f[layout_lib.disk_name(k)] for k in meta.leaves}
        return backend

    @classmethod
    def read_metadata(cls, path: str) -> layout_lib.StoreMetadata | None:
        with open_h5(path, "r", locking=False) as f:
            return metadata_from_attrs(f.attrs, path)  # a commit that died growing it: .next

    def write(self, arrays: dict[str, np.ndarray], start: int) -> None:
        stop = start + len(next(iter(arrays.values())))
        capacity = min(d.shape[0] for d in self._dsets.values())
        if stop > capacity:
            # Grow all leaves together, ahead of need: allocation is the only
            # structural change, so keep it rare.
            new = max(stop, 2 * capacity)
            for d in self._dsets.values():
                rows = d.chunks[0]
                d.resize((-(-new // rows) * rows, *d.shape[1:]))
            self._file.flush()
        for key, arr in arrays.items():
            self._dsets[key][start:stop] = arr

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        return np.asarray(self._dsets[key][start:stop])

    def commit(self, n: int, checksums: dict[str, Any] | None) -> None:
        self._file.flush()
        os.fsync(self._file.id.get_vfd_handle())
        self.meta = self._meta_with(n, checksums)
        commit_metadata(self._file, self.meta)
        self._file.flush()
        os.fsync(self._file.id.get_vfd_handle())

    def stage_commit(self, n: int, checksums: dict[str, Any] | None) -> list[int]:
        # The rows first (the metadata is rewritten in place, after them); its own sync
        # is left to the caller's round, before the caller's commit point.
        self._file.flush()
        os.fsync(self._file.id.get_vfd_handle())
        self.meta = self._meta_with(n, checksums)
        commit_metadata(self._file, self.meta)
        self._file.flush()
        return [self._file.id.get_vfd_handle()]

    def close(self) -> None:
        self._file.close()


BACKENDS: dict[str, type[Backend]] = {"npy": NpyBackend, "zarr": ZarrBackend, "hdf5": HDF5Backend}
