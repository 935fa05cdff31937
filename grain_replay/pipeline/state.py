"""grain.DataLoader checkpoint bytes, and the base of grain_replay's own loader iterators."""

from __future__ import annotations

import json
from typing import Any, Self

import grain

__all__ = [
    "GrainStateIterator",
    "handed_out_by_worker",
    "handed_out_from_state",
    "loader_state_bytes",
]


def handed_out_by_worker(j: int, worker: int, workers: int) -> int:
    """How many of the first ``j`` elements are worker ``worker``'s (element i is i % workers's)."""
    return max(0, -(-(j - worker) // workers))


def _last_seen(j: int, worker: int, workers: int, shard_index: int, shard_count: int) -> int:
    """The global index grain records as worker ``worker``'s last element after ``j`` elements."""
    if workers == 0:
        return shard_index + (j - 1) * shard_count
    span = workers * shard_count
    seen = handed_out_by_worker(j, worker, workers)
    return shard_index - span + worker * shard_count + seen * span


def loader_state_bytes(
    loader: Any, handed_out: int, worker_count: int, shard_index: int, shard_count: int
) -> bytes:
    """What ``get_state()`` of grain's own iterator of ``loader`` returns after ``handed_out``.

    grain assigns element ``j`` of a process to worker ``j % worker_count`` and
    writes ``json.dumps(state, indent=4)``; its pure-Python indenting encoder costs
    ~30 us, paid on every batch under ``sharded_device_put``, so the same bytes are
    spelled out here (tests pin them against grain's).
    """
    slots = max(worker_count, 1)
    seen = ",\n".join(
        f'        "{w}": {_last_seen(handed_out, w, worker_count, shard_index, shard_count)}'
        for w in range(slots)
    )
    last_worker = handed_out % worker_count - 1 if worker_count else -1
    sampler = json.dumps(repr(loader._sampler))
    source = json.dumps(repr(loader._data_source))
    return (
        f'{{\n    "version": 2,\n    "last_seen_indices": {{\n{seen}\n    }},\n'
        f'    "last_worker_index": {last_worker},\n    "worker_count": {worker_count},\n'
        f'    "sampler": {sampler},\n    "data_source": {source}\n}}'
    ).encode()


def handed_out_from_state(
    loader: Any, state: bytes, worker_count: int, shard_index: int, shard_count: int
) -> int:
    """The number of elements handed out when ``state`` was taken (grain's own checks first).

    Raises:
      ValueError: ``state`` was saved with another worker count, sampler or source.
    """
    decoded = json.loads(state.decode())
    loader._validate_state(decoded)  # grain's own messages
    seen = decoded["last_seen_indices"]
    if worker_count == 0:
        return int((seen["0"] + shard_count - shard_index) // shard_count)
    span = worker_count * shard_count
    return sum(
        int((seen[str(w)] + span - shard_index - w * shard_count) // span)
        for w in range(worker_count)
    )


class GrainStateIterator(grain.DataLoaderIterator):
    """A ``grain.DataLoaderIterator`` of a loader's elements that keeps grain's state bytes.

    ``grain.DataLoaderIterator.__init__`` would build grain's own pipeline, which a
    subclass replaces; this sets the attributes grain's other methods use. Element
    ``j`` of this process is global element ``j * shard_count + shard_index`` (as
    grain's sampler dataset shards it); the state counts only elements handed out.
    """

    def __init__(
        self,
        data_loader: grain.DataLoader,
        *,
        length: int,
        shard_index: int,
        shard_count: int,
        worker_count: int,
    ) -> None:
        self._data_loader = data_loader
        self._validate_state = True
        self._length = length
        self._shard_index = shard_index
        self._shard_count = shard_count
        self._worker_count = worker_count
        self._next_index = 0

    def get_state(self) -> bytes:
        """The state of grain's iterator of the same loader after the same elements."""
        return loader_state_bytes(
            self._data_loader,
            self._next_index,
            self._worker_count,
            self._shard_index,
            self._shard_count,
        )

    def set_state(self, state: bytes) -> None:
        """Resumes right after the last element handed out when ``state`` was taken.

        Args:
          state: bytes from ``get_state`` of this iterator or of grain's iterator of
            the same loader (same ``worker_count``, sampler and source).

        Raises:
          ValueError: ``state`` was saved with another worker count, sampler or source.
        """
        self._next_index = handed_out_from_state(
            self._data_loader, state, self._worker_count, self._shard_index, self._shard_count
        )
        self._seek()

    def seek(self, position: int) -> None:
        """Resumes at element ``position`` of this process (0: the first)."""
        self._next_index = int(position)
        self._seek()

    def _seek(self) -> None:
        """Drops what was read ahead of ``_next_index``."""

    def close(self) -> None:
        """Stops reading ahead; the position is kept."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
