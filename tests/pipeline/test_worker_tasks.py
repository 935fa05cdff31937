"""WorkerLoaderIterator with per-task payloads: tasks drawn here, read in the workers."""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Any

import numpy as np
import pytest
from task_fns import EchoTask

import grain_replay as gr
from grain_replay.pipeline.state import LoaderIdentity
from grain_replay.pipeline.workers import WorkerLoaderIterator


class Tasks:
    """Records every call; task ``j`` is a pure function of ``j``."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, j: int) -> Any:
        self.calls.append(j)
        return (j, np.arange(j, j + 3))


def _iterator(tasks: Tasks, workers: int, buffer: int, threads: int = 0) -> WorkerLoaderIterator:
    identity = LoaderIdentity(
        worker_count=workers, sampler="tasks", data_source="tasks", shard_index=0, shard_count=1
    )
    return WorkerLoaderIterator(
        identity, EchoTask(), length=50, buffer_size=buffer, read_threads=threads, task=tasks
    )


@pytest.mark.parametrize(("workers", "buffer", "threads"), [(2, 2, 0), (3, 1, 0), (2, 2, 2)])
def test_each_element_reads_its_task_in_a_worker(workers: int, buffer: int, threads: int) -> None:
    tasks = Tasks()
    with _iterator(tasks, workers, buffer, threads) as it:
        for j in range(12):
            batch = next(it)
            assert batch["j"].tolist() == [j]
            np.testing.assert_array_equal(batch["rows"], np.arange(j, j + 3))
            assert batch["pid"][0] != os.getpid()
            # drawn in order, never more than workers * buffer ahead of the handed out
            assert tasks.calls == list(range(len(tasks.calls)))
            assert max(tasks.calls) < (j + 1) + workers * buffer


def test_a_seek_asks_again_for_the_tasks_not_handed_out() -> None:
    tasks = Tasks()
    with _iterator(tasks, 2, 2) as it:
        for _ in range(5):
            next(it)
        drawn = max(tasks.calls)
        it.seek(3)
        assert [next(it)["j"][0] for _ in range(3)] == [3, 4, 5]
        assert tasks.calls[drawn + 1 :][:2] == [3, 4]  # re-sent from the new position


def test_a_failing_task_raises_here_and_the_element_is_retried() -> None:
    class Flaky(Tasks):
        def __call__(self, j: int) -> Any:
            if j == 4 and 4 not in self.calls:
                self.calls.append(j)
                raise ValueError("task 4 failed once")
            return super().__call__(j)

    tasks = Flaky()
    with _iterator(tasks, 1, 1) as it:
        for _ in range(4):
            next(it)
        with pytest.raises(ValueError, match="task 4"):
            next(it)
        assert next(it)["j"].tolist() == [4]


def test_a_worker_killed_is_reported_once_then_new_workers_take_the_tasks() -> None:
    # the tasks sent to a dead worker raised BrokenPipeError from every next(), for ever
    tasks = Tasks()
    before = set(multiprocessing.active_children())
    with _iterator(tasks, 2, 2) as it:
        assert next(it)["j"].tolist() == [0]
        (victim,) = [
            p for p in set(multiprocessing.active_children()) - before if p.name.endswith("_1")
        ]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=60)  # a deadline: SIGKILL ends it
        got: list[int] = []
        with pytest.raises(gr.WorkerDiedError, match=r"loader worker 1 .* exit code -9"):
            while True:  # batches it wrote before dying are still handed out
                got.append(int(next(it)["j"][0]))
        got += [int(next(it)["j"][0]) for _ in range(12 - len(got))]
    assert got == list(range(1, 13))
