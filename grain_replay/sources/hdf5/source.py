"""HDF5 data source: memory-mapped contiguous datasets, chunk-aware reads otherwise."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from grain_replay import remote as remote_lib
from grain_replay import tree as tree_lib
from grain_replay.errors import GrainReplayError, InvalidStoreError, StoreNotFoundError
from grain_replay.remote import RetryOptions
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.hdf5 import filters as hdf5_filters
from grain_replay.sources.hdf5 import raw as hdf5_raw
from grain_replay.sources.hdf5 import refs as hdf5_refs
from grain_replay.sources.hdf5.handle import HDF5Handle, HDF5Opening
from grain_replay.sources.hdf5.held import (
    Access,
    fresh,
    lock_held,
    open_h5,
    say_written,
    written_prefix,
)
from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES
from grain_replay.sources.reading.readers import Handle
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import (
    HDF5_SIGNATURE,
    STORE_FAULTS,
    damaged_store,
    import_h5py,
    is_url,
    metadata_from_attrs,
    require_regular_file,
    shown_path,
    store_not_found,
)

__all__ = ["HDF5DataSource"]

logger = logging.getLogger(__name__)


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
      allow_external: read leaves whose data lives outside the file (HDF5
        external links, virtual datasets, external raw storage). Off by
        default: such a file could read any file on the machine.

    Raises:
      StoreNotFoundError: nothing is at ``path``.
      UnfinishedWriteError: nothing is at ``path`` but the ``.partial`` of a write
        of it that never finished.
      InvalidStoreError: the file is not a readable HDF5 replay store, or a
        selected leaf refers outside it and ``allow_external`` is False.

    Examples:
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
        allow_external: bool = False,
    ):
        self._cache_bytes = cache_bytes
        self._retry = remote_lib.retry_options(retries)
        # Who held the file for writing when its layout was last read, and what was said.
        self._access = Access.FREE
        self._said = Access.FREE
        super().__init__(path, keys, storage_options=storage_options, allow_external=allow_external)

    def refresh(self) -> int:
        """Re-reads the file to see rows flushed since; returns the new length.

        While a writer not in SWMR mode still holds the file open (see the warning
        given at open), nothing is read again: the rows stay those read at open,
        because HDF5 orders nothing between that writer's flushes and a reader. Once
        it has closed the file, this reads every row. A writer in SWMR mode is read
        again at each call (``swmr=True``, its datasets refreshed).
        """
        if self._keeps_snapshot():
            return len(self)
        if self._access is Access.HELD:
            # The writer let go: open afresh (a handle opened while it wrote, still
            # open, would share its view of the file with the next open here).
            self.close()
        return super().refresh()

    def grow_in_place(self) -> bool:
        """See :meth:`ReplaySource.grow_in_place`; False while a writer not in SWMR mode
        still holds the file (as :meth:`refresh`, the rows stay those read at open)."""
        if self._keeps_snapshot():
            return False
        return super().grow_in_place()

    def _keeps_snapshot(self) -> bool:
        """Whether the rows read while a writer (not SWMR) held the file stay as they are."""
        if self._access is not Access.HELD or not lock_held(self._path):
            return False
        logger.debug(
            "%s: still open for writing in another process (not SWMR); refresh() keeps the "
            "%d rows read at open",
            self._path,
            len(self),
        )
        return True

    def _say_written(self, access: Access, rows: int) -> None:
        """Logs once (per writer seen) that the file is open for writing elsewhere."""
        self._access = access
        if access is self._said:
            return
        self._said = access
        say_written(self._path, access, rows)

    def _open(self) -> Handle:
        opening = HDF5Opening(
            self._path, self._layout, self._cache_bytes, self._storage_options, self._retry
        )
        if is_url(self._path):
            return HDF5Handle(opening)
        return hdf5_raw.retry_while_written(self._path, lambda: HDF5Handle(opening))

    def _inspect(self) -> Layout:
        if not is_url(self._path):
            if not os.path.exists(self._path):
                raise store_not_found(
                    self._path,
                    f"No HDF5 file at {self._path}. Fix: check the path, or write one with "
                    "gr.write_hdf5(path, tree).",
                )
            require_regular_file(self._path)  # a FIFO would block open() forever
            with open(self._path, "rb") as f:
                if f.read(8) != HDF5_SIGNATURE:
                    raise InvalidStoreError(
                        f"{self._path} is not an HDF5 file (no HDF5 signature). Fix: pass an "
                        "HDF5 file, or use gr.open_source(path) to detect the format."
                    )
        if is_url(self._path):
            from grain_replay.sources.hdf5.remote import inspect_remote

            return inspect_remote(self._path, self._storage_options, self._retry, self._layout_of)
        try:
            layout, access = hdf5_raw.retry_while_written(self._path, self._read_layout)
            self._say_written(access, layout.num_records)
            return layout
        except GrainReplayError:
            raise
        except FileNotFoundError as e:
            raise StoreNotFoundError(f"No HDF5 file at {shown_path(self._path)}: {e}") from e
        except STORE_FAULTS as e:  # RuntimeError, KeyError too: "bad symbol table node", ...
            raise damaged_store(self._path, e, doing="h5py opening the file") from e

    def _read_layout(self) -> tuple[Layout, Access]:
        f, access = open_h5(self._path)
        with f:
            return self._layout_of(f, access), access

    def _layout_of(self, f: Any, access: Access = Access.FREE) -> Layout:
        try:
            meta = metadata_from_attrs(f.attrs, self._path)
        except GrainReplayError:
            raise
        except STORE_FAULTS as e:
            raise damaged_store(
                self._path, e, doing=f"reading its metadata attribute {layout_lib.METADATA_ATTR!r}"
            ) from e
        if meta is not None:
            locations = {k: layout_lib.disk_name(k) for k in meta.leaves}
            for key, loc in locations.items():
                try:
                    self._check_leaf(f, key, loc, meta, access)
                except GrainReplayError:
                    raise
                except STORE_FAULTS as e:
                    raise damaged_store(self._path, e, leaf=key, doing=f"opening {loc!r}") from e
            return Layout.of_store(meta, locations)
        return self._foreign_layout(f, access)

    def _check_leaf(
        self, f: Any, key: str, loc: str, meta: layout_lib.StoreMetadata, access: Access
    ) -> None:
        """The dataset of a leaf the metadata lists: there, in the file, as the metadata says."""
        h5py = import_h5py()
        if not self._allow_external:
            hdf5_refs.check_link_path(f, self._path, key, loc)
        dset = f.get(loc)
        if not isinstance(dset, h5py.Dataset):
            raise InvalidStoreError(
                f"{self._path}: leaf {key!r} is listed in the metadata but dataset "
                f"{loc!r} is missing. The file is corrupt; re-create it."
            )
        if not self._allow_external:
            hdf5_refs.check_dataset_refs(dset, self._path, key)
        hdf5_filters.require_filters(dset, self._path, key)
        self._check_dataset(key, fresh(dset, access), meta.num_records, meta.leaves[key])

    def _foreign_layout(self, f: Any, access: Access = Access.FREE) -> Layout:
        """A file written by others: every dataset with a records axis is a leaf."""
        try:
            found, links = hdf5_refs.foreign_datasets(f, self._allow_external)
        except GrainReplayError:
            raise
        except STORE_FAULTS as e:
            raise damaged_store(
                self._path, e, doing="listing its datasets (no grain_replay metadata)"
            ) from e
        for name, link in links.items():
            if self._requested_keys is None or any(
                k == name or k.startswith(name + "/") or name.startswith(k.rstrip("/") + "/")
                for k in self._requested_keys
            ):
                raise hdf5_refs.refuse(
                    self._path, name, f"is an HDF5 external link to {link.filename}:{link.path}"
                )
        for name, obj in list(found.items()):
            if obj.ndim == 0 or obj.shape is None:
                logger.warning("%s: skipping scalar dataset %r", self._path, name)
                del found[name]
        if not found:
            raise InvalidStoreError(
                f"{self._path}: the file holds no dataset with a records axis. Fix: write "
                "one with gr.write_hdf5(path, tree)."
            )
        keys = layout_lib.foreign_keys(found, self._requested_keys)
        spec = {}
        for k in keys:
            fresh(found[k], access)
            if not self._allow_external:
                hdf5_refs.check_dataset_refs(found[k], self._path, k)
            hdf5_filters.require_filters(found[k], self._path, k)
            dtype = layout_lib.check_dtype(found[k].dtype, k, self._path)
            spec[k] = layout_lib.LeafSpec(dtype, tuple(found[k].shape[1:]))
        lengths = {k: found[k].shape[0] for k in keys}
        n = written_prefix(self._path, found, lengths) if access is not Access.FREE else None
        if n is None:
            n = layout_lib.common_length(self._path, lengths)
        return Layout(n, spec, tree_lib.treedef_from_keys(keys), {k: k for k in keys})

    def _check_dataset(self, key: str, dset: Any, n: int, want: layout_lib.LeafSpec) -> None:
        shape = want.shape
        if dset.shape is None or dset.shape[0] < n or tuple(dset.shape[1:]) != shape:
            raise InvalidStoreError(
                f"{self._path}: leaf {key!r} has shape {dset.shape} but the metadata says "
                f"({n}, {', '.join(map(str, shape))}). The file is corrupt; re-create it."
            )
        if dset.dtype != want.dtype:
            raise InvalidStoreError(
                f"{self._path}: leaf {key!r} holds {dset.dtype} but the metadata says "
                f"{want.dtype}. The file is corrupt or was edited; re-create it."
            )
