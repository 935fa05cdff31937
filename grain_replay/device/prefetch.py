"""The background producer of ``sharded_device_put``: pull a host batch, convert it, queue it."""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Prefetcher"]

logger = logging.getLogger(__name__)

_END = object()  # queued by the producer when the wrapped iterator is exhausted
_POLL_S = 0.05  # how often a waiting producer checks whether it was asked to stop


class _Failure:
    """An exception raised in the producer, carried to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """A daemon thread keeping up to ``depth`` converted batches (and their states) queued.

    ``capture_state`` also queues a copy of ``inner.get_state()`` taken right after
    each batch, so the consumer knows the state of the last batch it received.
    """

    def __init__(
        self, inner: Any, convert: Callable[[Any], Any], depth: int, capture_state: bool
    ) -> None:
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._slots = threading.Semaphore(depth)
        self._thread: threading.Thread | None = threading.Thread(
            target=_produce,
            args=(inner, convert, self._queue, self._slots, self._stop, capture_state),
            name="sharded_device_put",
            daemon=True,
        )
        self._thread.start()

    def next(self) -> tuple[Any, Any]:
        """The next ``(arrays, state)``; the producer's own exception, or StopIteration at the
        end (the thread has stopped then)."""
        item = self._queue.get()
        if item is _END or isinstance(item, _Failure):
            self.halt()
            if isinstance(item, _Failure):
                raise item.error  # the original exception, producer-side traceback included
            raise StopIteration
        self._slots.release()
        arrays, state = item
        return arrays, state

    def signal_stop(self) -> None:
        """Asks the producer to stop, without waiting for it."""
        self._stop.set()

    def halt(self, timeout: float | None = None) -> None:
        """Stops the producer (waiting up to ``timeout``) and drops what it prefetched."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("sharded_device_put: producer blocked in next(); left as daemon")
        self._thread = None


def _produce(
    inner: Any,
    convert: Callable[[Any], Any],
    out: queue.Queue[Any],
    slots: threading.Semaphore,
    stop: threading.Event,
    capture_state: bool,
) -> None:
    """Producer loop: a module-level function so the thread never keeps the wrapper alive."""
    while True:
        while not slots.acquire(timeout=_POLL_S):
            if stop.is_set():
                return
        if stop.is_set():
            return
        try:
            batch = next(inner)
        except StopIteration:
            out.put(_END)
            return
        except BaseException as e:
            out.put(_Failure(e))
            return
        try:
            state = copy.deepcopy(inner.get_state()) if capture_state else None
            arrays = convert(batch)
        except BaseException as e:
            out.put(_Failure(e))
            return
        out.put((arrays, state))
