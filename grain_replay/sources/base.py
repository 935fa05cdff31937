"""A store as a source: its layout, keys=, the per-process handle, refresh, batch reads."""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import (
    GrainReplayError,
    InvalidStoreError,
    StoreNotFoundError,
    UnknownLeafError,
)
from grain_replay.sources.checks import (
    as_record_index,
    check_indices,
    check_out,
    record_in_range,
)
from grain_replay.sources.keys import Layout, select_keys
from grain_replay.sources.reading.readers import Handle
from grain_replay.sources.surface import BatchSource, SourceSurface, current_pid
from grain_replay.sources.window_reads import STORE_READ_FAULTS, WindowReads
from grain_replay.store.formats import STORE_FAULTS, damaged_store, is_url
from grain_replay.store.layout import LeafSpec

__all__ = [
    "BatchSource",
    "Layout",
    "ReplaySource",
    "SourceSurface",
    "as_record_index",
    "check_indices",
    "check_out",
    "select_keys",
]


class ReplaySource(WindowReads, SourceSurface):
    """A grain ``RandomAccessDataSource`` over a replay store (structurally typed).

    Subclasses implement :meth:`_inspect` (read the layout once, in the
    constructing process) and :meth:`_open` (open a handle, once per process).
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {"_handle": None, "_pid": None, "_opens": 0}
    # Whether the layout _flat_for has a flat-dict tree (see read_batch).
    _flat_for: Layout | None = None
    _flat_tree = False

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        allow_external: bool = False,
    ):
        path = os.fspath(path)
        self._path = path if is_url(path) else os.path.abspath(path)
        self._storage_options = dict(storage_options or {})
        self._allow_external = bool(allow_external)
        self._requested_keys = (
            None if keys is None else [keys] if isinstance(keys, str) else list(keys)
        )
        self._lock = threading.Lock()
        self._handle: Handle | None = None
        self._pid: int | None = None
        self._opens = 0
        self._set_layout(self._inspect_named())

    # -- subclass hooks -------------------------------------------------------

    @abc.abstractmethod
    def _inspect(self) -> Layout:
        """Reads the full layout of the store (every leaf)."""

    @abc.abstractmethod
    def _open(self) -> Handle:
        """Opens the store for reading the selected leaves (``self._layout``)."""

    # -- layout ---------------------------------------------------------------

    def _inspect_named(self) -> Layout:
        """:meth:`_inspect`, a format library's failure on damaged bytes as a named error."""
        try:
            return self._inspect()
        except GrainReplayError:
            raise
        except FileNotFoundError as e:  # a file of the store gone: still a FileNotFoundError
            raise StoreNotFoundError(f"{self._path}: a file of the store is missing ({e}).") from e
        except STORE_FAULTS as e:
            raise damaged_store(self._path, e, doing="reading the metadata") from e

    def _set_layout(self, full: Layout) -> None:
        self._layout = select_keys(full, self._requested_keys, self._path)
        self._keys = list(self._layout.spec)
        self._build = tree_lib.compile_unflatten(self._layout.treedef)

    def refresh(self) -> int:
        """Re-reads the store's metadata to see rows committed since; returns the new length.

        An open handle of this process is extended in place when the store only
        grew and its format can (``.npy``: the new pages are mapped behind the
        old ones); otherwise it is closed and the next read reopens the store.
        """
        layout = select_keys(self._inspect_named(), self._requested_keys, self._path)
        grown = self._grow_handle(layout)
        # The handle holds the new rows before the length says so.
        self._set_layout(layout)
        if not grown:
            self.close()
        return len(self)

    def grow_in_place(self) -> bool:
        """Like :meth:`refresh` where this process's open handle grows in place to the
        rows committed since; where it cannot (or none is open), False and nothing
        changes: the handle stays open as it was.

        For a source that others read from too (a snapshot's segment, which the
        snapshot before it still reads): never closed under them, so a file unlinked
        since it was opened is never reopened.
        """
        layout = select_keys(self._inspect_named(), self._requested_keys, self._path)
        if not self._grow_handle(layout):
            return False
        self._set_layout(layout)
        return True

    def _grow_handle(self, layout: Layout) -> bool:
        """Extends this process's open handle to ``layout`` in place, if it can.

        Files that changed since :meth:`_inspect` looked (an evicting writer removed a
        leaf: zarr raises ``KeyError``, h5py ``OSError``) make the handle's grow raise:
        False then. A handle plans every leaf before it maps any, and what it maps
        of a leaf before failing holds the same committed rows: they read as before."""
        old = self._layout
        with self._lock:
            handle = self._handle if self._pid == current_pid() else None
            if handle is None or layout.num_records < old.num_records:
                return False
            if layout.spec != old.spec or layout.locations != old.locations:
                return False
            try:
                return handle.grow(self, layout)
            except Exception:  # the files changed under the handle's second look
                return False

    @property
    def path(self) -> str:
        return self._path

    @property
    def locations(self) -> Mapping[str, str]:
        """Leaf key -> where the store keeps it: its file, HDF5 dataset or Zarr array."""
        return dict(self._layout.locations)

    @property
    def spec(self) -> Mapping[str, LeafSpec]:
        """Leaf key -> per-record ``LeafSpec(dtype, shape)``, in tree order."""
        return dict(self._layout.spec)

    @property
    def treedef(self) -> dict[str, Any]:
        return self._layout.treedef

    @property
    def checksums(self) -> dict[str, Any] | None:
        """Per-leaf block CRC32s recorded by grain_replay's writers (None for foreign stores)."""
        return self._layout.checksums

    @property
    def store_id(self) -> str | None:
        """The id a grain_replay writer gave the store (read with its metadata at the last
        refresh): a replay checkpoint names the store by it, whatever its path. None for
        a foreign store, or one made before stores had ids."""
        return self._layout.store_id

    def __len__(self) -> int:
        return self._layout.num_records

    def __repr__(self) -> str:
        path = self._path
        if is_url(path):
            from grain_replay.remote import redact_url

            path = redact_url(path)
        return f"{type(self).__name__}(path={path!r}, keys={self._keys!r}, num_records={len(self)})"

    # -- per-process handle ---------------------------------------------------

    def _get_handle(self) -> Handle:
        return self._per_process("_handle", self._open_counted)

    def _open_counted(self) -> Handle:
        try:
            handle = self._open()
        except GrainReplayError:
            raise
        except STORE_READ_FAULTS as e:
            raise self._corrupt(None, e) from e
        self._opens += 1
        return handle

    def open(self) -> None:
        """Opens (maps) this process's handle now, so that a later unlink of the files
        does not affect reads until :meth:`close` or a reopening :meth:`refresh`."""
        if len(self):
            self._get_handle().check_mapped(self._keys)

    def close(self) -> None:
        """Releases the handle of this process; reading again reopens it."""
        with self._lock:
            handle, self._handle = self._handle, None
            if handle is not None and self._pid == current_pid():
                handle.close()
                handle.close_mapped()
            self._pid = None

    # -- reads ----------------------------------------------------------------

    def _check_indices(self, indices: Any) -> np.ndarray:
        return check_indices(indices, len(self), self._path)

    def _check_index(self, index: Any) -> int:
        """``index`` as a non-negative record number, or the TypeError / RecordIndexError."""
        return record_in_range(as_record_index(index, self), len(self), self._path)

    def __getitem__(self, index: int) -> Any:
        """Record ``index`` (negative counts from the end) as a tree of numpy arrays."""
        i = self._check_index(index)
        handle = self._get_handle()
        handle.check_mapped(self._keys)
        readers = handle.readers
        try:
            return self._build({k: readers[k].row(i) for k in self._keys})
        except GrainReplayError:
            raise
        except STORE_READ_FAULTS as e:
            raise self._corrupt(None, e) from e

    def read_leaf(self, key: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows ``indices`` of the single leaf ``key``."""
        if key not in self._layout.spec:
            raise UnknownLeafError(f"{self._path}: no leaf {key!r}; leaves: {self._keys}")
        idx = self._check_indices(indices)
        handle = self._get_handle()
        handle.check_mapped([key])
        try:
            return handle.readers[key].take(idx)
        except GrainReplayError:
            raise
        except STORE_READ_FAULTS as e:
            raise self._corrupt(key, e) from e

    def read_batch(self, indices: Sequence[int] | np.ndarray, *, check: bool = True) -> Any:
        """Reads records ``indices`` with one vectorized read per leaf.

        Args:
          indices: record indices in any order; duplicates and negative indices
            are allowed.
          check: False skips checking ``indices`` (about 2 us a batch), for a
            caller that drew them as int64 in ``[0, N)`` (the samplers do). An
            index out of range then raises numpy's ``IndexError``; no read ever
            leaves the store.

        Returns:
          The record tree with a leading batch axis of ``len(indices)``, rows in
          the order given.

        Raises:
          RecordIndexError: an index is outside ``[-N, N)``.
        """
        flat = self.read_flat(indices, check=check)
        layout = self._layout
        if self._flat_for is not layout:  # subclasses set layouts their own ways too
            # A tree that is one dict of the leaves, in key order: read_flat's dict is it.
            self._flat_tree = tree_lib.is_flat_dict(layout.treedef, self._keys)
            self._flat_for = layout
        return flat if self._flat_tree else self._build(flat)

    def read_flat(
        self, indices: Sequence[int] | np.ndarray, *, check: bool = True
    ) -> dict[str, np.ndarray]:
        """Like :meth:`read_batch` but returns ``{key: array}`` instead of the tree."""
        return self._take_flat(self._check_indices(indices) if check else np.asarray(indices))

    def _take_flat(self, rows: np.ndarray, wrap_at: int | None = None) -> dict[str, np.ndarray]:
        """Stored rows ``rows`` of every selected leaf, after one truncation check (see
        ``Handle.take_flat``; ``wrap_at``: rows of a ring, taken modulo its length)."""
        handle = self._get_handle()
        keys = self._keys
        handle.check_mapped(keys)
        try:
            return handle.take_flat(keys, rows, wrap_at=wrap_at)
        except GrainReplayError:
            raise
        except STORE_READ_FAULTS:
            pass  # read again leaf by leaf, to name the leaf that fails
        idx = rows if wrap_at is None else np.remainder(rows, max(wrap_at, 1))
        readers = handle.readers
        out = {}
        for k in keys:
            try:
                out[k] = readers[k].take(idx)
            except GrainReplayError:
                raise
            except STORE_READ_FAULTS as e:
                raise self._corrupt(k, e) from e
        return out

    def read_into(
        self,
        indices: Sequence[int] | np.ndarray,
        out: Mapping[str, np.ndarray],
        *,
        check: bool = True,
    ) -> None:
        """Reads records ``indices`` of the leaves named in ``out`` into those arrays.

        See :meth:`SourceSurface.read_into`; here each leaf is one gather
        straight into its array, with no intermediate copy. ``check=False``
        skips the checks of ``indices`` and ``out`` (about 3 us a batch) for a
        caller that drew int64 indices in ``[0, N)`` and allocated ``out`` from
        ``spec``, as a mixture does: an index out of range then reads a wrong
        row (clipped), never memory outside the store.
        """
        if check:
            idx = self._check_indices(indices)
            check_out(out, self._layout.spec, len(idx), self._path)
        else:
            idx = np.asarray(indices)
        handle = self._get_handle()
        handle.check_mapped(out)
        readers = handle.readers
        for k, dst in out.items():
            try:
                readers[k].take_into(idx, dst)
            except GrainReplayError:
                raise
            except STORE_READ_FAULTS as e:
                raise self._corrupt(k, e) from e

    def _corrupt(self, key: str | None, error: BaseException) -> InvalidStoreError:
        """A read that failed inside a format library, as an error naming file and leaf."""
        return damaged_store(self._path, error, leaf=key, doing="reading")
