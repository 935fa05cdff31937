"""The one 'sort by group, cut into runs' helper every reader groups its rows with."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grain_replay.sources.reading.chunked import SegmentedReader
from grain_replay.sources.reading.runs import group_runs, runs


def test_runs_groups_positions_by_key_in_input_order() -> None:
    got = runs(np.array([3, 1, 3, 1, 2, 3]))
    assert [k for k, _ in got] == [1, 2, 3]
    assert [p.tolist() for _, p in got] == [[1, 3], [4], [0, 2, 5]]
    assert all(isinstance(k, int) for k, _ in got)


def test_runs_of_nothing_and_of_one_key() -> None:
    assert runs(np.zeros(0, np.int64)) == []
    keys, order, bounds = group_runs(np.zeros(0, np.int64))
    assert len(keys) == 0 and len(order) == 0 and bounds.tolist() == [0]
    [(k, pos)] = runs(np.full(5, 7))
    assert k == 7 and pos.tolist() == [0, 1, 2, 3, 4]


@given(st.lists(st.integers(-5, 40), max_size=200))
def test_group_runs_partitions_every_position_once(values: list[int]) -> None:
    keys = np.asarray(values, dtype=np.int64)
    run_keys, order, bounds = group_runs(keys)
    assert run_keys.tolist() == sorted(set(values))
    assert sorted(order.tolist()) == list(range(len(values)))
    assert len(bounds) == len(run_keys) + 1 and bounds[0] == 0 and bounds[-1] == len(values)
    for j, k in enumerate(run_keys.tolist()):
        pos = order[bounds[j] : bounds[j + 1]]
        assert pos.tolist() == [i for i, v in enumerate(values) if v == k]


@pytest.mark.parametrize("n", [0, 1, 300])
def test_segmented_reader_gathers_rows_across_segments(n: int) -> None:
    rows = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    starts = [0, 7, 8, 30]
    segments = [rows[a:b] for a, b in zip(starts, [*starts[1:], 40])]
    idx = np.random.default_rng(n).integers(0, 40, n)
    got = SegmentedReader(starts, segments).take(idx)
    np.testing.assert_array_equal(got, rows[idx])
