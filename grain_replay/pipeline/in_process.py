"""The worker_count=0 iterator of make_data_loader: grain's checkpoints, not its per-batch work."""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import GrainReplayError
from grain_replay.pipeline import shutdown
from grain_replay.pipeline.grain_iterator import GrainStateIterator
from grain_replay.pipeline.lanes import ROW_BYTES, LaneBuffer, lane_fields, lane_views, padded
from grain_replay.pipeline.state import LoaderIdentity

__all__ = ["InProcessLoaderIterator"]


class InProcessLoaderIterator(GrainStateIterator):
    """Reads global batches in this process, optionally ahead on a small thread pool.

    A ``grain.DataLoader`` with ``worker_count=0`` wraps every element in a record,
    a sampler lookup, stats timers and a 16-thread prefetch pool: about 200 us per
    element, three times the read of a page-cached batch of transitions. This
    iterator yields the same elements in the same order and reads and writes the
    same ``get_state`` bytes (so a checkpoint moves freely between the two), but
    an element costs one ``BatchedReads`` lookup plus the ``grain.transforms.Map``
    operations. ``num_threads`` threads keep up to ``buffer_size`` batches in
    flight; either being 0 reads synchronously inside ``next()``.

    Element ``k`` of this process is global batch ``k * shard_count + shard_index``,
    as grain's sampler dataset shards it; the state counts only batches handed out.
    """

    def __init__(
        self,
        identity: LoaderIdentity,
        read: Callable[[int], Any],
        *,
        length: int,
        maps: Sequence[Any] = (),
        num_threads: int = 0,
        buffer_size: int = 0,
        read_into: Callable[[int, dict[str, np.ndarray]], bool] | None = None,
    ) -> None:
        if identity.worker_count != 0:
            raise ValueError(f"worker_count must be 0, got {identity.worker_count}")
        super().__init__(identity, length=length)
        self._read = read
        self._maps = tuple(maps)
        self._num_threads = num_threads
        self._buffer_size = buffer_size if num_threads > 0 else 0
        self._pending: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
        self._pool: concurrent.futures.Executor | None = None
        self._read_into = read_into if not self._maps else None
        self._lanes = False
        # (treedef, leaf key -> (dtype, shape), their lane fields and rows) of the first
        # batch read once lanes were asked for
        self._lane_layout: tuple[Any, dict[str, Any], Any] | None = None

    def lay_out_lanes(self) -> None:
        """From now on, read each batch (after the first) straight into one buffer laid
        out as a packed transfer's (``pipeline/lanes.py``), where the source can read into
        arrays and no leaf's rows would be padded: ``sharded_device_put`` then puts that
        buffer as it is. Other batches are handed out as read."""
        self._lanes = self._read_into is not None

    def _element(self, k: int) -> Any:
        index = k * self._shard_count + self._shard_index
        laid = self._lane_layout
        if laid is not None and self._lanes:
            assert self._read_into is not None
            treedef, leaves, fields = laid
            buf = np.empty(fields[1] * ROW_BYTES, np.uint8).view(LaneBuffer)
            out = lane_views(buf, leaves, fields)
            del buf  # its views hold it
            if self._read_into(index, out):
                return tree_lib.unflatten(treedef, out)
        data = self._read(index)
        for op in self._maps:
            data = op.map(data)
        if self._lanes and laid is None:
            self._learn_lanes(data)
        return data

    def _learn_lanes(self, batch: Any) -> None:
        """Keeps ``batch``'s layout for the next reads, if it has plain array leaves and none
        whose rows the lanes would pad (a gather into padded rows is slower than the copy it
        saves); else reads stay as they are."""
        try:
            flat, treedef = tree_lib.flatten(batch)
        except GrainReplayError:  # not a tree of the package's kind: read as it is
            self._lanes = False
            return
        if not all(
            type(a) is np.ndarray and a.ndim and not a.dtype.hasobject for a in flat.values()
        ):
            self._lanes = False
            return
        leaves = {key: (a.dtype, a.shape) for key, a in flat.items()}
        if padded(list(leaves.values())):
            self._lanes = False
            return
        self._lane_layout = (treedef, leaves, lane_fields(list(leaves.values())))

    def _fill(self) -> None:
        if self._pool is None:
            self._pool = shutdown.thread_pool(self._num_threads, "grain_replay_read")
        k = self._next_index + len(self._pending)
        while len(self._pending) < self._buffer_size and k < self._length:
            # Refused (at interpreter exit, iterated by a non-daemon thread): read here.
            self._pending.append(shutdown.submit(self._pool, self._element, k))
            k += 1

    def _drop_pending(self) -> None:
        # Reads are pure: one already running finishes and is thrown away.
        while self._pending:
            self._pending.pop().cancel()

    def __next__(self) -> Any:
        if self._buffer_size == 0:
            if self._next_index >= self._length:
                raise StopIteration
            data = self._element(self._next_index)
        else:
            self._fill()
            if not self._pending:
                raise StopIteration
            try:
                data = self._pending.popleft().result()
            except BaseException:
                # Not handed out: the next call reads this batch again.
                self._drop_pending()
                raise
        self._next_index += 1
        return data

    def _seek(self) -> None:
        self._drop_pending()

    def start_prefetch(self) -> None:
        """Starts reading the next batches in the background (no-op when synchronous)."""
        if self._buffer_size:
            self._fill()

    def close(self) -> None:
        """Drops batches read ahead and stops the read threads."""
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
