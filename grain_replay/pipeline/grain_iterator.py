"""The base of grain_replay's own loader iterators: a ``grain.DataLoaderIterator`` by type.

Only the consuming process imports it (it imports grain); the state bytes it
reads and writes are :mod:`grain_replay.pipeline.state`'s, which workers share.
"""

from __future__ import annotations

import abc
from typing import Any, Self

import grain

from grain_replay.pipeline.state import (
    EncodedIdentity,
    LoaderIdentity,
    handed_out_from_state,
    load_text,
    loader_state_bytes,
    save_text,
)

__all__ = ["GrainStateIterator"]


class GrainStateIterator(grain.DataLoaderIterator):
    """A ``grain.DataLoaderIterator`` of a loader's elements that keeps grain's state bytes.

    A ``grain.DataLoader``'s iterator is a ``grain.DataLoaderIterator``, so this is
    one; but ``grain.DataLoaderIterator.__init__`` builds grain's own pipeline, so
    it is not called, and every method of the class is defined here (a test checks
    that none is inherited). Element ``j`` of this process is global element
    ``j * shard_count + shard_index`` (as grain's sampler dataset shards it); the
    state counts only elements handed out.
    """

    def __init__(self, identity: LoaderIdentity, *, length: int) -> None:
        # grain.DataLoaderIterator.__init__ is deliberately not called (see above).
        self._identity = identity
        self._encoded = EncodedIdentity(identity)
        self._length = length
        self._shard_index = identity.shard_index
        self._shard_count = identity.shard_count
        self._worker_count = identity.worker_count
        self._next_index = 0

    def __iter__(self) -> Self:
        return self

    @abc.abstractmethod
    def __next__(self) -> Any:
        """The next element; subclasses read it."""

    def get_state(self) -> bytes:
        """The state of grain's iterator of the same loader after the same elements."""
        return loader_state_bytes(self._identity, self._next_index, self._encoded)

    @property
    def position(self) -> int:
        """Elements of this process handed out (the count the state holds)."""
        return self._next_index

    def get_state_at(self, position: int) -> bytes:
        """The state right after element ``position`` of this process was handed out
        (``get_state()`` is ``get_state_at(position)``): a function of the position, so
        ``sharded_device_put`` reading ahead asks for it at a checkpoint only, instead of
        copying the state of every batch it reads."""
        return loader_state_bytes(self._identity, int(position), self._encoded)

    def set_state(self, state: bytes) -> None:
        """Resumes right after the last element handed out when ``state`` was taken.

        Args:
          state: bytes from ``get_state`` of this iterator or of grain's iterator of
            the same loader (same ``worker_count``, sampler and source), or of a
            loader of the same global stream on another number of processes.

        Raises:
          CheckpointMismatchError: (a ``ValueError``) ``state`` was saved with another
            worker count, sampler or source; nothing changes.
        """
        self._next_index = handed_out_from_state(self._identity, state)
        self._seek()

    def seek(self, position: int) -> None:
        """Resumes at element ``position`` of this process (0: the first)."""
        self._next_index = int(position)
        self._seek()

    def _seek(self) -> None:
        """Drops what was read ahead of ``_next_index``."""

    def start_prefetch(self) -> None:
        """Starts reading the next elements in the background (grain's restore calls it)."""

    async def save(self, directory: Any) -> Any:
        """Orbax's ``StatefulCheckpointable.save``: the state, as grain's iterator writes it.

        Args:
          directory: an Orbax ``PathAwaitingCreation``.

        Returns:
          A coroutine writing ``process_<i>-of-<n>.json`` once the directory exists.
        """
        return save_text(directory, self.get_state().decode())

    async def load(self, directory: Any) -> Any:
        """Orbax's ``StatefulCheckpointable.load``: reads what :meth:`save` wrote.

        A checkpoint saved on another number of processes resumes too (the state of
        process ``i mod m`` of the ``m`` that saved it: see :func:`handed_out_from_state`).

        Returns:
          A coroutine that sets the state.
        """

        async def read() -> None:
            self.set_state((await load_text(directory, elastic=True)).encode())

        return read()

    def __str__(self) -> str:
        return f"PyGrainDatasetIterator(state={self.get_state().decode()})"

    def close(self) -> None:
        """Stops reading ahead; the position is kept."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
