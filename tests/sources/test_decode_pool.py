"""The decode thread pool: one per process, usable in a child forked at any moment."""

from __future__ import annotations

import os
import signal
import time

import pytest

from grain_replay.sources.reading import pool as decode


def test_run_grouped_keeps_order() -> None:
    assert decode.run_grouped(list(range(100)), lambda x: x * x) == [x * x for x in range(100)]


# The child touches only the decode pool and leaves with os._exit: JAX's warning
# about forking a process that has JAX threads does not apply.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_child_forked_while_pool_lock_is_held_gets_a_pool() -> None:
    decode.decode_pool()
    with decode._pool_lock:  # another thread creating the pool at the moment of the fork
        pid = os.fork()
        if pid == 0:  # the child: must not wait for a lock nobody will release
            try:
                ok = decode.decode_pool().submit(sum, [1, 2]).result(timeout=10) == 3
                os._exit(0 if ok and decode._pool_pid == os.getpid() else 1)
            except BaseException:
                os._exit(2)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung on the decode pool's lock")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert decode._pool_pid == os.getpid()  # the parent's pool is untouched
