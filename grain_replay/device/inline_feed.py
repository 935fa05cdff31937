"""``sharded_device_put``'s read-ahead in the caller's thread: groups of batches read, put
and unpacked one group ahead of the one being consumed, no producer thread.

Why (measured on a TPU v5e host, ``benchmarks/bench_feed.py``): there every jax call costs
the host ~0.12 ms and a small model's step is bound by its own dispatch (the MLP step
0.25 ms of host, 0.016 ms of chip). A producer thread then adds no parallelism: the
loader's hand-over, the put and the unpack run under the same interpreter lock as the
step's dispatch, and each hand-over between the threads costs more on top (the step fed
by the thread ran at 0.33x of the bare step, the same work done in the step's thread at
up to 0.62x). A put and an unpack are asynchronous: issued a group ahead, the transfer
and the relayout overlap the steps dispatched meanwhile, as the thread's did.

Same interface as :class:`~grain_replay.device.prefetch.Prefetcher`: ``next()`` gives
``(arrays, state)``; the wrapped iterator's end or exception comes after the batches read
before it.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

__all__ = ["InlineFeed"]


class _End:
    """The wrapped iterator ended (``error`` None) or raised ``error``."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class InlineFeed:
    """Reads ``size`` batches a group (``moves[0]``: the caller decided it at the first
    batch; 1 without ``moves``), converts each group with one ``convert`` call, and keeps
    the next group converted while the caller takes the current one's batches: at most
    ``2 * size`` batches ahead (at least ``depth``).

    ``capture_state``: each batch's ``inner.get_state()`` is copied right after it is read
    and handed out with it.
    """

    def __init__(
        self,
        inner: Any,
        convert: Callable[[list[Any]], list[Any]],
        depth: int,
        capture_state: bool,
        moves: tuple[int, int] | None = None,
    ) -> None:
        self._inner = inner
        self._convert = convert
        self._capture = capture_state
        self._depth = max(1, depth)
        self._size = max(1, int(moves[0])) if moves is not None else 1
        self._ready: collections.deque[tuple[Any, Any]] = collections.deque()
        self._end: _End | None = None

    def next(self) -> tuple[Any, Any]:
        """The next ``(arrays, state)``; the wrapped iterator's exception, or StopIteration
        at its end, once the batches read before it were handed out."""
        if not self._ready and self._end is None:
            self._read_group()
        if self._ready:
            item = self._ready.popleft()
            while self._end is None and len(self._ready) < self._ahead():
                self._read_group()  # the next transfers overlap this group's steps
            return item
        end, self._end = self._end, _End(None)  # after a failure, the stream has ended
        if end is not None and end.error is not None:
            raise end.error
        raise StopIteration

    def _ahead(self) -> int:
        return max(self._depth, self._size)

    def _read_group(self) -> None:
        batches: list[Any] = []
        states: list[Any] = []
        while len(batches) < self._size:
            try:
                batch = next(self._inner)
                states.append(copy.deepcopy(self._inner.get_state()) if self._capture else None)
            except StopIteration:
                self._end = _End(None)
                break
            except BaseException as e:
                self._end = _End(e)
                break
            batches.append(batch)
        if not batches:
            return
        try:
            arrays = self._convert(batches)
        except BaseException as e:
            self._end = _End(e)
            return
        self._ready.extend(zip(arrays, states, strict=True))

    def signal_stop(self) -> None:
        """Nothing runs in the background: nothing to signal."""

    def halt(self, timeout: float | None = None) -> bool:
        """Drops what was read ahead; :meth:`next` then ends the stream. True: nothing
        runs in the background."""
        self._ready.clear()
        self._end = _End(None)
        return True
