"""What a stream replays (``sampling/replayed.py``): its store, watermarks, priorities, refresh."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sampling import replayed
from grain_replay.sampling.streams import Stream, make_stream


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("replayed")
    out = {}
    for name in ("a", "b"):
        path = str(root / name)
        gr.write_npy(path, {"x": np.arange(40, dtype=np.float32)})
        out[name] = gr.NpyDataSource(path)
    return out


def _stream(source: Any, sampling: Any, weights: Any = None) -> Stream:
    return make_stream(
        source,
        weights=weights,
        sampling=sampling,
        batch_size=4,
        seed=0,
        shuffle=True,
        keys=None,
        source_leaf=None,
        shard_index=0,
        shard_count=1,
        lag=0,
    )


@pytest.mark.parametrize("sampling", [gr.UniformReplay(), gr.PrioritizedReplay()])
def test_a_replay_of_one_store_names_that_store_and_its_rows(
    stores: dict[str, Any], sampling: Any
) -> None:
    stream = _stream(stores["a"], sampling)
    assert replayed.replayed_source(stream) is stores["a"]
    mark = replayed.stream_watermark(stream)
    assert mark is not None and mark.rows == 40
    assert replayed.mixture_lengths(stream) is None
    assert replayed.mixture_watermarks(stream) is None
    replayed.check_watermarks(stream, mark, None)  # its own watermark: no complaint


def test_a_replay_mixture_names_each_source_by_name(stores: dict[str, Any]) -> None:
    stream = _stream(stores, gr.UniformReplay(), weights={"a": 1, "b": 1})
    assert replayed.replayed_source(stream) is None
    assert replayed.stream_watermark(stream) is None
    lengths = replayed.mixture_lengths(stream)
    assert lengths is not None and sorted(lengths) == ["a", "b"]
    marks = replayed.mixture_watermarks(stream)
    assert marks is not None and {k: m.rows for k, m in marks.items()} == {"a": 40, "b": 40}
    replayed.check_watermarks(stream, None, marks)


def test_a_watermark_past_the_store_is_refused(stores: dict[str, Any]) -> None:
    stream = _stream(stores["a"], gr.UniformReplay())
    mark = replayed.stream_watermark(stream)
    assert mark is not None and mark.rows is not None
    ahead = dataclasses.replace(mark, rows=mark.rows + 10)  # rows this store never held
    with pytest.raises(gr.ReplayCheckpointError, match="Fix:"):
        replayed.check_watermarks(stream, ahead, None)
    with pytest.raises(gr.ReplayCheckpointError, match="Fix:"):
        replayed.check_watermarks(
            _stream(stores, gr.UniformReplay(), weights={"a": 1, "b": 1}), None, {"a": ahead}
        )


def test_priority_calls_without_priorities_are_refused_with_a_fix(
    stores: dict[str, Any],
) -> None:
    it = iter(gr.make_data_loader(stores["a"], batch_size=4, sampling=gr.UniformReplay()))
    with pytest.raises(gr.InvalidSamplingError, match=r"'uniform'.*Fix: make the loader"):
        it.update_priorities(np.zeros(1, np.int64), np.ones(1))
    with pytest.raises(gr.InvalidSamplingError, match="PrioritizedReplay"):
        it.priority_state()


def test_refresh_of_a_fixed_mixture_is_refused_with_a_fix(stores: dict[str, Any]) -> None:
    it = iter(gr.make_data_loader(stores, batch_size=4, weights={"a": 1, "b": 1}))
    with pytest.raises(gr.InvalidSamplingError, match=r"'mixture'.*Fix: sampling=gr.Uniform"):
        it.refresh()
    it.close()
