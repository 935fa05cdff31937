"""The background producer of ``sharded_device_put``: pull a host batch, convert it, queue it."""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from grain_replay.pipeline import shutdown

__all__ = ["Prefetcher"]

logger = logging.getLogger(__name__)

_END = object()  # queued by the producer when the wrapped iterator is exhausted
_POLL_S = 0.05  # how often a waiting producer checks whether it was asked to stop
_EXIT_JOIN_S = 10.0  # at interpreter exit, how long to wait for the producer


class _Failure:
    """An exception raised in the producer, carried to the consumer."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """A daemon thread keeping up to ``depth`` converted batches (and their states) queued.

    ``capture_state`` also queues a copy of ``inner.get_state()`` taken right after
    each batch, so the consumer knows the state of the last batch it received.

    While the thread runs, the prefetcher is registered with
    :mod:`grain_replay.pipeline.shutdown`: at interpreter exit the thread is stopped
    before jax tears the backend down (a thread inside a device put then aborts the
    process).
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
        shutdown.register(self, _halt_at_exit)
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
        """Stops the producer (waiting up to ``timeout``) and drops what it prefetched;
        a consumer blocked in :meth:`next` then gets StopIteration. Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        shutdown.unregister(self)
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("sharded_device_put: producer blocked in next(); left as daemon")
            return
        while True:  # the producer is gone: nothing else puts, a waiting consumer wakes
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put_nowait(_END)


def _halt_at_exit(prefetcher: Prefetcher) -> None:
    prefetcher.halt(_EXIT_JOIN_S)


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
        if stop.is_set():  # stopped while reading (at exit: no device put after jax's teardown)
            return
        try:
            state = copy.deepcopy(inner.get_state()) if capture_state else None
            arrays = convert(batch)
        except BaseException as e:
            out.put(_Failure(e))
            return
        out.put((arrays, state))
