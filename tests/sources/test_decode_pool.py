"""The decode thread pool: one per process, usable in a child forked at any moment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grain_replay.sources.reading import pool as decode


def test_run_grouped_keeps_order() -> None:
    assert decode.run_grouped(list(range(100)), lambda x: x * x) == [x * x for x in range(100)]


# Run in a fresh interpreter, single-threaded at the fork (this test process runs
# JAX and reader threads, and forking it could deadlock the child), with a fork
# that warns raising: the fork itself is what is under test.
_FORK_WHILE_LOCK_HELD = """
import os, signal, threading, time, warnings
warnings.simplefilter("error", DeprecationWarning)
from grain_replay.sources.reading import pool as decode

decode.decode_pool()  # made, no thread started until a task is submitted
assert threading.active_count() == 1, threading.enumerate()
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
        raise SystemExit("the forked child hung on the decode pool's lock")
    time.sleep(0.05)
assert os.waitstatus_to_exitcode(done[1]) == 0, done
assert decode._pool_pid == os.getpid()  # the parent's pool is untouched
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_child_forked_while_pool_lock_is_held_gets_a_pool() -> None:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_LOCK_HELD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
