"""The iterator ``sharded_device_put`` returns: host batches converted to sharded
``jax.Array``s (prefetched in a background thread), its checkpoint state and priority updates
forwarded to the wrapped iterator, the row ids of a prioritized batch kept on the host."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self

import grain
import jax
import numpy as np

from grain_replay.device.converter import Converter
from grain_replay.device.inline_feed import InlineFeed
from grain_replay.device.prefetch import Prefetcher
from grain_replay.device.put_options import inline_feed, packed_default, pinned_if_available
from grain_replay.errors import InvalidPrefetchError, UnsupportedStateError
from grain_replay.pipeline.state import load_text, save_text
from grain_replay.sources.capabilities import (
    Checkpointable,
    HandsOverGroups,
    LaysOutLanes,
    Prefetches,
    PriorityUpdates,
    StateAt,
)
from grain_replay.store.parts import RowIds

__all__ = ["ShardedDevicePutIterator"]


def _local_rows(x: Any) -> np.ndarray:
    """``x`` as numpy; of a globally sharded jax.Array, this process's rows in order."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        shards = {s.index[0].indices(x.shape[0])[0]: s.data for s in x.addressable_shards}
        return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])
    return np.asarray(x)


def _put_row_ids_aside(batch: Any) -> tuple[Any, RowIds | None]:
    """The batch to put, and the row ids of a prioritized batch over a bounded or
    many-writer store (``index``, :class:`grain_replay.store.parts.RowIds`) to keep on the
    host, or None.

    They need 64 bits (``ordinal << 40 | seq``) and jax keeps 32 without
    ``jax_enable_x64``; the index only goes back to ``update_priorities``.
    """
    index = getattr(batch, "index", None)
    if isinstance(index, RowIds) and jax.dtypes.canonicalize_dtype(np.int64) != np.int64:
        # the tree as given (a pytree of shardings still matches), the ids put back after
        return batch._replace(index=np.asarray(index, dtype=np.int32)), index
    return batch, None


def _keep_row_ids(convert: Callable[[list[Any]], list[Any]]) -> Callable[[list[Any]], list[Any]]:
    """``convert`` (of a list of batches), the row ids kept on the host (see above)."""

    def put(batches: list[Any]) -> list[Any]:
        prepared = [_put_row_ids_aside(b) for b in batches]
        out = convert([b for b, _ in prepared])
        return [a if ids is None else a._replace(index=ids) for a, (_, ids) in zip(out, prepared)]

    return put


class ShardedDevicePutIterator(Iterator[Any]):
    """Iterator of sharded ``jax.Array`` batches; see :func:`sharded_device_put`.

    Over a ``grain.DatasetIterator`` (or a grain dataset) it is one too, so that
    grain's Orbax handler saves its (dict) state as it saves the wrapped iterator's.
    """

    def __new__(cls, batches: Iterable[Any], *args: Any, **kwargs: Any) -> Self:
        if cls is ShardedDevicePutIterator and isinstance(
            batches, (grain.DatasetIterator, grain.IterDataset, grain.MapDataset)
        ):
            cls = _DatasetShardedDevicePutIterator
        return super().__new__(cls)

    def __init__(
        self,
        batches: Iterable[Any],
        sharding: Any = None,
        *,
        prefetch: int = 2,
        pinned: bool = False,
        packed: bool | None = None,
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise InvalidPrefetchError(f"prefetch must be a non-negative int, got {prefetch!r}")
        self._prefetcher: Prefetcher | InlineFeed | None = None
        self._converter = Converter(
            sharding, pinned_if_available(pinned), packed_default(packed), packed is None
        )
        self._convert = _keep_row_ids(self._converter.convert_group)
        self._prefetch = prefetch
        inner: Any = batches if isinstance(batches, Iterator) else iter(batches)
        self._inner = inner
        # made here from a loader: nobody else holds it, so close() closes it too
        self._owns_inner = inner is not batches
        self._decided = False  # how batches move: worked out from the first one
        # (batches per transfer, transfers in flight), decided then; None: one at a time
        self._moves: tuple[int, int] | None = None
        self._stateful = isinstance(inner, Checkpointable)
        # An inner iterator that can give the state of an earlier position (a replay
        # iterator, whose state holds the priorities) is asked only at a checkpoint.
        self._state_at: Callable[[int], Any] | None = (
            inner.get_state_at if self._stateful and isinstance(inner, StateAt) else None
        )
        self._capture = self._stateful and self._state_at is None
        self._state = copy.deepcopy(inner.get_state()) if self._capture else None
        self._finished = False
        self._handed = getattr(inner, "position", 0)  # batches the caller received

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._prefetch == 0 or not self._decided:  # the first batch: read here, decide
            try:
                batch = next(self._inner)
                state = copy.deepcopy(self._inner.get_state()) if self._capture else None
                if not self._decided:
                    self._decide(batch)
                arrays = self._convert([batch])[0]
            except BaseException:
                self._finished = True
                raise
            self._state = state
            self._handed += 1
            return arrays
        if self._prefetcher is None:
            self._start()
        assert self._prefetcher is not None
        try:
            arrays, self._state = self._prefetcher.next()
        except BaseException:
            self._finished = True
            # The producer's failure or end stopped it; an interrupt in the wait (Ctrl-C)
            # did not: it is told to stop here, and set_state() or close() wait for it
            # before they touch the wrapped iterator.
            self._prefetcher.signal_stop()
            raise
        self._handed += 1
        return arrays

    def _decide(self, batch: Any) -> None:
        """How batches like the first one move (packed, grouped or leaf by leaf); then
        asks the loader to hand the batches of a transfer over together (``hand_over``)
        or, for packed transfers of one batch to one device, to lay batches out so
        (``Converter.asks_lanes``)."""
        self._decided = True
        # A prioritized stream stamps each priority update with the batches this wrapper
        # may have pulled ahead (``prefetch``): its batches are moved one at a time.
        if not isinstance(self._inner, PriorityUpdates):
            self._moves = self._converter.transfers(batch)
            if self._moves[0] > 1 and isinstance(self._inner, HandsOverGroups):
                # the loader's workers hand a transfer's batches over in one message
                self._inner.hand_over(self._moves[0])
        if self._converter.asks_lanes and isinstance(self._inner, LaysOutLanes):
            self._inner.lay_out_lanes()  # the loader lays batches out as the packed buffer

    def _start(self) -> None:
        # packed transfers read ahead in the caller's thread where that pays (TPU); leaf
        # by leaf puts of large batches keep the thread (measured: device/inline_feed.py)
        feed = InlineFeed if inline_feed() and self._converter.packs else Prefetcher
        args = (self._inner, self._convert, self._prefetch, self._capture, self._moves)
        self._prefetcher = feed(*args)

    def _halt(self, timeout: float | None = None) -> bool:
        """Stops the producer and drops what it prefetched; False if it is still inside
        the wrapped iterator (``timeout`` passed)."""
        stopped = True
        if self._prefetcher is not None:
            stopped = self._prefetcher.halt(timeout)
        self._prefetcher = None
        return stopped

    def get_state(self) -> Any:
        """Returns the wrapped iterator's state right after the last batch handed out.

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``get_state``/``set_state``.
        """
        self._require_state("get_state")
        if self._state_at is not None:
            return self._state_at(self._handed)
        return copy.deepcopy(self._state)

    def set_state(self, state: Any) -> None:
        """Resumes the stream right after the batch at which ``state`` was saved.

        Args:
            state: A value returned by :meth:`get_state` (or by the wrapped iterator).

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``get_state``/``set_state``.
        """
        self._require_state("set_state")
        self._halt()  # no timeout: the producer must be out of the wrapped iterator
        self._inner.set_state(copy.deepcopy(state))
        self._state = copy.deepcopy(state) if self._capture else None
        self._finished = False
        self._handed = getattr(self._inner, "position", 0)

    def update_priorities(self, index: Any, priorities: Any) -> None:
        """Forwards a priority update to the wrapped (prioritized replay) iterator.

        ``index`` and ``priorities`` may be numpy or jax arrays; a globally sharded
        array contributes this process's rows. The update is stamped with the batches
        handed to the caller plus ``prefetch`` (the batches this wrapper may have
        pulled ahead), so the draws stay a function of the updates, not of timing.

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``update_priorities``.
        """
        if not isinstance(self._inner, PriorityUpdates):
            raise UnsupportedStateError(
                f"Cannot call update_priorities(): the wrapped iterator "
                f"({type(self._inner).__name__}) does not sample with priorities. Wrap a "
                "loader made with sampling=gr.PrioritizedReplay()."
            )
        self._inner.update_priorities(
            _local_rows(index), _local_rows(priorities), handed_out=self._handed + self._prefetch
        )

    def _require_state(self, method: str) -> None:
        if not self._stateful:
            raise UnsupportedStateError(
                f"Cannot call {method}(): the wrapped iterator "
                f"({type(self._inner).__name__}) has no get_state/set_state. Wrap a grain "
                "DataLoader or DatasetIterator to checkpoint the stream."
            )

    async def save(self, directory: Any) -> Any:
        """Orbax's ``StatefulCheckpointable.save``: the wrapped iterator's state, as grain's.

        Args:
            directory: An Orbax ``PathAwaitingCreation``.

        Returns:
            A coroutine writing ``process_<i>-of-<n>.json`` once the directory exists.

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``get_state``/``set_state``.
        """
        state = self.get_state()
        text = state.decode() if isinstance(state, bytes) else json.dumps(state, indent=4)
        return save_text(directory, text)

    async def load(self, directory: Any) -> Any:
        """Orbax's ``StatefulCheckpointable.load``: reads what :meth:`save` wrote.

        Returns:
            A coroutine that sets the state and starts prefetching.

        Raises:
            UnsupportedStateError: The wrapped iterator has no ``get_state``/``set_state``.
        """
        self._require_state("load")
        # else a grain dataset's dict
        loader_state = isinstance(self._state, bytes) or (
            self._state_at is not None and not isinstance(self, grain.DatasetIterator)
        )

        async def read() -> None:
            text = await load_text(directory, elastic=loader_state)
            self.set_state(text.encode() if loader_state else json.loads(text))
            self.start_prefetch()

        return read()

    def start_prefetch(self) -> None:
        """Starts reading and transferring the next batches in the background.

        grain's Orbax handler calls it after restoring the state. With ``prefetch=0``, or
        before the first batch (which says how batches move, read by ``next``), the
        wrapped iterator's own ``start_prefetch`` runs, if it has one.
        """
        if self._finished:
            return
        if self._prefetch == 0 or not self._decided:  # the first batch is read by next()
            if isinstance(self._inner, Prefetches):
                self._inner.start_prefetch()
        elif self._prefetcher is None:
            self._start()

    def close(self) -> None:
        """Stops the producer thread and drops prefetched batches; iteration then ends.

        A loader's iterator made here (``batches`` a loader, not an iterator) is closed
        too: its worker processes stop and their shared memory goes. grain_replay's loader
        iterators keep their position when closed, so :meth:`set_state` resumes.
        """
        self._finished = True
        stopped = self._halt(timeout=30.0)
        # Only grain_replay's loader iterators (they give the state at a position) are
        # known to resume after close(); a producer still inside next() keeps using it.
        if stopped and self._owns_inner and isinstance(self._inner, StateAt):
            close = getattr(self._inner, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Only signal: joining here could block the garbage collector.
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None:
            prefetcher.signal_stop()


class _DatasetShardedDevicePutIterator(ShardedDevicePutIterator, grain.DatasetIterator):
    """A :class:`ShardedDevicePutIterator` over a grain dataset iterator (dict states)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        grain.DatasetIterator.__init__(self)
        ShardedDevicePutIterator.__init__(self, *args, **kwargs)
