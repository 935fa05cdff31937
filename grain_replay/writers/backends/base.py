"""The backend of a growing store: what every format's storage does (see
:mod:`grain_replay.writers.backends` for the formats and the commit invariant)."""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from grain_replay.store import layout as layout_lib
from grain_replay.writers.write_errors import LeafWriteError

__all__ = ["APPEND_CHUNK_BYTES", "Backend", "chunk_rows_within", "write_by_leaf"]

APPEND_CHUNK_BYTES = 1 << 20


def chunk_rows_within(rows: int, limit: int | None) -> int:
    """Rows per chunk of a store that never holds more than ``limit`` rows (a writer
    part's segment; None: it grows without bound, ``rows`` as they are).

    No chunk is larger than the store: ``limit`` rows split evenly into
    ``k = ceil(limit / rows)`` chunks of ``ceil(limit / k)`` rows (at most ``rows``),
    so the ``k`` chunks pass the ``limit`` rows by fewer than ``k`` rows.
    """
    if limit is None:
        return rows
    k = -(-limit // max(1, rows))
    return -(-limit // k)


class Backend(abc.ABC):
    """Storage for one growing store. ``meta`` holds the committed N and the leaves."""

    # The most rows this store will hold (a writer part's segment), or None: the
    # backend allocates nothing past them.
    max_rows: int | None = None

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
        max_rows: int | None = None,
    ) -> Backend:
        """Creates an empty store (N = 0) atomically (durably unless ``sync=False``) and
        returns it opened for appending, without re-reading what was just written where
        the backend can keep it open. ``max_rows``: the most rows it will ever hold (a
        writer part's segment): its chunks are no larger (:func:`chunk_rows_within`)
        and nothing is allocated past them."""

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
        return layout_lib.StoreMetadata(n, m.leaves, m.treedef, checksums, m.version, m.store_id)


def write_by_leaf(backend: Backend, arrays: dict[str, np.ndarray], start: int) -> None:
    """``backend.write`` one leaf at a time; a failure is raised as a
    :class:`~grain_replay.writers.write_errors.LeafWriteError` naming the leaf."""
    for key, arr in arrays.items():
        try:
            backend.write({key: arr}, start)
        except Exception as e:
            raise LeafWriteError(key) from e
