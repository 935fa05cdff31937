"""Functions run inside spawned worker processes by the tests (importable by name)."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np


def read_in_worker(src: Any, indices: list[int]) -> dict[str, Any]:
    """Reads through a source in a fresh process and reports what happened there."""
    batch = src.read_batch(indices)
    records = [src[i] for i in indices]
    again = src.read_batch(indices[::-1])
    jax_backends = 0
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        jax_backends = len(xla_bridge._backends)
    return {
        "pid": os.getpid(),
        "opens": src._opens,
        "batch": batch,
        "records": records,
        "again": again,
        "jax_backends": jax_backends,
    }


def leaf_sum(batch: Any) -> float:
    return float(sum(np.asarray(v, dtype=np.float64).sum() for v in _leaves(batch)))


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


def read_across_fork(src: Any, indices: list[int]) -> dict[str, Any]:
    """Opens ``src`` here, then forks: the child must open its own handle and read the same.

    Runs in a freshly spawned process, so the only threads alive at the fork are
    those reading ``src`` left behind (reported by name and counted by the OS, with
    any warning the fork raised).
    """
    import threading
    import warnings

    src[0]
    parent_handle = src._handle
    want = src.read_batch(indices)
    threads = sorted(t.name for t in threading.enumerate())
    os_threads = _os_thread_count()  # native threads too: what Python's fork warning counts
    r, w = os.pipe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pid = os.fork()
        if pid == 0:  # the child: must not reuse the parent's handle
            ok = 0
            try:
                got, expected = _leaves(src.read_batch(indices)), _leaves(want)
                ok = int(
                    src._handle is not parent_handle
                    and len(got) == len(expected)
                    and all(np.array_equal(a, b) for a, b in zip(got, expected))
                )
            finally:
                os.write(w, bytes([ok]))
                os._exit(0)
    os.close(w)
    result = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    return {
        "child_ok": result == b"\x01",
        "parent_kept_handle": src._handle is parent_handle,
        "threads_at_fork": threads,
        "os_threads_at_fork": os_threads,
        "fork_warnings": [str(c.message) for c in caught],
    }


def _os_thread_count() -> int:
    """Threads of this process as the kernel counts them (``Threads:`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return -1
