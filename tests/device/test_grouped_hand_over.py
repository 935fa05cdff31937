"""sharded_device_put asks a worker loader to hand a transfer's batches over together.

With several batches a packed transfer, ``make_data_loader(worker_count > 0)``'s workers
send them in one message (``WorkerLoaderIterator.hand_over``); the arrays, their order and
the checkpoint bytes after every batch must be those of one batch a hand-over.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.device import packed as packing
from grain_replay.pipeline.workers import WorkerLoaderIterator


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(1)
    n = 120
    tree = {
        "obs": rng.standard_normal((n, 6), dtype=np.float32),
        "action": rng.integers(0, 9, n).astype(np.int32),
        "id": np.arange(n, dtype=np.int64),
    }
    p = str(tmp_path_factory.mktemp("handover") / "s.npy")
    gr.write(p, tree, format="npy")
    return p


def _stream(src: Any, workers: int, packed: bool) -> tuple[list[dict[str, Any]], list[Any]]:
    loader = gr.make_data_loader(src, batch_size=8, seed=2, num_epochs=2, worker_count=workers)
    out, states = [], []
    with gr.sharded_device_put(loader, packed=packed) as it:
        for arrays in it:
            out.append({k: np.asarray(v) for k, v in arrays.items()})
            states.append(it.get_state())
    return out, states


def test_packed_groups_are_handed_over_together_with_the_same_stream_and_states(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbytes = 8 * (6 * 4 + 4 + 8)
    monkeypatch.setattr(packing, "GROUP_BYTES", 3 * nbytes)  # 3 batches a transfer
    asked: list[int] = []
    real = WorkerLoaderIterator.hand_over

    def hand_over(self: WorkerLoaderIterator, group: int) -> None:
        asked.append(group)
        real(self, group)

    monkeypatch.setattr(WorkerLoaderIterator, "hand_over", hand_over)
    src = gr.open_source(path)
    got, got_states = _stream(src, 2, packed=True)
    assert asked == [3]
    want, _ = _stream(src, 0, packed=False)
    assert len(got) == len(want) == 30
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w)
        for key in w:
            assert g[key].dtype == w[key].dtype
            np.testing.assert_array_equal(g[key], w[key])
    states = iter(gr.make_data_loader(src, batch_size=8, seed=2, num_epochs=2, worker_count=2))
    assert got_states == [states.get_state_at(k + 1) for k in range(30)]  # no worker starts


def test_one_batch_a_transfer_keeps_one_batch_a_hand_over(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []
    monkeypatch.setattr(WorkerLoaderIterator, "hand_over", lambda self, g: asked.append(g))
    monkeypatch.setattr(packing, "GROUP_BYTES", 0)  # one batch a transfer
    src = gr.open_source(path)
    loader = gr.make_data_loader(src, batch_size=8, num_epochs=1, worker_count=1)
    with gr.sharded_device_put(loader, packed=True) as it:
        next(it)
    assert asked == []


def _loader_workers() -> set[Any]:
    return {
        p
        for p in multiprocessing.active_children()
        if p.name.startswith("grain_replay_loader_worker_")
    }


def test_closing_the_wrapper_of_a_loader_stops_its_workers_and_keeps_the_position(
    path: str,
) -> None:
    # the wrapper makes the loader's iterator: its close (or `with`) is the only one the
    # user can call, so it stops the workers and frees their shared-memory slots (a group
    # each); set_state() resumes as after a loader iterator's own close()
    src = gr.open_source(path)
    kwargs: dict[str, Any] = {"batch_size": 8, "seed": 2, "num_epochs": None}
    want = list(itertools.islice(gr.make_data_loader(src, **kwargs), 6))
    before = _loader_workers()
    loader = gr.make_data_loader(src, worker_count=2, **kwargs)
    with gr.sharded_device_put(loader, packed=True) as it:
        got = [next(it) for _ in range(3)]
        started = _loader_workers() - before
        assert len(started) == 2
    assert not any(p.is_alive() for p in started)  # close() joined them
    it.set_state(it.get_state())
    got += [next(it) for _ in range(3)]
    it.close()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g["id"]), w["id"])
