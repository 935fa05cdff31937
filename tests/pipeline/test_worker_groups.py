"""Workers handing batches over a group at a time (``WorkerLoaderIterator.hand_over``).

A worker reads ``group`` consecutive batches into one shared-memory slot and sends one
message; ``next()`` hands them out one by one. The stream, the state after every batch,
resumes, read errors and worker deaths must be those of one batch a hand-over.
"""

from __future__ import annotations

import copy
import gc
import mmap
import multiprocessing
import os
import signal
import threading
from typing import Any

import grain
import numpy as np
import pytest
from conformance import assert_tree_equal
from loader_ops import Grow, KillWorkerOnce, PythonLeaves
from loader_sources import FailOnce
from worker_loaders import id_store, worker_loader

import grain_replay as gr
from grain_replay.pipeline.lanes import owner_of
from grain_replay.pipeline.slots import Slots
from grain_replay.pipeline.workers import WorkerLoaderIterator


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return id_store(tmp_path_factory, "groups")


def _loader(source: Any, **kwargs: Any) -> grain.DataLoader:
    kwargs.setdefault("drop_remainder", False)  # a short batch ends each epoch's group early
    return worker_loader(source, **kwargs)


def _grouped(source: Any, group: int, **kwargs: Any) -> WorkerLoaderIterator:
    it = iter(_loader(source, **kwargs))
    assert isinstance(it, WorkerLoaderIterator)
    it.hand_over(group)
    return it


@pytest.fixture(scope="module")
def reference(path: str) -> list[dict[str, np.ndarray]]:
    """The stream read in process (worker_count=0), copied."""
    loader = _loader(gr.open_source(path), worker_count=0)
    return [copy.deepcopy(b) for b in loader]


def _assert_batch(got: Any, want: Any) -> None:
    assert_tree_equal(got, want)


def _ids(batches: list[Any]) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


@pytest.mark.parametrize("group", [1, 3, 7])
def test_stream_and_state_after_every_batch_equal_one_batch_a_hand_over(
    path: str, reference: list[Any], group: int
) -> None:
    it = _grouped(gr.open_source(path), group)
    states = iter(_loader(gr.open_source(path)))  # its states only: no worker starts
    got = []
    for k, want in enumerate(reference):
        batch = next(it)
        _assert_batch(batch, want)
        assert it.get_state() == states.get_state_at(k + 1)
        got.append(batch)  # held: a group's batches stay whole while others arrive
    with pytest.raises(StopIteration):
        next(it)
    for batch, want in zip(got, reference, strict=True):
        _assert_batch(batch, want)


@pytest.mark.parametrize("case", ["changing layouts", "pickled", "read threads"])
def test_batches_of_other_layouts_and_read_threads_keep_the_stream(path: str, case: str) -> None:
    # a batch of another layout than its group's first (Grow: 8, 16 or 24 rows; a short
    # last batch) or one that must be pickled starts a message of its own
    ops: list[Any] = {"changing layouts": [Grow()], "pickled": [PythonLeaves()]}.get(case, [])
    extra: dict[str, Any] = {"operations": ops, "num_epochs": 1}
    if case == "read threads":
        extra["read_options"] = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    src = gr.open_source(path)
    want = list(_loader(src, worker_count=0, operations=ops, num_epochs=1))
    got = list(_grouped(src, 4, worker_buffer_size=1, **extra))
    assert len(got) == len(want) == 13
    for g, w in zip(got, want, strict=True):
        if case == "pickled":
            assert g["first"] == w["first"] and g["tag"] == "batch" and g["none"] is None
            g, w = g["obs"], w["obs"]
        _assert_batch(g, w)


def test_resume_and_seek_inside_a_group_continue_the_stream(
    path: str, reference: list[Any]
) -> None:
    want = _ids(reference)
    saver = _grouped(gr.open_source(path), 4)
    for _ in range(6):  # two into the second group
        next(saver)
    state = saver.get_state()
    saver.close()
    it = _grouped(gr.open_source(path), 4)
    next(it)  # workers running: the resume drops their groups
    it.set_state(state)
    assert it.position == 6
    assert [next(it)["id"].tolist() for _ in range(5)] == want[6:11]
    it.seek(13)  # inside the fourth group, the first batch of the second epoch
    assert _ids(list(it)) == want[13:]


def test_hand_over_of_running_workers_drops_what_they_read_ahead(
    path: str, reference: list[Any]
) -> None:
    it = iter(_loader(gr.open_source(path)))
    got = [next(it) for _ in range(3)]  # one a hand-over, workers reading ahead
    it.hand_over(5)
    got += list(it)
    assert _ids(got) == _ids(reference)


def test_a_loader_asked_to_lay_out_lanes_hands_over_one_batch_at_a_time(
    path: str, reference: list[Any]
) -> None:
    it = _grouped(gr.open_source(path), 3)
    got = [next(it) for _ in range(2)]
    it.lay_out_lanes()  # a laid-out batch goes alone in its transfer: back to one
    it.hand_over(5)  # and kept so
    got += list(it)
    assert _ids(got) == _ids(reference)
    assert all(owner_of(b["id"]) is not None for b in got[3:12])


def test_read_error_inside_a_group_arrives_after_the_batches_before_it(
    path: str, reference: list[Any]
) -> None:
    want = _ids(reference)[:13]  # one epoch: its record is read once
    # group 3: worker 1 reads elements 3, 4, 5; the read of 4 fails once
    src = FailOnce(gr.open_source(path), bad_id=want[4][0])
    it = _grouped(src, 3, num_epochs=1)
    got = [next(it)["id"].tolist() for _ in range(4)]
    with pytest.raises(OSError, match="flaky read") as info:
        next(it)
    assert any("grain_replay loader worker 1" in note for note in info.value.__notes__)
    got += _ids(list(it))  # the failed batch comes again, then the rest
    assert got == want


def test_worker_death_inside_a_group_is_reported_at_the_group_then_resumed(
    path: str, reference: list[Any], tmp_path: Any
) -> None:
    want = _ids(reference)
    # group 3: worker 0 reads 0, 1, 2, then 6, 7, 8: it dies at its 5th batch, 7
    kill = KillWorkerOnce.armed(tmp_path, nth=5)
    it = _grouped(gr.open_source(path), 3, operations=[kill], worker_buffer_size=1)
    got: list[list[int]] = []
    with pytest.raises(gr.WorkerDiedError, match=r"loader worker 0 .* exit code -9"):
        while True:
            got.append(next(it)["id"].tolist())
    assert kill.fired
    assert len(got) == 6  # 0-5 whole; the group of 6-8 never arrived
    got += _ids(list(it))  # new workers, grouped as before, start at that batch
    assert got == want


def test_close_while_a_group_is_held_keeps_its_batches_whole(
    path: str, reference: list[Any]
) -> None:
    it = _grouped(gr.open_source(path), 5)
    held = [next(it) for _ in range(2)]  # three more of the group wait inside the iterator
    it.close()
    gc.collect()
    for batch, want in zip(held, reference[:2], strict=True):
        _assert_batch(batch, want)
    assert [next(it)["id"].tolist() for _ in range(4)] == _ids(reference[2:6])
    it.close()


@pytest.mark.parametrize("group", [0, -2, 2.0, True, "3"])
def test_hand_over_refuses_a_group_that_is_not_a_positive_int(path: str, group: Any) -> None:
    it = iter(_loader(gr.open_source(path)))
    with pytest.raises(gr.InvalidArgumentError, match=r"hand_over\(group\).*Fix: pass an int"):
        it.hand_over(group)


def test_a_group_shares_one_lease_released_when_its_last_batch_goes() -> None:
    slots = Slots(1)
    fd = os.memfd_create("t")
    os.ftruncate(fd, 256)
    try:
        slots.add_map(0, fd, 256)
    finally:
        os.close(fd)
    np.frombuffer(slots.maps[0], np.int32)[:48] = np.arange(48)
    fields = [("x", np.dtype(np.int32), (2, 4), 8, 0, 0)]  # 32 bytes a batch, 64 apart
    batches, give = slots.take_group(0, fields, 64, 3)
    assert give == [1] and slots.held == 1
    for i, b in enumerate(batches):
        np.testing.assert_array_equal(b["x"].ravel(), np.arange(8) + 16 * i)
    first, last = batches[0], batches[2]
    del batches, b
    del first
    gc.collect()
    assert slots.collect() == [] and slots.held == 1  # the last batch still views the slot
    del last
    gc.collect()
    slots.collect()
    assert slots.held == 0 and slots.idle == 1
    assert isinstance(slots.maps[0], mmap.mmap)


def _interrupt_once(real: Any, nth: int) -> Any:
    """``real``, raising KeyboardInterrupt (Ctrl-C in the consumer) at its ``nth`` call."""
    calls = [0]

    def call(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return call


@pytest.mark.parametrize("where", ["receiving a slot", "unpacking a group"])
def test_an_interrupt_in_the_consumer_mid_hand_over_resumes_at_the_same_batch(
    path: str, reference: list[Any], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # Ctrl-C between a _SLOT message and its fd, or after a group's message was taken and
    # before its first batch was handed out: the pipe or the group is half read, so the
    # next call must not read on from there (it hung, or broke the protocol)
    if where == "receiving a slot":
        import multiprocessing.reduction as reduction

        monkeypatch.setattr(reduction, "recv_handle", _interrupt_once(reduction.recv_handle, 2))
    else:
        monkeypatch.setattr(Slots, "take_group", _interrupt_once(Slots.take_group, 2))
    it = _grouped(gr.open_source(path), 3)
    got: list[list[int]] = []
    interrupted = 0
    result: list[Any] = []

    def consume() -> None:
        nonlocal interrupted
        try:
            while True:
                try:
                    got.append(next(it)["id"].tolist())
                except KeyboardInterrupt:
                    interrupted += 1
        except BaseException as e:  # StopIteration at the end, or what went wrong
            result.append(e)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(timeout=60)  # a deadline, not a timing: a hang fails here
    if thread.is_alive():
        it.close()  # wakes the thread
        pytest.fail(f"next() hung after the interrupt ({len(got)} batches handed out)")
    assert isinstance(result[0], StopIteration), repr(result[0])
    assert interrupted == 1
    assert got == _ids(reference)


def test_a_seek_after_a_worker_died_reaches_the_workers_alive(
    path: str, reference: list[Any], tmp_path: Any
) -> None:
    want = _ids(reference)
    before = set(multiprocessing.active_children())
    # group 3, two slots: worker 0 reads 0-2, then dies reading 6 (its 4th batch) on its own
    kill = KillWorkerOnce.armed(tmp_path, nth=4)
    it = _grouped(gr.open_source(path), 3, operations=[kill], worker_buffer_size=2)
    assert next(it)["id"].tolist() == want[0]
    (dead,) = [
        p for p in set(multiprocessing.active_children()) - before if p.name.endswith("_worker_0")
    ]
    dead.join(timeout=60)  # a deadline: it dies whatever the consumer does
    assert not dead.is_alive() and kill.fired
    it.seek(4)  # told to every worker alive (it raised BrokenPipeError, worker 1 never heard)
    got: list[list[int]] = []
    with pytest.raises(gr.WorkerDiedError, match=r"loader worker 0 .* exit code -9"):
        while True:  # the death is reported when worker 0's group comes, as ever
            got.append(next(it)["id"].tolist())
    got += _ids(list(it))  # new workers at that batch
    assert got == want[4:]


def test_lay_out_lanes_after_a_worker_died_reports_the_death_at_its_batch(
    path: str, reference: list[Any]
) -> None:
    # lay_out_lanes() (asked by sharded_device_put at its first batch) raised
    # BrokenPipeError at a dead worker, instead of the death at its batch
    want = _ids(reference)
    before = set(multiprocessing.active_children())
    it = _grouped(gr.open_source(path), 3)
    assert next(it)["id"].tolist() == want[0]
    (victim,) = [
        p for p in set(multiprocessing.active_children()) - before if p.name.endswith("_worker_0")
    ]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=60)  # a deadline: SIGKILL ends it
    it.lay_out_lanes()  # back to one batch a hand-over: a seek, then the lanes
    got: list[list[int]] = []
    with pytest.raises(gr.WorkerDiedError, match=r"loader worker 0 .* exit code -9"):
        while True:
            got.append(next(it)["id"].tolist())
    got += _ids(list(it))
    assert got == want[1:]
