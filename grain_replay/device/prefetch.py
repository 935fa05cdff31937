"""The background producer of ``sharded_device_put``: pull a host batch, convert it, queue it."""

from __future__ import annotations

import concurrent.futures
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

    ``convert`` takes a list of host batches and returns their device arrays (one
    packed transfer for the lot, or one per batch). ``moves``, if given (the caller
    decided it at the first batch: ``Converter.transfers``), says how many batches go to
    one ``convert`` call and how many such calls may run at once, on that many threads
    (a put of a large batch holds its thread while the host lays it out: several in
    flight move more). The depth grows to hold two groups, or one batch per thread, so
    that transfers overlap consumption.

    ``capture_state`` also queues a copy of ``inner.get_state()`` taken right after
    each batch, so the consumer knows the state of the last batch it received.

    While the thread runs, the prefetcher is registered with
    :mod:`grain_replay.pipeline.shutdown`: at interpreter exit the thread is stopped
    before jax tears the backend down (a thread inside a device put then aborts the
    process).
    """

    def __init__(
        self,
        inner: Any,
        convert: Callable[[list[Any]], list[Any]],
        depth: int,
        capture_state: bool,
        moves: tuple[int, int] | None = None,
    ) -> None:
        size, threads = moves if moves is not None else (1, 1)
        size, threads = max(1, int(size)), max(1, int(threads))
        self._stop = threading.Event()
        # bounded by the slots: a batch is read only with a slot, freed when it is taken;
        # room for two groups, or a batch per thread, so that the transfers overlap
        self._queue: queue.Queue[Any] = queue.Queue()
        self._slots = threading.Semaphore(max(depth, 2 * size, threads))
        self._thread: threading.Thread | None = threading.Thread(
            target=_produce,
            args=(
                inner, convert, self._queue, self._slots, self._stop, capture_state,
                size, threads,
            ),
            name="sharded_device_put",
            daemon=True,
        )  # fmt: skip
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
        if isinstance(arrays, concurrent.futures.Future):
            try:
                arrays = arrays.result()
            except BaseException:
                self.halt()
                raise
        return arrays, state

    def signal_stop(self) -> None:
        """Asks the producer to stop, without waiting for it."""
        self._stop.set()

    def halt(self, timeout: float | None = None) -> bool:
        """Stops the producer (waiting up to ``timeout``) and drops what it prefetched;
        a consumer blocked in :meth:`next` then gets StopIteration. Idempotent. Returns
        False if the producer is still inside the wrapped iterator after ``timeout``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        shutdown.unregister(self)
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("sharded_device_put: producer blocked in next(); left as daemon")
            return False
        while True:  # the producer is gone: nothing else puts, a waiting consumer wakes
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put_nowait(_END)
        return True


def _halt_at_exit(prefetcher: Prefetcher) -> None:
    prefetcher.halt(_EXIT_JOIN_S)


def _first(convert: Callable[[list[Any]], list[Any]], batches: list[Any]) -> Any:
    return convert(batches)[0]


def _produce(
    inner: Any,
    convert: Callable[[list[Any]], list[Any]],
    out: queue.Queue[Any],
    slots: threading.Semaphore,
    stop: threading.Event,
    capture_state: bool,
    size: int,
    threads: int,
) -> None:
    """Producer loop: a module-level function so the thread never keeps the wrapper alive.

    Reads up to a group of batches (one slot each), converts them together (here, or on
    a put thread: the consumer then waits on its future) and queues them in order; a
    failure or the end of the stream comes after the batches read before it.
    """
    pool: concurrent.futures.Executor | None = None
    if threads > 1 and size == 1:
        pool = shutdown.thread_pool(threads, "sharded_device_put_put")
    try:
        while True:
            batches: list[Any] = []
            states: list[Any] = []
            last: Any = None  # _END or a _Failure, queued after this group
            while len(batches) < size:
                while not slots.acquire(timeout=_POLL_S):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                try:
                    batch = next(inner)
                except StopIteration:
                    last = _END
                except BaseException as e:
                    last = _Failure(e)
                if last is not None:
                    slots.release()
                    break
                if stop.is_set():  # stopped while reading (at exit: no put after teardown)
                    return
                try:
                    states.append(copy.deepcopy(inner.get_state()) if capture_state else None)
                except BaseException as e:
                    slots.release()
                    last = _Failure(e)
                    break
                batches.append(batch)
            if batches:
                if pool is not None:  # one batch a group: its future stands for its arrays
                    # Refused (at interpreter exit, a non-daemon thread consuming): the put
                    # runs here, its outcome in the future; the producer goes on.
                    future = shutdown.submit(pool, _first, convert, batches)
                    out.put((future, states[0]))
                else:
                    try:
                        arrays = convert(batches)
                    except BaseException as e:
                        out.put(_Failure(e))
                        return
                    for item in zip(arrays, states, strict=True):
                        out.put(item)
            if last is not None:
                out.put(last)
                return
    finally:
        if pool is not None:
            # No put left running once the producer is gone (at exit: before jax's
            # teardown). Stopped: the queued ones are dropped with it; at the end of the
            # stream (or a failure) the consumer still takes them, so none is cancelled.
            pool.shutdown(wait=True, cancel_futures=stop.is_set())
