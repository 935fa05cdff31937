"""A device writer's thread that fails outside its copies, writes and commits (a bug, a
thread that cannot start) fails the writer: the caller's flush, close or append raises,
where it used to wait forever for a thread that had ended (a hung CI run shows no error)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.writers.device import background
from tests.helpers.store_reads import read_all

ROWS = 16
WRITES = "grain_replay-device-writes"
SYNCS = "grain_replay-device-syncs"


def _device(i: int) -> dict[str, Any]:
    base = i * ROWS + np.arange(ROWS)
    return {"obs": jnp.asarray(base[:, None] * np.ones(3, np.float32)), "action": jnp.asarray(base)}


def _within_deadline(call: Callable[[], Any], seconds: float = 60.0) -> dict[str, Any]:
    """Runs ``call`` on a thread; what it returned or raised, once it ends. A call still
    waiting at the deadline fails the test (it would wait forever: nothing wakes it)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the call still waits for a writer thread that has ended"
    return out


def _assert_ended(*names: str) -> None:
    """The writer's threads end (a failed one is not joined by close: waited for here)."""
    for t in threading.enumerate():
        if t.name in names:
            t.join(60)
            assert not t.is_alive(), f"{t.name} still runs"


@pytest.fixture
def refuse_to_start(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Threads with these names cannot start (as when the process is out of threads)."""
    names: set[str] = set()
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name in names:
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return names


def test_a_failure_in_the_writer_thread_is_raised_by_flush(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(batch: Any, where: str) -> Any:
        raise TypeError("a bug in the host copies")

    monkeypatch.setattr(background, "batch_to_host", broken)
    w = gr.ReplayWriter(str(tmp_path / "s"))
    w.append(_device(0))
    out = _within_deadline(w.flush)
    error = out.get("error")
    assert isinstance(error, gr.BackgroundWriteError), out
    assert "write thread failed: TypeError: a bug in the host copies" in str(error)
    assert "Fix:" in str(error) and isinstance(error.__cause__, TypeError)
    _within_deadline(w.close)  # releases the store; the failure was raised once already
    _assert_ended(WRITES)


def test_a_sync_thread_that_cannot_start_fails_the_writer(
    tmp_path: Any, refuse_to_start: set[str]
) -> None:
    refuse_to_start.add(SYNCS)  # started by the writer thread after its first write
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path, capacity=8 * ROWS, writer_id="a", segment_rows=ROWS)
    w.append(_device(0))
    out = _within_deadline(w.flush)
    error = out.get("error")
    assert isinstance(error, gr.BackgroundWriteError), out
    assert "write thread failed: RuntimeError: can't start new thread" in str(error)
    _within_deadline(w.close)
    _assert_ended(WRITES, SYNCS)


def test_a_writer_thread_that_cannot_start_is_raised_by_append_and_close_returns(
    tmp_path: Any, refuse_to_start: set[str]
) -> None:
    refuse_to_start.add(WRITES)
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        w.append(_device(0))
    assert len(w) == 0, "rows of an append that raised were counted"
    refuse_to_start.clear()
    w.append(_device(1))  # the next append starts the thread
    assert _within_deadline(w.flush).get("value") == ROWS
    _within_deadline(w.close)
    np.testing.assert_array_equal(read_all(path)["action"], np.arange(ROWS, 2 * ROWS))
