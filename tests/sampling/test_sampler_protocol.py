"""A new sampling mode registers its stream next to its options class: no edit elsewhere."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sampling.modes import Stream, StreamRequest, find_sampling, register_sampling


@dataclasses.dataclass(frozen=True)
class FirstRow:
    """A test mode: every row drawn is row 0."""


class _ReadRows:
    """Reads the drawn rows of one source (picklable, as a worker's reader must be)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self, rows: np.ndarray) -> Any:
        return self.source.read_batch(rows)


class _FirstRowStream:
    kind = "first_row"

    def __init__(self, source: Any, request: StreamRequest) -> None:
        self.reader = _ReadRows(source)
        self._request = request
        self.drawn = 0

    def describe(self) -> dict[str, Any]:
        return {**self._request.describe(), "sampling": "first_row"}

    def draw(self, step: int) -> tuple[Any, Any]:
        self.drawn = step + 1
        return np.zeros(self._request.batch_size, np.int64), None

    def state(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.drawn = int(state["drawn"])

    def finish(self, data: Any, extra: Any) -> Any:
        return data


def _first_row_stream(options: FirstRow, source: Any, request: StreamRequest) -> Stream:
    return _FirstRowStream(source, request)


register_sampling(FirstRow, stream=_first_row_stream)


@pytest.fixture
def source(tmp_path: Path) -> Any:
    path = str(tmp_path / "store")
    writer = gr.ReplayWriter(path, "npy")
    writer.append({"obs": np.arange(40, dtype=np.float32).reshape(20, 2)})
    writer.close()
    return gr.open_source(path)


def test_a_registered_mode_is_accepted_by_make_data_loader(source: Any) -> None:
    loader = gr.make_data_loader(source, batch_size=4, sampling=FirstRow(), worker_count=0)
    it = iter(loader)
    for _ in range(3):
        np.testing.assert_array_equal(next(it)["obs"], np.tile([[0.0, 1.0]], (4, 1)))
    state = it.get_state()
    again = iter(gr.make_data_loader(source, batch_size=4, sampling=FirstRow()))
    again.set_state(state)
    assert again.position == 3
    np.testing.assert_array_equal(next(again)["obs"][:, 0], np.zeros(4))


def test_a_registered_mode_serves_replay_dataset_and_matches_subclasses(source: Any) -> None:
    class Sub(FirstRow):
        pass

    assert find_sampling(Sub()) is find_sampling(FirstRow())
    it = iter(gr.replay_dataset(source, batch_size=2, sampling=Sub()))
    np.testing.assert_array_equal(next(it)["obs"], [[0.0, 1.0], [0.0, 1.0]])


def test_a_mode_without_a_mixture_factory_refuses_a_mixture(source: Any) -> None:
    with pytest.raises(gr.InvalidSamplingError, match="replays one source"):
        gr.make_data_loader(
            {"a": source, "b": source}, batch_size=2, weights={"a": 1, "b": 1}, sampling=FirstRow()
        )


def test_an_unknown_mode_is_refused_as_before(source: Any) -> None:
    with pytest.raises(
        gr.InvalidSamplingError,
        match=r"sampling must be 'epochs', gr.UniformReplay\(\) or gr.PrioritizedReplay\(\), "
        r"got 'uniform'\.",
    ):
        gr.make_data_loader(source, batch_size=2, sampling="uniform")
    with pytest.raises(ValueError, match="needs stream= or mixture="):
        register_sampling("nothing")
