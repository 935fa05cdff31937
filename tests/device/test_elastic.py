"""Loader states resume on another number of processes (in one process: shard options set by hand).

Process ``p`` of ``P`` is ``ShardOptions(p, P)``, what ``ShardByJaxProcess`` gives
it; tests/device/test_multihost_scale.py runs the same with real JAX processes.
"""

from __future__ import annotations

import json
from typing import Any

import grain
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.pipeline.state import LoaderIdentity, loader_state_bytes

N = 100
G = 16  # global batch: 6 steps an epoch (96 records), 2 epochs


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Any:
    p = str(tmp_path_factory.mktemp("elastic") / "s.h5")
    gr.write(p, {"id": np.arange(N, dtype=np.int64), "x": np.zeros((N, 2), np.float32)})
    return gr.open_source(p)


def _loader(src: Any, p: int, count: int, **kwargs: Any) -> grain.DataLoader:
    kwargs.setdefault("batch_size", G // count)
    kwargs.setdefault("seed", 11)
    kwargs.setdefault("num_epochs", 2)
    shards = grain.sharding.ShardOptions(shard_index=p, shard_count=count, drop_remainder=True)
    return gr.make_data_loader(src, shard_options=shards, **kwargs)


def _stepped(loader: grain.DataLoader, k: int) -> Any:
    it = iter(loader)
    for _ in range(k):
        next(it)
    return it


def _global_stream(src: Any) -> list[list[int]]:
    """Global batches as one process with the global batch reads them."""
    return [b["id"].tolist() for b in _loader(src, 0, 1)]


def _resumed_stream(src: Any, count: int, states: list[bytes], **kwargs: Any) -> list[list[int]]:
    """The global batches ``count`` processes read, each restored from one saved state."""
    local = []
    for p in range(count):
        it = iter(_loader(src, p, count, **kwargs))
        it.set_state(states[p % len(states)])  # any saved process's state will do
        local.append([b["id"].tolist() for b in it])
    assert len({len(x) for x in local}) == 1  # every process takes the same number of steps
    return [[i for x in local for i in x[s]] for s in range(len(local[0]))]


@pytest.mark.parametrize(("saved", "resumed"), [(4, 2), (2, 4), (4, 1), (1, 4), (2, 8)])
@pytest.mark.parametrize("k", [0, 5, 7, 12])
def test_resume_on_another_process_count_continues_the_global_stream(
    src: Any, saved: int, resumed: int, k: int
) -> None:
    stream = _global_stream(src)
    assert len(stream) == 12
    states = [_stepped(_loader(src, p, saved), k).get_state() for p in range(saved)]
    shares = [[b["id"].tolist() for b in _loader(src, p, saved)] for p in range(saved)]
    head = [[i for share in shares for i in share[s]] for s in range(k)]
    assert head == stream[:k]  # the saved run read the global stream so far
    tail = _resumed_stream(src, resumed, states)
    assert tail == stream[k:]
    for epoch in range(2):  # every record of an epoch exactly once, across the two runs
        seen = np.concatenate((head + tail)[6 * epoch : 6 * (epoch + 1)])
        assert len(np.unique(seen)) == len(seen) == 96


def test_grains_own_iterator_state_resumes_on_another_process_count(src: Any) -> None:
    stream = _global_stream(src)
    states = [
        _stepped_grain(_loader(src, p, 4), 3).get_state() for p in range(4)
    ]  # grain's DataLoaderIterator, not ours
    assert _resumed_stream(src, 2, states) == stream[3:]


def _identity(loader: grain.DataLoader, p: int, count: int) -> LoaderIdentity:
    """What the loader's states name (read from a state: no worker starts before next())."""
    state = json.loads(iter(loader).get_state())
    return LoaderIdentity(state["worker_count"], state["sampler"], state["data_source"], p, count)


def _stepped_grain(loader: grain.DataLoader, k: int) -> Any:
    it = grain.DataLoader.__iter__(loader)
    for _ in range(k):
        next(it)
    return it


@pytest.mark.parametrize("saved_workers", [1, 3])
def test_state_saved_with_workers_resumes_without(src: Any, saved_workers: int) -> None:
    stream = _global_stream(src)
    states = []
    for p in range(4):
        ident = _identity(_loader(src, p, 4, worker_count=saved_workers), p, 4)
        states.append(loader_state_bytes(ident, 7))
    assert _resumed_stream(src, 2, states) == stream[7:]


def test_same_process_count_any_process_state_resumes_every_process(src: Any) -> None:
    stream = _global_stream(src)
    state_of_1 = _stepped(_loader(src, 1, 4), 2).get_state()
    assert _resumed_stream(src, 4, [state_of_1]) == stream[2:]


def test_another_global_batch_is_refused_with_the_fix(src: Any) -> None:
    state = _stepped(_loader(src, 0, 4), 2).get_state()
    it = iter(_loader(src, 0, 2, batch_size=4))  # global batch 8, not 16
    before = it.get_state()
    with pytest.raises(gr.CheckpointMismatchError, match=r"Fix: pass batch_size=8 ") as e:
        it.set_state(state)
    assert isinstance(e.value, ValueError)
    assert "4 process(es) x batch_size 4 = global batch 16" in str(e.value)
    assert "2 process(es) x batch_size 4 = global batch 8" in str(e.value)
    assert it.get_state() == before  # unchanged
    with pytest.raises(gr.CheckpointMismatchError, match="does not split over 3 processes"):
        iter(_loader(src, 0, 3, batch_size=5)).set_state(state)


@pytest.mark.parametrize(
    "change", [{"seed": 12}, {"num_epochs": 3}, {"shuffle": False}], ids=["seed", "epochs", "order"]
)
def test_another_stream_is_refused(src: Any, change: dict[str, Any]) -> None:
    state = _stepped(_loader(src, 0, 4), 2).get_state()
    with pytest.raises(gr.CheckpointMismatchError, match="another global stream"):
        iter(_loader(src, 0, 2, **change)).set_state(state)


def test_another_store_is_refused(src: Any, tmp_path: Any) -> None:
    other = str(tmp_path / "o.h5")
    gr.write(other, {"id": np.arange(N, dtype=np.int64), "x": np.zeros((N, 2), np.float32)})
    state = _stepped(_loader(src, 0, 4), 2).get_state()
    with pytest.raises(gr.CheckpointMismatchError, match=r"o\.h5"):
        iter(_loader(gr.open_source(other), 0, 2)).set_state(state)


def test_same_process_count_keeps_grains_checks(src: Any) -> None:
    state = _stepped(_loader(src, 0, 2), 2).get_state()
    with pytest.raises(gr.CheckpointMismatchError, match="Worker count in checkpoint"):
        iter(_loader(src, 0, 2, worker_count=1)).set_state(state)
    with pytest.raises(gr.CheckpointMismatchError, match="Sampler in checkpoint"):
        iter(_loader(src, 0, 2, batch_size=4)).set_state(state)  # grain checks the sampler first
    with pytest.raises(gr.CheckpointMismatchError, match="DataSource in checkpoint"):
        iter(_loader(src, 0, 2, seed=12)).set_state(state)


@pytest.mark.parametrize(
    "state",
    [
        b"not json",
        b"[1, 2]",
        b"{}",
        json.dumps({"last_seen_indices": {"0": "x"}, "worker_count": 0}).encode(),
        json.dumps({"version": 2, "last_seen_indices": {}, "worker_count": 0}).encode(),
        "a str".encode("utf-16"),
        {"next_index": 3},
    ],
)
def test_what_is_not_a_loader_state_is_refused(src: Any, state: Any) -> None:
    it = _stepped(_loader(src, 0, 2), 1)
    before = it.get_state()
    with pytest.raises(gr.CheckpointMismatchError, match="Fix: pass the bytes get_state"):
        it.set_state(state)
    assert it.get_state() == before


def test_an_edited_state_is_refused(src: Any) -> None:
    ident = _identity(_loader(src, 0, 4, worker_count=2), 0, 4)
    state = json.loads(loader_state_bytes(ident, 5))
    state["last_seen_indices"]["1"] += 8 * 2  # worker 1 two turns ahead of worker 0
    with pytest.raises(gr.CheckpointMismatchError, match="handing out elements in turn"):
        iter(_loader(src, 0, 2)).set_state(json.dumps(state).encode())
