"""Tests for make_data_loader's worker_count=0 iterator (grain_replay.pipeline.in_process)."""

from __future__ import annotations

import json
import threading
from typing import Any

import grain
import numpy as np
import pytest
from conformance import assert_tree_equal, make_tree

import grain_replay as gr
from grain_replay.pipeline.in_process import InProcessLoaderIterator

NO_SHARDING = grain.sharding.NoSharding()
# (num_threads, prefetch_buffer_size): synchronous, one thread, grain's default shape.
READS = [(0, 0), (1, 1), (2, 4), (3, 0)]


class AddOne(grain.transforms.Map):
    def map(self, element: Any) -> Any:
        return {**element, "id1": element["id"] + 1}


class KeepEven(grain.transforms.Filter):
    def filter(self, element: Any) -> bool:
        return int(element["id"][0]) % 2 == 0


class FailingSource:
    """Delegates to ``source``; the ``fail_on``-th ``read_batch`` call (1-based) raises once.

    With ``fail_rows``, the first read of exactly those rows raises instead:
    read threads enter ``read_batch`` in any order, so the n-th call is not
    always the n-th batch (a thread that took batch 3 may be overtaken by the
    one that took batch 4).
    """

    def __init__(self, source: Any, fail_on: int, fail_rows: Any = None) -> None:
        self.source = source
        self.fail_on = fail_on
        self.fail_rows = None if fail_rows is None else sorted(int(i) for i in fail_rows)
        self.calls = 0
        self.lock = threading.Lock()
        self.read = threading.Event()

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"FailingSource({self.source!r})"

    def read_batch(self, indices: Any) -> Any:
        with self.lock:
            self.calls += 1
            call = self.calls
            if self.fail_rows is not None and sorted(int(i) for i in indices) == self.fail_rows:
                self.fail_rows = None
                call = self.fail_on
        self.read.set()
        if call == self.fail_on:
            raise OSError(f"flaky read #{call}")
        return self.source.read_batch(indices)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tree = make_tree(100)
    tree["id"] = np.arange(100, dtype=np.int64)
    p = str(tmp_path_factory.mktemp("in_process") / "s.h5")
    gr.write(p, tree)
    return p


def _loader(source: Any, reads: tuple[int, int] | None = (2, 4), **kwargs: Any) -> grain.DataLoader:
    """``reads``: (num_threads, prefetch_buffer_size), or None for make_data_loader's default."""
    kwargs.setdefault("shard_options", NO_SHARDING)
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("seed", 5)
    kwargs.setdefault("num_epochs", 2)
    if reads is not None:
        kwargs["read_options"] = grain.ReadOptions(*reads)
    return gr.make_data_loader(source, **kwargs)


def _grain_iter(loader: grain.DataLoader) -> grain.DataLoaderIterator:
    """The stock grain iterator of the same loader (its threaded pipeline)."""
    return grain.DataLoader.__iter__(loader)


def _ids(batches: list[Any]) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize(
    "shard_options",
    [NO_SHARDING, grain.sharding.ShardOptions(shard_index=1, shard_count=3, drop_remainder=True)],
    ids=["one-process", "process-1-of-3"],
)
def test_stream_and_state_bytes_match_grain_iterator(
    path: str, reads: tuple[int, int], shard_options: Any
) -> None:
    loader = _loader(gr.open_source(path), reads, shard_options=shard_options)
    ours, theirs = iter(loader), _grain_iter(loader)
    assert isinstance(ours, InProcessLoaderIterator)
    assert isinstance(ours, grain.DataLoaderIterator)
    assert not isinstance(theirs, InProcessLoaderIterator)
    assert ours.get_state() == theirs.get_state()
    steps = 0
    for want in theirs:
        got = next(ours)
        assert_tree_equal(got, want)
        assert ours.get_state() == theirs.get_state()
        steps += 1
    assert steps == (24 if shard_options is NO_SHARDING else 8)
    for _ in range(2):  # stays exhausted
        with pytest.raises(StopIteration):
            next(ours)
    assert ours.get_state() == theirs.get_state()
    assert str(ours).startswith("PyGrainDatasetIterator(state=")


@pytest.mark.parametrize("reads", READS)
def test_state_moves_between_grain_and_in_process_iterators(
    path: str, reads: tuple[int, int]
) -> None:
    loader = _loader(gr.open_source(path), reads)
    reference = _ids(list(_grain_iter(loader)))
    for k in (0, 1, 7, 23, 24):
        theirs = _grain_iter(loader)
        for _ in range(k):
            next(theirs)
        ours = iter(_loader(gr.open_source(path), reads))  # a fresh loader and source
        ours.set_state(theirs.get_state())
        assert _ids(list(ours)) == reference[k:]
        ours.set_state(theirs.get_state())  # rewinding an exhausted iterator works too
        back = _grain_iter(loader)
        back.set_state(ours.get_state())
        assert _ids(list(back)) == reference[k:]


@pytest.mark.parametrize("reads", READS)
def test_set_state_mid_stream_drops_batches_read_ahead(path: str, reads: tuple[int, int]) -> None:
    it = iter(_loader(gr.open_source(path), reads))
    reference = _ids(list(_grain_iter(_loader(gr.open_source(path), reads))))
    head = [next(it) for _ in range(5)]
    state = it.get_state()
    it.start_prefetch()
    for _ in range(9):
        next(it)
    it.set_state(state)
    assert _ids(head) + _ids(list(it)) == reference


def test_set_state_rejects_other_loaders_state(path: str) -> None:
    src = gr.open_source(path)
    it = iter(_loader(src))
    next(it)
    workers_state = json.loads(it.get_state())
    workers_state["worker_count"] = 1
    with pytest.raises(ValueError, match="Worker count in checkpoint"):
        it.set_state(json.dumps(workers_state).encode())
    with pytest.raises(ValueError, match="DataSource in checkpoint"):
        it.set_state(iter(_loader(src, seed=6)).get_state())
    with pytest.raises(ValueError, match="Sampler in checkpoint"):
        it.set_state(iter(_loader(src, num_epochs=3)).get_state())
    assert it.get_state() == _stepped_state(_loader(src), 1)  # untouched by the failures


def _stepped_state(loader: grain.DataLoader, k: int) -> bytes:
    it = iter(loader)
    for _ in range(k):
        next(it)
    return it.get_state()


@pytest.mark.parametrize("reads", READS)
@pytest.mark.parametrize("fail_on", [1, 4])
def test_read_error_propagates_and_batch_is_read_again(
    path: str, reads: tuple[int, int], fail_on: int
) -> None:
    batches = list(_loader(gr.open_source(path), reads))
    reference = _ids(batches)
    # Batch ``fail_on`` (1-based) fails on its first read, whichever thread reads it when.
    src = FailingSource(gr.open_source(path), -1, fail_rows=batches[fail_on - 1]["id"])
    it = iter(_loader(src, reads))
    got: list[Any] = []
    with pytest.raises(OSError, match="flaky read"):
        while True:
            got.append(next(it))
    assert len(got) == fail_on - 1
    want = json.loads(_stepped_state(_loader(gr.open_source(path), reads), len(got)))
    assert json.loads(it.get_state())["last_seen_indices"] == want["last_seen_indices"]
    got += list(it)
    assert _ids(got) == reference


def test_map_operations_run_on_in_process_path(path: str) -> None:
    plain = list(_loader(gr.open_source(path)))
    it = iter(_loader(gr.open_source(path), operations=[AddOne()]))
    assert isinstance(it, InProcessLoaderIterator)
    mapped = list(it)
    assert _ids(mapped) == _ids(plain)
    for b in mapped:
        np.testing.assert_array_equal(b["id1"], b["id"] + 1)


def test_other_operations_and_workers_use_grain_iterator(path: str) -> None:
    src = gr.open_source(path)
    it = iter(_loader(src, operations=[KeepEven()]))
    assert not isinstance(it, InProcessLoaderIterator)
    kept = list(it)
    assert kept and all(int(b["id"][0]) % 2 == 0 for b in kept)
    workers = _loader(src, worker_count=1)
    assert isinstance(workers, grain.DataLoader)
    assert not isinstance(iter(workers), InProcessLoaderIterator)


@pytest.mark.parametrize("reads", [None, (0, 0), (2, 0)], ids=["default", "0-threads", "0-buffer"])
def test_reads_only_inside_next_without_read_ahead(
    path: str, reads: tuple[int, int] | None
) -> None:
    src = FailingSource(gr.open_source(path), fail_on=-1)
    it = iter(_loader(src, reads))
    it.start_prefetch()
    assert src.calls == 0
    next(it)
    assert src.calls == 1
    assert it._pool is None  # no threads were started


def test_start_prefetch_reads_ahead_and_close_keeps_position(path: str) -> None:
    reference = _ids(list(_loader(gr.open_source(path))))
    src = FailingSource(gr.open_source(path), fail_on=-1)
    it = iter(_loader(src, (1, 2)))
    it.start_prefetch()
    assert src.read.wait(timeout=60)  # a pool thread read before any next()
    got = [next(it), next(it)]
    it.close()
    it.close()  # idempotent
    got += list(it)  # iterating after close() starts fresh threads at the same place
    assert _ids(got) == reference


def test_endless_loader_reads_first_epochs(path: str) -> None:
    src = gr.open_source(path)
    it = iter(_loader(src, num_epochs=None))
    first = _ids([next(it) for _ in range(24)])
    assert first == _ids(list(_loader(src, num_epochs=2)))


def test_make_data_loader_types_callable_for_worker_count_zero(path: str) -> None:
    loader = _loader(gr.open_source(path))
    assert isinstance(loader, grain.DataLoader)
    assert isinstance(iter(loader), grain.DataLoaderIterator)


class OddReprSource:
    """A source whose repr needs JSON escaping: quotes, backslashes, a newline, non-ASCII."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return 'Odd("q\\\\uote"\n\té ☃)'

    def read_batch(self, indices: Any) -> Any:
        return self.source.read_batch(indices)


def test_state_bytes_match_grain_iterator_source_repr_needs_escaping(path: str) -> None:
    loader = _loader(OddReprSource(gr.open_source(path)), (0, 0))
    ours, theirs = iter(loader), _grain_iter(loader)
    for _ in range(3):
        next(ours), next(theirs)
    assert ours.get_state() == theirs.get_state()
    resumed = iter(loader)
    resumed.set_state(ours.get_state())
    assert _ids([next(resumed)]) == _ids([next(theirs)])
