"""Every sampling mode end to end through sharded_device_put, with and without workers."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import grain_replay as gr


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dp")
    out = {}
    for name, n, offset in (("a", 64, 0), ("b", 40, 1000)):
        ids = offset + np.arange(n, dtype=np.int64)
        gr.write_npy(root / name, {"id": ids, "obs": np.ones((n, 2), np.float32) * ids[:, None]})
        out[name] = str(root / name)
    return out


def _loader(mode: str, paths: dict[str, str], workers: int) -> Any:
    a = gr.NpyDataSource(paths["a"])
    if mode == "mixture":
        b = gr.NpyDataSource(paths["b"])
        return gr.make_data_loader(
            {"a": a, "b": b}, weights={"a": 0.25, "b": 0.75}, batch_size=16,
            worker_count=workers, source_leaf="src",
        )  # fmt: skip
    sampling = gr.UniformReplay() if mode == "uniform" else gr.PrioritizedReplay()
    return gr.make_data_loader(a, batch_size=16, sampling=sampling, worker_count=workers)


def _ids(batch: Any) -> np.ndarray:
    data = batch.data if isinstance(batch, gr.Sampled) else batch
    return np.asarray(data["id"])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["mixture", "uniform", "prioritized"])
def test_mode_through_sharded_device_put(paths: dict[str, str], mode: str, workers: int) -> None:
    host = iter(_loader(mode, paths, 0))
    loader_it = iter(_loader(mode, paths, workers))
    with gr.sharded_device_put(loader_it) as batches:
        for step in range(6):
            batch = next(batches)
            want = next(host)
            leaves = jax.tree_util.tree_leaves(batch)
            assert all(isinstance(x, jax.Array) for x in leaves)
            assert all(len(x.sharding.device_set) == 8 for x in leaves)
            np.testing.assert_array_equal(_ids(batch), _ids(want))
            if mode == "prioritized":
                assert isinstance(batch, gr.Sampled)
                np.testing.assert_array_equal(np.asarray(batch.index), want.index)
                np.testing.assert_array_equal(np.asarray(batch.weight), want.weight)
                # jax arrays back, as a learner gives them. The host-side twin (no workers)
                # gets the same update at the same draw when stamped with the wrapper's
                # read-ahead (prefetch 2) plus the workers' lag (2 workers x 2 slots - 1).
                batches.update_priorities(batch.index, batch.weight * 0 + step + 1)
                lag = 2 * 2 - 1 if workers else 0
                host.update_priorities(
                    want.index, np.full(16, step + 1.0), handed_out=step + 1 + 2 + lag
                )
        # a checkpoint: the wrapper's state, and the priorities from the loader's iterator
        state = batches.get_state()
        priorities = loader_it.priority_state() if mode == "prioritized" else None
        rest = [_ids(next(batches)) for _ in range(3)]
        batches.set_state(state)
        if priorities is not None:
            loader_it.set_priority_state(priorities)
        for ids in rest:
            np.testing.assert_array_equal(_ids(next(batches)), ids)
    loader_it.close()
    host.close()


def test_update_through_device_put_reaches_draws_after_lag_plus_prefetch(
    paths: dict[str, str],
) -> None:
    loader = gr.make_data_loader(
        gr.NpyDataSource(paths["a"]),
        batch_size=8,
        sampling=gr.PrioritizedReplay(alpha=1.0),
        worker_count=2,
        worker_buffer_size=1,
    )  # lag 1
    with gr.sharded_device_put(loader, prefetch=2) as batches:
        first = [next(batches) for _ in range(3)]
        row = int(np.asarray(first[2].index)[0])
        batches.update_priorities(np.array([row]), np.array([1e12]))  # after 3 batches
        dominant = [s for s in range(3, 12) if (np.asarray(next(batches).index) == row).all()]
    assert dominant[0] == 3 + 1 + 2, dominant  # handed out + lag + prefetch


def test_update_priorities_on_a_plain_iterator_is_refused(paths: dict[str, str]) -> None:
    loader = gr.make_data_loader(gr.NpyDataSource(paths["a"]), batch_size=8)
    with gr.sharded_device_put(loader) as batches:
        next(batches)
        with pytest.raises(gr.UnsupportedStateError, match="priorities"):
            batches.update_priorities(np.zeros(1, np.int64), np.ones(1))
