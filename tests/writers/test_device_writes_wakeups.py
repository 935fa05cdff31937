"""Device appends at less CPU: the thread wakes once a batch is queued, takes the host copies
newest first, joins batches in buffers it keeps; a device writer's evictions are removed by
its sync thread, and the sync's segment commits give way to a waiting flush."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.store import parts as parts_lib
from grain_replay.writers import parts_writer
from grain_replay.writers.backends import NpyBackend, NpySegmentBackend
from grain_replay.writers.device import background, host_copies
from grain_replay.writers.parts_writer import PartWriter
from tests.helpers.store_reads import read_all

ROWS = 16
SYNCS = "grain_replay-device-syncs"
# Appends (one segment each, capacity two) after which segments 0 and 16 are dropped.
APPENDS = 4 + parts_lib.RETAIN_SEGMENTS


def _block(i: int) -> dict[str, np.ndarray]:
    base = i * ROWS + np.arange(ROWS)
    return {"obs": (base[:, None] * np.ones(3)).astype(np.float32), "action": base.astype(np.int32)}


BLOCK_BYTES = sum(a.nbytes for a in _block(0).values())


def _device(block: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: jnp.asarray(v) for k, v in block.items()}


def _record_removals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(segment, thread) of each removal of an existing segment (not of a leftover)."""
    removed: list[tuple[str, str]] = []
    real = parts_writer.remove_segment

    def remove_segment(path: str, *args: Any) -> None:
        if os.path.exists(path):
            removed.append((os.path.basename(path), threading.current_thread().name))
        real(path, *args)

    monkeypatch.setattr(parts_writer, "remove_segment", remove_segment)
    return removed


def _seg(path: str, first: int) -> str:
    return os.path.join(parts_lib.writer_dir(path, "a"), parts_lib.segment_name(first, "npy"))


def test_thread_takes_nothing_below_a_batch_then_copies_newest_first(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(background, "WRITE_BATCH_BYTES", 3 * BLOCK_BYTES)
    seen: list[int] = []  # the first row of each "action" leaf taken to host
    real = host_copies.to_host

    def to_host(leaf: Any) -> np.ndarray:
        out = real(leaf)
        if out.dtype == np.int32:
            seen.append(int(out[0]))
        return out

    monkeypatch.setattr(host_copies, "to_host", to_host)
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path) as w:
        w.append(_device(_block(0)))
        w.append(_device(_block(1)))
        time.sleep(0.2)
        assert seen == [], "the thread took trees before a batch was queued"
        w.append(_device(_block(2)))
        deadline = time.monotonic() + 30
        while len(seen) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert seen == [2 * ROWS, ROWS, 0]  # newest first: one wait for the last step
    got = read_all(path)
    np.testing.assert_array_equal(got["action"], np.arange(3 * ROWS))


def test_batches_joined_in_a_kept_buffer(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background, "WRITE_BATCH_BYTES", 2 * BLOCK_BYTES)
    given: list[np.ndarray] = []  # kept alive: fresh arrays could not share an address
    real = NpyBackend.write

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        if "action" in arrays:
            given.append(arrays["action"])
        real(self, arrays, start)

    monkeypatch.setattr(NpyBackend, "write", write)
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path) as w:
        for i in range(6):
            w.append(_device(_block(i)))
            if i % 2 == 1:
                w.flush()  # each batch of two written before the next is queued
    where = {a.__array_interface__["data"][0] for a in given}
    assert len(given) == 3 and len(where) == 1, where
    np.testing.assert_array_equal(read_all(path)["action"], np.arange(6 * ROWS))


def test_device_writer_evictions_removed_by_the_sync_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed = _record_removals(monkeypatch)
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path, capacity=2 * ROWS, writer_id="a", segment_rows=ROWS)
    for i in range(APPENDS):
        w.append(_device(_block(i)))
        w.flush()
    w.close()
    names = [parts_lib.segment_name(f, "npy") for f in (0, ROWS)]
    assert sorted(n for n, _ in removed) == names
    assert {t for _, t in removed} == {SYNCS}, "the flush removed the evicted segments itself"
    assert not os.path.exists(_seg(path, 0)) and not os.path.exists(_seg(path, ROWS))
    np.testing.assert_array_equal(
        read_all(path)["action"], np.arange((APPENDS - 2) * ROWS, APPENDS * ROWS)
    )


def test_host_writer_evictions_removed_by_flush(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed = _record_removals(monkeypatch)
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path, capacity=2 * ROWS, writer_id="a", segment_rows=ROWS) as w:
        for i in range(APPENDS):
            w.append(_block(i))
            w.flush()
        assert not os.path.exists(_seg(path, ROWS)), "a host writer's flush left it"
    assert len(removed) == 2 and {t for _, t in removed} == {"MainThread"}


def test_failing_background_removal_is_logged_and_reopen_removes_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = parts_writer.remove_segment
    armed = {"on": True}

    def remove_segment(path: str, *args: Any) -> None:
        if armed["on"] and threading.current_thread().name == SYNCS:
            raise PermissionError(13, "Permission denied (injected)", path)
        real(path, *args)

    monkeypatch.setattr(parts_writer, "remove_segment", remove_segment)
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path, capacity=2 * ROWS, writer_id="a", segment_rows=ROWS)
    with caplog.at_level(logging.WARNING, logger=parts_writer.__name__):
        for i in range(APPENDS - 1):
            w.append(_device(_block(i)))
            w.flush()  # the last drops segment 0: its removal in the thread fails
        w.append(_device(_block(APPENDS - 1)))  # the writer goes on
        assert w.flush() == APPENDS * ROWS
        w.append(_device(_block(APPENDS)))  # a batch: the sync thread runs again
        assert w.flush() == (APPENDS + 1) * ROWS
    assert any("could not remove evicted segment" in r.message for r in caplog.records)
    assert "Fix:" in caplog.text
    w.close()
    assert os.path.exists(_seg(path, 0))  # left by the failed removals
    armed["on"] = False
    with gr.ReplayWriter(path, capacity=2 * ROWS, writer_id="a", segment_rows=ROWS):
        assert not os.path.exists(_seg(path, 0))  # an orphan: removed on reopen
    np.testing.assert_array_equal(
        read_all(path)["action"], np.arange((APPENDS - 1) * ROWS, (APPENDS + 1) * ROWS)
    )


def test_segment_commits_give_way_to_a_waiting_flush(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    commits: list[int] = []
    real = NpySegmentBackend.stage_commit

    def stage_commit(self: Any, n: int, checksums: Any) -> list[int]:
        commits.append(n)
        return real(self, n, checksums)

    monkeypatch.setattr(NpySegmentBackend, "stage_commit", stage_commit)
    path = str(tmp_path / "s")
    w = PartWriter(
        path, "npy", writer_id="a", capacity=1000, segment_rows=ROWS, chunk_rows=None,
        compression=None,
    )  # fmt: skip
    for i in range(3):  # fills [0, 16) and [16, 32), written as the device writer's thread does
        w.write(*w.check(_block(i)), by_leaf=True)
    w.commit_filled(stop=lambda: True)  # a flush waits: nothing committed here
    assert commits == []
    asked: list[int] = []
    w.commit_filled(stop=lambda: bool(asked) or bool(asked.append(1)))  # one, then stop
    assert commits == [ROWS]
    assert w.flush() == 3 * ROWS  # the flush commits the segment left
    w.close()
    np.testing.assert_array_equal(read_all(path)["action"], np.arange(3 * ROWS))


class _NewestWaiterFirst(threading.Condition):
    """A condition whose ``notify(n)`` wakes the ``n`` threads that waited last (any
    waiters may be woken): a notify meant for one kind of waiter reaches the other."""

    def notify(self, n: int = 1) -> None:
        assert self._is_owned()  # type: ignore[attr-defined]
        waiters = self._waiters  # type: ignore[attr-defined]
        for _ in range(min(n, len(waiters))):
            waiters.pop().release()


def test_a_drain_wakes_the_writing_thread_when_the_sync_thread_waited_last() -> None:
    """The writing thread and the sync thread wait on one condition: a caller's wake-up
    must reach the writing thread whichever of them waited last (a ``notify()`` that
    woke the sync thread instead left flush() waiting for ever)."""

    def sync(*caller_waits: Any) -> None:  # returns once the writing thread waits
        deadline = time.monotonic() + 10
        while not bg._idle and time.monotonic() < deadline:
            time.sleep(0.001)

    bg = background.BackgroundWriter("store", sync=sync)
    # Both threads wait on the one condition, which wakes the newest waiter first.
    bg._work = _NewestWaiterFirst(bg._done._lock)  # type: ignore[attr-defined]
    assert bg._syncs is not None
    bg._syncs._work = bg._work
    written: list[int] = []
    write = lambda arrays, n: written.append(n)
    host = lambda a: False
    bg.submit(_block(0), ROWS, 0, write, host)
    bg.drain()  # written; the sync thread runs, then waits after the writing thread
    deadline = time.monotonic() + 10
    while bg._syncs.pending_locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # the sync thread is back in its wait
    bg.submit(_block(1), ROWS, ROWS, write, host)
    done = threading.Event()
    threading.Thread(target=lambda: (bg.drain(), done.set()), daemon=True).start()
    assert done.wait(10), "drain() never woke the writing thread"
    assert written == [ROWS, ROWS]
    bg.stop()
