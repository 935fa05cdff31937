"""Stops what the package left running (threads, worker processes) before the interpreter exits.

A daemon thread still inside XLA when the interpreter finalizes (a device put of
``sharded_device_put``, a device writer's copy to host) aborts the process:
``terminate called after throwing an instance of ''`` / ``FATAL: exception not
rethrown``, exit code 134, after the script itself succeeded. jax's own exit
handlers also tear the backend down under such a thread. So everything that starts
a thread or worker processes registers here while they run, held weakly (the registry
keeps nothing alive), and unregisters when it stops them. One ``atexit`` hook closes
what is still registered, newest first, each with a bounded wait.

``atexit`` runs its handlers last registered first, after the non-daemon threads are
joined; jax registers its handlers when it is imported. The hook is therefore
registered again (moved to the front) at every :func:`register`: a device iterator
registers after jax was imported, so the hook runs before jax tears the backend down.

Thread pools at exit: threading's exit hooks run before the non-daemon threads are joined,
and one of them (``concurrent.futures``') shuts every thread pool, made or yet to be made.
A non-daemon thread still at work then (an actor closing its writer, a thread reading a
batch while the main thread ends) has each of its pool's ``submit`` refused: "cannot
schedule new futures after interpreter shutdown". The package makes its pools with
:func:`thread_pool` and submits with :func:`submit`: a task the pool refuses runs in the
calling thread instead, once.

Never imports jax: loader workers and writers use it too (layer 0 of the architecture).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

try:
    # Its exit hook is registered with threading at its first import, which threading
    # refuses once it is exiting ("can't register atexit after shutdown"): imported with
    # the package's first pool user, not at that user's first pool, perhaps made at exit.
    import concurrent.futures.thread
except RuntimeError:  # imported at exit itself: thread_pool() says so
    pass

__all__ = ["Registry", "close_all", "live", "register", "submit", "thread_pool", "unregister"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Registry:
    """Owners to close, held weakly, in registration order; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(owner) -> (the owner, held weakly; the function closing it). A collected
        # owner's id may be reused: forgetting its entry then is harmless (nothing to close).
        self._live: dict[int, tuple[weakref.ref[Any], Callable[[Any], None]]] = {}
        self._closing = False

    def register(self, owner: Any, close: Callable[[Any], None]) -> None:
        """Has ``close(owner)`` run by :meth:`close_all` unless :meth:`unregister` comes
        first; registering an owner again moves it to the newest place."""
        with self._lock:
            if self._closing:
                return
            for key in [k for k, (ref, _) in self._live.items() if ref() is None]:
                del self._live[key]  # collected without closing (its __del__ stopped it)
            self._live.pop(id(owner), None)
            self._live[id(owner)] = (weakref.ref(owner), close)

    def unregister(self, owner: Any) -> None:
        with self._lock:
            self._live.pop(id(owner), None)

    def live(self) -> list[Any]:
        """The registered owners still alive, oldest first."""
        with self._lock:
            return [o for o in (ref() for ref, _ in self._live.values()) if o is not None]

    def close_all(self) -> None:
        """Closes every registered owner, newest first; a failure is logged, the rest go on."""
        with self._lock:
            self._closing = True
            entries = list(self._live.values())[::-1]
            self._live.clear()
        try:
            for ref, close in entries:
                owner = ref()
                if owner is not None:
                    try:
                        close(owner)
                    except Exception:
                        logger.exception("grain_replay: closing %r at exit failed", owner)
                    del owner
        finally:
            with self._lock:
                self._closing = False


_REGISTRY = Registry()


def register(owner: Any, close: Callable[[Any], None]) -> None:
    """Has ``close(owner)`` run at interpreter exit unless :func:`unregister` comes first.

    ``close`` must be idempotent, bounded in time and safe while another thread is
    blocked on ``owner``; pass a function or an unbound method (a bound method would
    keep ``owner`` alive). Registering an owner again moves it to the newest place.
    """
    _REGISTRY.register(owner, close)
    # Last registered, first run: ahead of the handlers of whatever was imported since
    # (jax's among them). One hook: unregister removes it wherever it is.
    atexit.unregister(close_all)
    atexit.register(close_all)


def unregister(owner: Any) -> None:
    """``owner`` stopped what it started: nothing to close at exit."""
    _REGISTRY.unregister(owner)


def live() -> list[Any]:
    """The registered owners still alive, oldest first (for tests and diagnostics)."""
    return _REGISTRY.live()


def close_all() -> None:
    """The ``atexit`` hook: closes every registered owner, newest first."""
    _REGISTRY.close_all()


class _HereExecutor(concurrent.futures.Executor):
    """Runs each task in the calling thread, as it is submitted."""

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        return _run_here(fn, args, kwargs)


def _run_here(fn: Callable[..., T], args: Any, kwargs: Any) -> concurrent.futures.Future[T]:
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    try:
        done.set_result(fn(*args, **kwargs))
    except Exception as e:  # carried by the future, as a pool's task's failure is
        done.set_exception(e)
    return done


def thread_pool(workers: int, name: str) -> concurrent.futures.Executor:
    """A thread pool of ``workers`` threads named ``name``; where the interpreter was
    already exiting when ``concurrent.futures``' pools were first needed (threading
    refuses their exit hook), an executor running each task in the calling thread."""
    try:
        return concurrent.futures.ThreadPoolExecutor(workers, name)
    except RuntimeError:
        return _HereExecutor()


def submit(
    pool: concurrent.futures.Executor, fn: Callable[..., T], /, *args: Any
) -> concurrent.futures.Future[T]:
    """``pool.submit(fn, *args)``; where the pool refuses (the interpreter is exiting, or a
    ``close()`` in another thread shut the pool down), ``fn`` runs here, in the calling
    thread, and the future holds its outcome. Either way ``fn`` runs exactly once: a
    refusal comes before anything is queued."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError as e:
        # "cannot schedule new futures after [interpreter] shutdown"; a broken pool or a
        # thread that could not start (the task already queued) is raised as it is.
        if isinstance(e, concurrent.futures.BrokenExecutor) or "cannot schedule" not in str(e):
            raise
    return _run_here(fn, args, {})
