"""The shared decode pool: one thread pool per process for chunk decoding that drops the GIL."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from grain_replay.pipeline import shutdown

__all__ = ["decode_pool", "run_grouped"]

_pool: concurrent.futures.Executor | None = None
_pool_pid: int | None = None
_pool_workers = 1
_pool_lock = threading.Lock()


def _forget_pool_in_child() -> None:
    # A fork copies the lock as it was: held, if another thread was creating the
    # pool, and then nobody would ever release it in the child.
    global _pool, _pool_pid, _pool_lock
    _pool, _pool_pid, _pool_lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def decode_pool() -> concurrent.futures.Executor:
    """One decoding pool per process (recreated after fork), sized to the cores."""
    global _pool, _pool_pid, _pool_workers
    pid = os.getpid()
    if _pool is None or _pool_pid != pid:
        with _pool_lock:
            if _pool is None or _pool_pid != pid:
                workers = max(1, min(8, len(os.sched_getaffinity(0))))
                _pool = shutdown.thread_pool(workers, "grain_replay-decode")
                _pool_workers = workers
                _pool_pid = pid
    return _pool


# Tasks per pool worker in one batch: enough to balance uneven chunks, few
# enough that the executor's per-task cost stays small next to one decode.
_TASKS_PER_WORKER = 4


def run_grouped(items: Sequence[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """``[fn(x) for x in items]``, spread over the decode pool in a few groups."""
    if len(items) < 4:
        return [fn(x) for x in items]
    pool = decode_pool()
    groups = min(len(items), _pool_workers * _TASKS_PER_WORKER)
    out: list[Any] = [None] * len(items)

    def run(g: int) -> None:
        for i in range(g, len(items), groups):
            out[i] = fn(items[i])

    # A group the pool refuses (at interpreter exit, read by a non-daemon thread) is
    # decoded here, in the calling thread.
    futures = [shutdown.submit(pool, run, g) for g in range(groups)]
    # Every group finishes before an error is raised: callers release what the
    # groups use (a descriptor) as soon as this returns.
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()
    return out
