"""``.npy`` data source: one read-only memory map per leaf file."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Mapping
from typing import cast

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.reading.files import MappedFile, check_inside
from grain_replay.sources.reading.growing import GrowingMap, map_file
from grain_replay.sources.reading.readers import ArrayReader, Handle
from grain_replay.sources.reading.rereads import RereadPolicy, growing, read_while_written
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import (
    GROWING_NPY_HEADER,
    PAGE,
    read_npy_header,
    read_npy_metadata,
    store_not_found,
)

__all__ = ["NpyDataSource"]


class _NpyHandle(Handle):
    def __init__(self, source: NpyDataSource):
        n = len(source)
        self.readers = {}
        self.mapped_files = {}
        # Leaf -> (map that grows with the file, data offset): see grow().
        self._growing: dict[str, tuple[GrowingMap, int]] = {}
        for key, file in source._layout.locations.items():
            spec = source._layout.spec[key]
            if key in source._headers:  # a store with metadata: a writer may rewrite it
                fortran, offset = _committed_header(file, key, spec, n)
            else:
                _, _, fortran, offset = read_npy_header(file, key, rows=n)
            shape = (n, *spec.shape)
            if n == 0 or spec.dtype.itemsize == 0 or 0 in spec.shape:
                array = np.zeros(shape, spec.dtype)  # np.memmap refuses empty maps
            else:
                # Only the rows the metadata committed are mapped: a growing
                # store's header and data may run ahead of them.
                needed = offset + math.prod(shape) * spec.dtype.itemsize
                # Only a ReplayWriter's files grow in place (others are replaced):
                # only they get address space reserved ahead.
                # (or a segment of a many-writer store: page-sized headers)
                growable = not fortran and (offset == GROWING_NPY_HEADER or offset == PAGE)
                grows = map_file(file, needed) if growable else None
                if grows is not None:
                    array = grows.array(offset, shape, spec.dtype)
                    self._growing[key] = (grows, offset)
                    self.mapped_files[key] = [grows.file]
                else:
                    mapping = _map_file(file, key, needed)
                    array = np.ndarray(
                        shape,
                        spec.dtype,
                        buffer=mapping,
                        offset=offset,
                        order="F" if fortran else "C",
                    )
                    # The map's own descriptor answers the truncation check: one
                    # descriptor per leaf file (np.memmap plus a check held two).
                    self.mapped_files[key] = [MappedFile(file, needed, mapping=mapping)]
            self.readers[key] = ArrayReader(array)

    def grow(self, source: NpyDataSource, layout: Layout) -> bool:
        """Extends every leaf's map to ``layout``'s rows in place; False: reopen instead."""
        headers: Mapping[str, tuple[bool, int]] = source._headers  # as its _inspect read them
        n = layout.num_records
        if set(layout.locations) != set(self._growing):
            return False
        for key, file in layout.locations.items():
            grows, offset = self._growing[key]
            spec = layout.spec[key]
            needed = offset + n * math.prod(spec.shape) * spec.dtype.itemsize
            if grows.path != file or headers.get(key) != (False, offset) or not grows.grow(needed):
                return False
        for key, (grows, offset) in self._growing.items():
            spec = layout.spec[key]
            cast(ArrayReader, self.readers[key]).grow(
                grows.array(offset, (n, *spec.shape), spec.dtype)
            )
        return True


# A writer rewrites each leaf's header in place at every commit, and a read of the page
# cache is not ordered against a write to it: a header read while it is rewritten
# can be a mix of the two (rows 1383 from 1385 and 1393; 100 from 999 and 1000; a
# trailing dimension shifted), with no change of mtime or size to see. Such a read is
# made again whatever stat says (a rewrite takes microseconds: pauses growing by
# 0.5 ms, 8 reads); a store whose header keeps disagreeing with its metadata is corrupt.
# See sources/reading/rereads.py.
_HEADER_READS = 8
_HEADER_REREADS = RereadPolicy(
    pauses_s=growing(0.0005, _HEADER_READS), retried=(InvalidStoreError,)
)


def _committed_header(
    file: str, key: str, want: layout_lib.LeafSpec, rows: int
) -> tuple[bool, int]:
    """``(fortran order, data offset)`` of leaf ``key``'s file, whose header must declare
    ``want`` and at least the ``rows`` committed (a writer's header may run ahead)."""

    def disagrees(header: tuple[tuple[int, ...], np.dtype, bool, int]) -> Exception | None:
        shape, dtype, _, _ = header
        if shape[:1] >= (rows,) and shape[1:] == want.shape and dtype == want.dtype:
            return None
        return InvalidStoreError(
            f"{file}: leaf {key!r} holds {dtype}{list(shape)} but the metadata "
            f"says {want.dtype}[{rows}, ...{list(want.shape)}]. "
            "The store is corrupt; re-create it."
        )

    # An unparsable or short header (InvalidStoreError) may be torn too: read again.
    _, _, fortran, offset = read_while_written(
        lambda: read_npy_header(file, key, rows=rows), _HEADER_REREADS, path=file, check=disagrees
    )
    return fortran, offset


def _map_file(path: str, key: str, needed: int) -> mmap.mmap:
    """A read-only map of the first ``needed`` bytes of ``path``, advised for random reads."""
    with open(path, "rb") as f:
        try:
            mapping = mmap.mmap(f.fileno(), needed, access=mmap.ACCESS_READ)
        except ValueError as e:  # the file shrank since its header was read
            size = os.fstat(f.fileno()).st_size
            raise InvalidStoreError(
                f"{path}: leaf {key!r} needs {needed:,} bytes but the file holds {size:,}: it "
                "was truncated after the store was opened. Fix: re-create it, and do not "
                "rewrite stores in place while they are read."
            ) from e
    if hasattr(mmap, "MADV_RANDOM"):
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_RANDOM)  # random rows: no read-ahead per fault
    return mapping


class NpyDataSource(ReplaySource):
    """Random-access grain source over ``.npy`` files, memory-mapped read-only.

    ``path`` is a directory of ``.npy`` files (``obs/pixels.npy`` is leaf
    ``obs/pixels``), or a single ``.npy`` file whose rows are the records.
    Files are opened with ``allow_pickle=False``: object arrays are refused.

    Examples:
      >>> src = gr.NpyDataSource("replay_dir")
      >>> src[0]["obs"].shape
    """

    # Leaf -> (fortran order, data offset) of its file, as _inspect read the header.
    _headers: dict[str, tuple[bool, int]]

    def _open(self) -> Handle:
        return _NpyHandle(self)

    def _inspect(self) -> Layout:
        path = self._path
        self._headers = {}  # filled for stores with metadata: only they grow
        if os.path.isfile(path):
            shape, dtype, _, _ = read_npy_header(path, tree_lib.ROOT_KEY)
            if len(shape) == 0:
                raise InvalidStoreError(
                    f"{path}: the array is a scalar; a store needs a leading records axis."
                )
            root = {tree_lib.ROOT_KEY: layout_lib.LeafSpec(dtype, shape[1:])}
            return Layout(shape[0], root, tree_lib.treedef_from_keys([""]), {"": path})
        if not os.path.isdir(path):
            raise store_not_found(
                path,
                f"No .npy store at {path}. Fix: check the path, or write one with "
                "gr.write(path, tree) (a path without .h5 or .zarr is a .npy directory).",
            )
        meta_path = os.path.join(path, layout_lib.METADATA_FILE)
        meta = read_npy_metadata(path)
        if meta is not None:
            locations = {
                k: os.path.join(path, layout_lib.disk_name(k) + ".npy") for k in meta.leaves
            }
            check_inside(path, meta_path, "<metadata>", self._allow_external)
            for key, file in locations.items():
                check_inside(path, file, key, self._allow_external)
                self._headers[key] = _committed_header(
                    file, key, meta.leaves[key], meta.num_records
                )
            return Layout.of_store(meta, locations)
        found = _find_npy_files(path, self._allow_external)
        if not found:
            raise InvalidStoreError(
                f"{path}: the directory holds no .npy file. Fix: check the path, or write a "
                "store there with gr.write(path, tree, overwrite=True)."
            )
        keys = layout_lib.foreign_keys(found, self._requested_keys)
        spec: dict[str, layout_lib.LeafSpec] = {}
        lengths: dict[str, int] = {}
        for k in keys:
            check_inside(path, found[k], k, self._allow_external)
            shape, dtype, _, _ = read_npy_header(found[k], k)
            if len(shape) == 0:
                raise InvalidStoreError(
                    f"{found[k]}: leaf {k!r} is a scalar; every leaf needs a records axis. Fix: "
                    "select other leaves with keys=[...]."
                )
            spec[k] = layout_lib.LeafSpec(dtype, shape[1:])
            lengths[k] = shape[0]
        n = layout_lib.common_length(path, lengths)
        return Layout(n, spec, tree_lib.treedef_from_keys(keys), {k: found[k] for k in keys})


def _find_npy_files(root: str, allow_external: bool) -> dict[str, str]:
    out: dict[str, str] = {}
    # Symlinked directories are followed (and checked) only when external files
    # are allowed, which also keeps a symlink cycle from walking forever.
    for dirpath, dirnames, filenames in os.walk(root, followlinks=allow_external):
        dirnames[:] = sorted(d for d in dirnames if not d.endswith(".partial"))
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                check_inside(root, os.path.join(dirpath, d), d, allow_external)
        for name in filenames:
            if name.endswith(".npy"):
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)[: -len(".npy")]
                out[rel.replace(os.sep, "/")] = full
    return out
