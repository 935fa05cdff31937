"""Tests for make_data_loader's worker_count > 0 iterator (grain_replay.pipeline.workers)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import grain
import numpy as np
import pytest
from conformance import assert_tree_equal
from loader_ops import CacheShare, Grow, KillWorkerOnce, Pid, PythonLeaves, Shapes
from loader_sources import FailOnce, SlowAfterFirst, Unreadable
from procs import children, new_children, wait_no_new_children
from worker_loaders import id_store, worker_loader

import grain_replay as gr
from grain_replay.pipeline.workers import WorkerLoaderIterator


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return id_store(tmp_path_factory, "workers")


def _loader(source: Any, **kwargs: Any) -> grain.DataLoader:
    return worker_loader(source, **kwargs)


def _sorted(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _sorted(tree[k]) for k in sorted(tree)}
    return tree


# The reference streams below are read in process (worker_count=0): the workers' stream
# equals it (test_stream_equals_the_in_process_stream), and it spawns no second set of workers.


def _ids(batches: list[Any]) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_stream_equals_the_in_process_stream(path: str, workers: int) -> None:
    src = gr.open_source(path)
    want = list(_loader(src, worker_count=0, drop_remainder=False))
    it = iter(_loader(src, worker_count=workers, drop_remainder=False))
    assert isinstance(it, WorkerLoaderIterator)
    assert isinstance(it, grain.DataLoaderIterator)
    got = list(it)
    assert len(got) == len(want) == 26
    for g, w in zip(got, want, strict=True):
        assert_tree_equal(g, w)
        # A view of the worker's shared-memory slot (no copy), writable.
        assert g["id"].flags.writeable and not g["id"].flags.owndata
    with pytest.raises(StopIteration):
        next(it)


# Each grain iterator with workers spawns grain's own worker processes (~5 s on a
# 2-core machine): make test moves the state back into grain at one point mid-stream
# (k=5); `make test-slow` also at the start and at the last batch.
@pytest.mark.parametrize(
    "back_at",
    [(5,), pytest.param((0, 5, 23), marks=pytest.mark.slow, id="0-5-23")],
    ids=["5", "0-5-23"],
)
def test_state_bytes_match_grain_iterator_and_move_both_ways(
    path: str, back_at: tuple[int, ...]
) -> None:
    loader = _loader(gr.open_source(path))
    ours, theirs = iter(loader), grain.DataLoader.__iter__(loader)
    assert not isinstance(theirs, WorkerLoaderIterator)
    assert ours.get_state() == theirs.get_state()
    reference = []
    states = [theirs.get_state()]  # grain's state after k batches: states[k]
    for want in theirs:
        got = next(ours)
        assert_tree_equal(_sorted(got), _sorted(want))  # grain's worker path sorts keys
        assert ours.get_state() == theirs.get_state()
        reference.append(want["id"].tolist())
        states.append(theirs.get_state())
    assert len(reference) == 24
    for k in (0, 5, 23):
        # Grain's own state after k batches (recorded above, not a fresh grain iterator
        # advanced k batches: each of those spawns grain's workers again, seconds apiece).
        resumed = iter(_loader(gr.open_source(path)))
        resumed.set_state(states[k])
        assert _ids(list(resumed)) == reference[k:]
        resumed.set_state(states[k])
        assert resumed.get_state() == states[k]  # the bytes grain resumes from below
        if k in back_at:
            back = grain.DataLoader.__iter__(loader)
            back.set_state(resumed.get_state())
            assert _ids(list(back)) == reference[k:]


@pytest.mark.parametrize("shard", [0, 2])
def test_shards_match_in_process_shards(path: str, shard: int) -> None:
    options = grain.sharding.ShardOptions(shard_index=shard, shard_count=3, drop_remainder=True)
    src = gr.open_source(path)
    want = _ids(list(_loader(src, worker_count=0, shard_options=options)))
    it = iter(_loader(src, worker_count=2, shard_options=options))
    got = []
    for _ in range(3):
        got.append(next(it)["id"].tolist())
    state = it.get_state()
    it.close()
    again = iter(_loader(src, worker_count=2, shard_options=options))
    again.set_state(state)
    got += _ids(list(again))
    assert got == want and len(got) == 8


def test_set_state_mid_stream_drops_batches_read_ahead(path: str) -> None:
    it = iter(_loader(gr.open_source(path), worker_buffer_size=4))
    first = [next(it) for _ in range(7)]
    time.sleep(0.5)  # the workers fill their slots
    it.set_state(b"" + _state_after(path, 2))
    assert _ids([next(it) for _ in range(5)]) == _ids(first[2:7])


def _state_after(path: str, n: int) -> bytes:
    it = iter(_loader(gr.open_source(path), worker_count=2))
    for _ in range(n):
        next(it)
    state = it.get_state()
    it.close()
    return state


def test_set_state_rejects_state_of_another_worker_count(path: str) -> None:
    it = iter(_loader(gr.open_source(path), worker_count=2))
    other = iter(_loader(gr.open_source(path), worker_count=0)).get_state()
    with pytest.raises(ValueError, match="worker count"):
        it.set_state(other)


def test_operations_run_in_the_workers_on_host_batches(path: str) -> None:
    ops = [Pid(), CacheShare()]
    batches = list(_loader(gr.open_source(path), operations=ops, num_epochs=1))
    pids = {int(p) for b in batches for p in b["pid"]}
    assert len(pids) == 2 and os.getpid() not in pids
    assert {int(s) for b in batches for s in b["share"]} == {2}  # the cache budget is split


def test_batches_of_changing_size_grow_the_slots(path: str) -> None:
    src = gr.open_source(path)
    want = list(_loader(src, worker_count=0, operations=[Grow()]))
    got = list(_loader(src, operations=[Grow()], worker_buffer_size=1))
    assert {len(b["id"]) for b in got} == {8, 16, 24}
    for g, w in zip(got, want, strict=True):
        assert_tree_equal(g, w)


def test_non_array_leaves_travel_pickled(path: str) -> None:
    src = gr.open_source(path)
    got = list(_loader(src, operations=[PythonLeaves()], num_epochs=1))
    want = list(_loader(src, worker_count=0, operations=[PythonLeaves()], num_epochs=1))
    assert len(got) == 12
    for g, w in zip(got, want, strict=True):
        assert g["first"] == w["first"] and g["tag"] == "batch" and g["none"] is None
        assert_tree_equal(g["obs"], w["obs"])


def test_empty_scalar_big_endian_strided_and_text_leaves_round_trip(path: str) -> None:
    src = gr.open_source(path)
    got = list(_loader(src, operations=[Shapes()], num_epochs=1))
    want = list(_loader(src, worker_count=0, operations=[Shapes()], num_epochs=1))
    for g, w in zip(got, want, strict=True):
        for key in ("empty", "scalar", "big_endian", "strided", "text"):
            assert g[key].dtype == w[key].dtype and g[key].shape == w[key].shape, key
            np.testing.assert_array_equal(g[key], w[key])


def test_read_error_names_the_worker_and_the_batch_is_read_again(path: str) -> None:
    reference = _ids(list(_loader(gr.open_source(path), worker_count=0)))
    src = FailOnce(gr.open_source(path), bad_id=reference[3][0])
    it = iter(_loader(src))
    got = [next(it)["id"].tolist() for _ in range(3)]
    with pytest.raises(OSError, match="flaky read") as info:
        next(it)
    assert any("grain_replay loader worker 1" in note for note in info.value.__notes__)
    got += _ids(list(it))  # the failed batch comes again, then the rest
    assert got == reference


def test_every_read_failing_raises_every_time(path: str) -> None:
    it = iter(_loader(Unreadable(gr.open_source(path))))
    for _ in range(2):
        with pytest.raises(KeyError, match="leaf 'obs' is missing"):
            next(it)
    it.close()


def test_killed_worker_raises_then_new_workers_resume_at_the_same_batch(path: str) -> None:
    reference = _ids(list(_loader(gr.open_source(path), worker_count=0, num_epochs=1)))
    before = children()
    it = iter(_loader(gr.open_source(path), num_epochs=1))
    got = [next(it)["id"].tolist() for _ in range(2)]
    time.sleep(0.3)
    assert it._pool is not None
    victim = it._pool.workers[0].process
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(gr.WorkerDiedError, match=r"terminated unexpectedly with exit code -9"):
        while True:  # batches already in shared memory may still arrive first
            got.append(next(it)["id"].tolist())
    got += _ids(list(it))
    assert got == reference
    wait_no_new_children(before)  # an exhausted iterator stops its workers


def _killed_once(path: str, marker: Any, kill: KillWorkerOnce, **kwargs: Any) -> list[Any]:
    """The batches until worker 0's death (``kill``), which must be reported, then the
    rest from the workers started after it; checks the stream against a clean run."""
    reference = _ids(list(_loader(gr.open_source(path), worker_count=0, num_epochs=1)))
    marker.touch()
    it = iter(_loader(gr.open_source(path), num_epochs=1, operations=[kill], **kwargs))
    got: list[list[int]] = []
    with pytest.raises(gr.WorkerDiedError, match=r"terminated unexpectedly with exit code -9"):
        while True:
            got.append(next(it)["id"].tolist())
    assert not marker.exists()
    before_death = len(got)
    got += _ids(list(it))
    assert got == reference
    return got[:before_death]


def test_batches_a_killed_worker_left_in_shared_memory_arrive_then_its_death(
    path: str, tmp_path: Any
) -> None:
    # Worker 0 (elements 0, 2, 4, ...) has three slots: it writes its first two batches
    # whole and dies reading its third, whether or not element 2 was handed out yet.
    # Its written batch is whole in shared memory: handed out, though its slot cannot
    # be given back to a dead worker; then its death, then new workers at that batch.
    marker = tmp_path / "kill"
    kill = KillWorkerOnce(str(marker), nth=3)
    assert len(_killed_once(path, marker, kill, worker_buffer_size=3)) == 4


def test_a_worker_killed_between_a_slot_and_its_descriptor_is_reported_dead(
    path: str, tmp_path: Any
) -> None:
    # Worker 0's second batch goes into its second slot, new: the message naming the
    # slot is sent, its descriptor never is.
    marker = tmp_path / "kill"
    kill = KillWorkerOnce(str(marker), nth=2, before_fd=True)
    assert len(_killed_once(path, marker, kill)) == 2


def test_close_and_garbage_collection_leave_no_workers(path: str) -> None:
    before = children()
    it = iter(_loader(gr.open_source(path), num_epochs=None))
    next(it)
    assert len(new_children(before)) == 2
    it.close()
    assert not new_children(before)
    next(it)  # new workers, at the same position
    assert len(new_children(before)) == 2
    it.close()
    dropped = iter(_loader(gr.open_source(path), num_epochs=None))
    next(dropped)
    del dropped
    wait_no_new_children(before)


def test_read_threads_in_workers_keep_the_stream(path: str) -> None:
    src = gr.open_source(path)
    want = _ids(list(_loader(src, worker_count=0)))
    reads = grain.ReadOptions(num_threads=3, prefetch_buffer_size=6)
    assert _ids(list(_loader(src, read_options=reads))) == want


def test_close_kills_workers_stuck_in_reads_within_one_shared_wait(path: str) -> None:
    before = children()
    it = iter(_loader(SlowAfterFirst(gr.open_source(path), 60.0), worker_count=3))
    next(it)  # every worker is now inside a 60 s read
    time.sleep(0.5)
    started = time.monotonic()
    it.close()
    assert time.monotonic() - started < 10  # one 5 s wait for all three, then SIGKILL
    assert not new_children(before)


def test_close_keeps_the_position(path: str) -> None:
    reference = _ids(list(_loader(gr.open_source(path), worker_count=0)))
    it = iter(_loader(gr.open_source(path)))
    got = [next(it)["id"].tolist() for _ in range(5)]
    it.close()
    got += _ids(list(it))
    assert got == reference


def test_unpicklable_source_fails_at_iter_naming_the_fix(path: str) -> None:
    class Local:  # defined in a function: cloudpickle pickles it by value, fine
        def __init__(self, source: Any) -> None:
            self.source = source
            self.lock = __import__("threading").Lock()

        def __len__(self) -> int:
            return len(self.source)

        def read_batch(self, indices: Any) -> Any:
            return self.source.read_batch(indices)

    with pytest.raises(TypeError, match=r"worker_count=2.*pickle"):
        iter(_loader(Local(gr.open_source(path))))
