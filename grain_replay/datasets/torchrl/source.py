"""torchrl buffer dumps as a source: each ``.memmap`` tensor mapped read-only, oldest row first."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.datasets.torchrl.dump import TorchRLDump, find_storage_dir, read_dump
from grain_replay.datasets.torchrl.h5 import H5Checkpoint, find_h5, read_h5
from grain_replay.datasets.torchrl.h5_readers import H5Handle
from grain_replay.errors import InvalidStoreError
from grain_replay.sources.base import Layout, ReplaySource, check_out
from grain_replay.sources.reading.files import MappedFile, check_inside
from grain_replay.sources.reading.readers import ArrayReader, Handle, read_windows_as_rows
from grain_replay.store import layout as layout_lib

__all__ = ["TorchRLDataSource"]


class _TorchRLHandle(Handle):
    def __init__(self, source: TorchRLDataSource, dump: TorchRLDump):
        n = len(source)
        self.readers = {}
        self.mapped_files = {}
        for key in source._keys:
            leaf = dump.leaves[key]
            spec = source._layout.spec[key]
            shape = (n, *spec.shape)
            nbytes = math.prod(shape) * spec.dtype.itemsize
            if nbytes == 0:
                array = np.zeros(shape, spec.dtype)
            else:
                mapping = _map(leaf.file, key, nbytes)
                array = np.ndarray(shape, spec.dtype, buffer=mapping)
                self.mapped_files[key] = [MappedFile(leaf.file, nbytes, mapping=mapping)]
            self.readers[key] = ArrayReader(array)


def _map(path: str, key: str, needed: int) -> mmap.mmap:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < needed:
            raise InvalidStoreError(
                f"{path}: leaf {key!r} needs {needed:,} bytes but the file holds {size:,}: it "
                "is truncated. Fix: dump the buffer again with ReplayBuffer.dumps(path)."
            )
        mapping = mmap.mmap(f.fileno(), needed, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_RANDOM)
    return mapping


class TorchRLDataSource(ReplaySource):
    """Random-access grain source over a torchrl replay buffer dump, read without torch.

    ``path`` is the directory given to ``ReplayBuffer.dumps(path)`` (or its
    ``storage/``, which ``TensorStorage.dumps`` / ``LazyMemmapStorage`` write):
    ``meta.json`` per TensorDict and one ``.memmap`` file per tensor, or the
    tensors a pytree storage lists in ``storage_metadata.json``. Each tensor is
    memory-mapped read-only; nested TensorDict keys are leaves such as
    ``next/reward``. Only the filled rows (``len`` in
    ``storage_metadata.json``) are records.

    Record order: the order the rows were written, oldest first. While the
    buffer has not wrapped that is the storage's row order; once a round-robin
    writer has wrapped (``writer/metadata.json`` says more rows were written than
    the capacity), record 0 is the storage row at the writer's cursor (the
    oldest) and the last record the newest, so episodes stay contiguous except
    where the oldest one was overwritten. Dumps without a round-robin writer keep
    the storage order.

    A dump by ``H5StorageCheckpointer`` (``checkpoint.h5`` in ``path`` or its
    ``storage/``, or ``path`` the ``.h5`` file itself) is read in place too: records
    are the steps of its ``traj_*`` groups, oldest first, with the leaves torchrl's
    ``ReplayBuffer.loads`` restores (see ``datasets/torchrl/h5.py``).

    Torch dtypes map to numpy's (``torch.bfloat16`` and the float8 types through
    ``ml_dtypes``); storages with ``ndim > 1``, jagged tensors and unknown dtypes
    are refused with the leaf named; non-tensor data and ``prefetch.pkl`` are
    never read (nothing is unpickled).

    Args:
      path: the dump directory.
      keys: leaves (or groups) to read; default all.

    Examples:
      >>> rb.dumps("/ckpt/rb")                      # in the torchrl job
      >>> src = gr.TorchRLDataSource("/ckpt/rb")    # anywhere, without torch
      >>> src.read_batch([0, 1])["next"]["reward"].shape
    """

    _dump: TorchRLDump | H5Checkpoint

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        *,
        allow_external: bool = False,
    ):
        super().__init__(path, keys, allow_external=allow_external)

    def _open(self) -> Handle:
        if isinstance(self._dump, H5Checkpoint):
            return H5Handle(self._dump, self._keys)
        return _TorchRLHandle(self, self._dump)

    # -- records oldest first: record i is storage row (i + start) % N, once per batch ---------

    def _rows(self, records: np.ndarray) -> np.ndarray:
        start = self._dump.start
        if not start:
            return records
        # Two array operations a batch (add, remainder): records are in [0, N).
        rows = records + start
        np.remainder(rows, len(self), out=rows)
        return rows

    def __getitem__(self, index: int) -> Any:
        i = self._check_index(index)
        return super().__getitem__((i + self._dump.start) % len(self))

    def read_leaf(self, key: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return super().read_leaf(key, self._rows(self._check_indices(indices)))

    def read_windows(
        self, key: str, starts: Sequence[int] | np.ndarray, length: int, *, check: bool = True
    ) -> np.ndarray:
        # Records wrap around the ring's start: a window is not consecutive rows.
        return read_windows_as_rows(self.read_leaf, key, starts, length)

    def read_flat(
        self, indices: Sequence[int] | np.ndarray, *, check: bool = True
    ) -> dict[str, np.ndarray]:
        idx = self._check_indices(indices) if check else np.asarray(indices, dtype=np.int64)
        start = self._dump.start
        if not start:
            return self._take_flat(idx)
        # One subtraction a batch: records from the oldest row to the end are negative rows
        # counted from the end, the rest rows from 0 (see Handle.take_flat).
        n = len(self)
        return self._take_flat(idx - (n - start), n)

    def read_into(
        self,
        indices: Sequence[int] | np.ndarray,
        out: Mapping[str, np.ndarray],
        *,
        check: bool = True,
    ) -> None:
        if check:
            idx = self._check_indices(indices)
            check_out(out, self._layout.spec, len(idx), self._path)
        else:
            idx = np.asarray(indices, dtype=np.int64)
        super().read_into(self._rows(idx), out, check=False)

    def _inspect(self) -> Layout:
        h5 = find_h5(self._path) if find_storage_dir(self._path) is None else None
        dump: TorchRLDump | H5Checkpoint = read_dump(self._path) if h5 is None else read_h5(h5)
        if not dump.leaves:
            raise InvalidStoreError(
                f"{self._path}: the torchrl dump holds no tensor. Fix: extend the buffer "
                "before dumping it."
            )
        keys = layout_lib.foreign_keys(dump.leaves, self._requested_keys)
        for k in keys:
            if dump.leaves[k].problem is not None:
                raise InvalidStoreError(dump.leaves[k].problem)
            if isinstance(dump, TorchRLDump):
                check_inside(self._path, dump.leaves[k].file, k, self._allow_external)
        if isinstance(dump, TorchRLDump):
            shapes = {k: dump.leaves[k].shape[1:] for k in keys}
            where = {k: dump.leaves[k].file for k in keys}
        else:
            shapes = {k: dump.leaves[k].shape for k in keys}
            where = {k: f"{dump.file}:traj_*/{dump.leaves[k].dataset}" for k in keys}
        spec = {k: layout_lib.LeafSpec(dump.leaves[k].dtype, shapes[k]) for k in keys}
        treedef = tree_lib.treedef_from_keys(keys)
        ordered = tree_lib.leaf_keys(treedef)
        self._dump = dump
        return Layout(
            dump.length,
            {k: spec[k] for k in ordered},
            treedef,
            {k: where[k] for k in ordered},
        )
