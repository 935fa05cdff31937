"""Zarr v3 data source: chunk-grouped batch reads, chunks fetched concurrently and cached."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import remote as remote_lib
from grain_replay import tree as tree_lib
from grain_replay.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidStoreError,
    StoreNotFoundError,
)
from grain_replay.pipeline import shutdown
from grain_replay.remote import RetryOptions
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES
from grain_replay.sources.reading.readers import Handle
from grain_replay.sources.zarr import checks as zarr_checks
from grain_replay.sources.zarr import remote as zarr_remote
from grain_replay.sources.zarr.handle import ZarrHandle, ZarrOpening, lookup, open_local
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import (
    import_zarr,
    is_url,
    metadata_from_attrs,
    shown_path,
    store_not_found,
)

__all__ = ["ZarrDataSource"]


def _metadata_locations(group: Any, where: str) -> list[str]:
    """Array paths named by grain_replay's metadata (none for a foreign group)."""
    meta = metadata_from_attrs(group.attrs, where)
    return [] if meta is None else [layout_lib.disk_name(k) for k in meta.leaves]


class ZarrDataSource(ReplaySource):
    """Random-access grain source over a Zarr v3 group (local path or fsspec URL).

    A batch read groups the requested rows by chunk, fetches the needed chunks
    concurrently, decodes each once and keeps decoded chunks in a bounded
    cache. For an URL, the chunks of every leaf of a batch are fetched
    together (at most ``max_concurrency`` requests in flight, one GET per
    chunk), and transient failures (5xx, connection reset, timeouts) are
    retried with exponential backoff.

    Args:
      path: the group's directory, or an URL such as ``s3://bucket/replay.zarr``.
      keys: leaves (or groups) to read; default all.
      storage_options: fsspec options for URLs, e.g. ``{"key": ..., "secret": ...,
        "client_kwargs": {"endpoint_url": ...}}`` for S3. They travel with the
        source when it is pickled (into grain's workers) but never appear in
        ``repr`` or in error messages.
      cache_bytes: bound of the decoded-chunk cache per process.
      retries: retries of a failed remote request (an int, or ``RetryOptions``
        for the backoff too); 0 fails at once.
      max_concurrency: remote requests in flight per process.
      allow_external: follow symlinks (array folders, chunk files) that lead
        out of a local store; refused by default, since a store from elsewhere
        could read any file on the machine this way.

    Raises:
      StoreNotFoundError: no group at ``path`` (for S3, says whether the bucket
        or the key is missing).
      UnfinishedWriteError: nothing is at a local ``path`` but the ``.partial``
        of a write of it that never finished.
      InvalidStoreError: not a readable Zarr group, or one whose files lie
        (array metadata that disagrees with grain_replay's, chunk files of the
        wrong size, FIFOs, symlinks out of the store); for URLs also missing or
        refused credentials and an unreachable endpoint, naming the
        ``storage_options`` key to fix.

    Examples:
      >>> src = gr.ZarrDataSource("replay.zarr")
      >>> len(src), src.spec["obs"].shape
      >>> s3 = gr.ZarrDataSource("s3://bucket/replay.zarr", storage_options={"anon": True})
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {**ReplaySource._PER_PROCESS, "_opened": None}

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        *,
        storage_options: Mapping[str, Any] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        retries: int | RetryOptions = 3,
        max_concurrency: int = remote_lib.DEFAULT_CONCURRENCY,
        allow_external: bool = False,
    ):
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int):
            raise ArgumentTypeError(
                f"max_concurrency must be an int, got {type(max_concurrency).__name__}"
            )
        if max_concurrency < 1:
            raise InvalidArgumentError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._cache_bytes = cache_bytes
        self._retry = remote_lib.retry_options(retries)
        self._max_concurrency = max_concurrency
        # (pid, group, arrays) opened by _inspect, handed to the first handle of
        # that process so that it does not fetch the same metadata again.
        self._opened: tuple[int, Any, dict[str, Any]] | None = None
        super().__init__(path, keys, storage_options=storage_options, allow_external=allow_external)

    def _take_opened(self) -> tuple[Any, dict[str, Any]] | None:
        """The group and arrays ``_inspect`` opened in this process, once (saves their GETs)."""
        opened, self._opened = self._opened, None
        if opened is None or opened[0] != os.getpid():
            return None
        return opened[1], opened[2]

    def _new_remote(self) -> remote_lib.Remote:
        return remote_lib.Remote(self._path, self._storage_options, self._retry, kind="Zarr group")

    def _open(self) -> Handle:
        remote = self._new_remote() if is_url(self._path) else None
        return ZarrHandle(
            ZarrOpening(
                self._path, self._layout, self._cache_bytes, self._allow_external,
                self._storage_options, self._max_concurrency, remote,
                None if remote is None else self._take_opened(),
            )
        )  # fmt: skip

    # -- reads: every leaf of a remote batch at once ---------------------------

    def read_flat(
        self, indices: Sequence[int] | np.ndarray, *, check: bool = True
    ) -> dict[str, np.ndarray]:
        """Like :meth:`read_batch` but returns ``{key: array}`` instead of the tree."""
        handle = self._get_handle()
        pool = getattr(handle, "pool", None)
        if pool is None:
            return super().read_flat(indices, check=check)
        idx = self._check_indices(indices) if check else np.asarray(indices)
        readers = handle.readers
        # A leaf the pool refuses (at interpreter exit, or shut by a refresh's close()
        # in another thread) is read here.
        futures = [shutdown.submit(pool, readers[k].take, idx) for k in self._keys]
        return {k: f.result() for k, f in zip(self._keys, futures)}

    def __getitem__(self, index: int) -> Any:
        """Record ``index`` (negative counts from the end) as a tree of numpy arrays."""
        if not is_url(self._path):
            return super().__getitem__(index)
        i = self._check_index(index)
        flat = self.read_flat(np.array([i], dtype=np.int64))
        return self._build({k: v[0] for k, v in flat.items()})

    # -- layout -----------------------------------------------------------------

    def _inspect(self) -> Layout:
        if is_url(self._path):
            remote = self._new_remote()
            group = zarr_remote.open_remote_group(
                self._path, self._storage_options, remote, self._max_concurrency
            )

            def layout() -> Layout:
                locations = _metadata_locations(group, remote.shown)
                arrays = zarr_remote.fetch_arrays(group, locations) if locations else {}
                full = self._layout_of(group, arrays)
                self._opened = (os.getpid(), group, arrays) if locations else None
                return full

            return remote.call(layout, "the Zarr metadata")
        if not os.path.isdir(self._path):
            raise store_not_found(
                self._path,
                f"No Zarr store at {self._path}. Fix: check the path, or write one with "
                "gr.write_zarr(path, tree).",
            )
        import_zarr()
        # A FIFO as zarr.json would block zarr's open forever.
        zarr_checks.check_node(self._path, self._path, None, self._allow_external)
        try:
            group = open_local(self._path)
        except FileNotFoundError as e:
            raise StoreNotFoundError(f"No Zarr group at {shown_path(self._path)} ({e}).") from e
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise InvalidStoreError(
                f"{self._path}: zarr cannot open the group ({type(e).__name__}: {e}). Fix: pass "
                "the root of a Zarr v3 group."
            ) from e
        return self._layout_of(group)

    def _layout_of(self, group: Any, arrays: Mapping[str, Any] | None = None) -> Layout:
        zarr = import_zarr()
        meta = metadata_from_attrs(group.attrs, self._path)
        if meta is not None:
            locations = {k: layout_lib.disk_name(k) for k in meta.leaves}
            for key, loc in locations.items():
                where = self._array_metadata_file(loc)
                try:
                    if arrays is None:
                        folder = os.path.join(self._path, loc)
                        zarr_checks.check_node(self._path, folder, key, self._allow_external)
                    arr = group[loc] if arrays is None else lookup(arrays, loc)
                except KeyError as e:
                    raise InvalidStoreError(
                        f"{self._path}: leaf {key!r} is listed in the metadata but array "
                        f"{loc!r} is missing. The store is corrupt; re-create it."
                    ) from e
                except (ValueError, TypeError, OSError) as e:
                    if isinstance(e, InvalidStoreError):
                        raise
                    raise InvalidStoreError(
                        f"{where}: the array metadata of leaf {key!r} cannot be read "
                        f"({type(e).__name__}: {e}). The store is corrupt; re-create it."
                    ) from e
                want = meta.leaves[key]
                if arr.shape[0] < meta.num_records or tuple(arr.shape[1:]) != want.shape:
                    raise InvalidStoreError(
                        f"{self._path}: leaf {key!r} has shape {arr.shape} but the metadata "
                        f"says ({meta.num_records}, ...{list(want.shape)}). Re-create the store."
                    )
                zarr_checks.check_array(arr, key, want.dtype, where, self._cache_bytes)
            return Layout.of_store(meta, locations)
        if not is_url(self._path):
            zarr_checks.check_foreign_tree(self._path, self._allow_external)
        try:
            found = {
                name: arr
                for name, arr in group.members(max_depth=None)
                if isinstance(arr, zarr.Array) and arr.ndim > 0
            }
        except (ValueError, TypeError, OSError) as e:
            if isinstance(e, InvalidStoreError):
                raise
            raise InvalidStoreError(
                f"{self._path}: the metadata (zarr.json) of a node below the group cannot be "
                f"read ({type(e).__name__}: {e}). The store is corrupt; re-create it."
            ) from e
        if not found:
            raise InvalidStoreError(
                f"{self._path}: the group holds no array with a records axis. Fix: write one "
                "with gr.write_zarr(path, tree)."
            )
        keys = layout_lib.foreign_keys(found, self._requested_keys)
        spec = {}
        for k in keys:
            dtype = layout_lib.check_dtype(np.dtype(found[k].dtype), k, self._path)
            where = self._array_metadata_file(k)
            zarr_checks.check_array(found[k], k, None, where, self._cache_bytes)
            spec[k] = layout_lib.LeafSpec(dtype, tuple(found[k].shape[1:]))
        n = layout_lib.common_length(self._path, {k: found[k].shape[0] for k in keys})
        return Layout(n, spec, tree_lib.treedef_from_keys(keys), {k: k for k in keys})

    def _array_metadata_file(self, loc: str) -> str:
        """The array's zarr.json, as errors name it."""
        if is_url(self._path):
            return f"{self._path.rstrip('/')}/{loc}/zarr.json"
        return os.path.join(self._path, loc, "zarr.json")
