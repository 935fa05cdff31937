"""Prioritized replay: proportional draws, weights, updates, lag, bad input, checkpoints."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    p = str(tmp_path_factory.mktemp("per") / "s")
    ids = np.arange(100, dtype=np.int64)
    gr.write_npy(p, {"id": ids, "obs": ids[:, None].astype(np.float32) * np.ones(3, np.float32)})
    return p


def _loader(path: str, **kwargs: Any) -> Any:
    args: dict[str, Any] = dict(batch_size=8, sampling=gr.PrioritizedReplay(alpha=1.0, beta=0.5))
    args.update(kwargs)
    return gr.make_data_loader(gr.NpyDataSource(path), **args)


def test_batches_are_sampled_tuples_of_rows_index_weight(path: str) -> None:
    batch = next(iter(_loader(path)))
    assert isinstance(batch, gr.Sampled)
    assert batch.index.dtype == np.int64 and batch.weight.dtype == np.float32
    np.testing.assert_array_equal(batch.data["id"], batch.index)
    np.testing.assert_array_equal(batch.weight, 1.0)  # all rows start at the max priority


def test_draws_are_proportional_and_weights_follow_schaul(path: str) -> None:
    it = iter(_loader(path, batch_size=50))
    seen = np.zeros(100, bool)
    while not seen.all():  # every row handed out once, so that all may be updated
        seen[next(it).index] = True
    priorities = np.arange(100, dtype=np.float64) + 1
    it.update_priorities(np.arange(100), priorities)
    counts = np.zeros(100)
    batch = None
    for _ in range(400):
        batch = next(it)
        counts += np.bincount(batch.index, minlength=100)
    p = (priorities + 1e-6) / (priorities + 1e-6).sum()
    expected = p * counts.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 160, chi2  # 99 degrees of freedom; p < 1e-4 above 150
    assert batch is not None
    want = ((1 + 1e-6) / (priorities[batch.index] + 1e-6)) ** 0.5
    np.testing.assert_allclose(batch.weight, want, rtol=1e-5)


def test_beta_schedule_of_the_step(path: str) -> None:
    sampling = gr.PrioritizedReplay(alpha=1.0, eps=0.0, beta=lambda step: 0.1 * step)
    it = iter(_loader(path, sampling=sampling, batch_size=100))
    first = next(it)
    while len(np.unique(first.index)) < 100:  # hand out every row once
        first = gr.Sampled(None, np.union1d(first.index, next(it).index), first.weight)
    it.update_priorities(np.arange(100), np.linspace(1, 5, 100))
    for _ in range(2):
        step = it.position
        batch = next(it)
        want = (1.0 / np.linspace(1, 5, 100)[batch.index]) ** (0.1 * step)
        np.testing.assert_allclose(batch.weight, want, rtol=1e-6)


def test_new_rows_get_the_largest_priority(tmp_path: Path) -> None:
    path = str(tmp_path / "g")
    with gr.ReplayWriter(path, format="npy") as writer:
        writer.append({"id": np.arange(10, dtype=np.int64)})
        writer.flush()
        it = iter(
            gr.make_data_loader(
                gr.NpyDataSource(path),
                batch_size=10,
                sampling=gr.PrioritizedReplay(alpha=1.0, eps=0.0, refresh_every=None),
            )
        )
        batch = next(it)
        it.update_priorities(batch.index, np.where(batch.index == 3, 50.0, 0.0))
        writer.append({"id": np.arange(10, 20, dtype=np.int64)})
        writer.flush()
        it.refresh()
        counts = np.bincount(np.concatenate([next(it).index for _ in range(50)]), minlength=20)
    assert counts[:10].sum() == counts[3]  # the other old rows have priority 0
    assert (counts[10:] > 0).all()  # new rows: priority 50 each, like row 3
    assert 0.5 < counts[10:].mean() / counts[3] < 2.0


@pytest.mark.parametrize(
    ("bad_index", "bad_priorities", "error", "match"),
    [
        (None, [-1.0], gr.InvalidPriorityError, "finite and >= 0"),
        (None, [np.nan], gr.InvalidPriorityError, "finite and >= 0"),
        (None, [np.inf], gr.InvalidPriorityError, "finite and >= 0"),
        (None, "short", gr.InvalidPriorityError, "indices but"),
        ([10_000], [1.0], gr.PriorityIndexError, "never handed out"),
        ([-1], [1.0], gr.PriorityIndexError, "never handed out"),
        ("unseen", [1.0], gr.PriorityIndexError, "never handed out"),
        ([1.5], [1.0], gr.InvalidPriorityError, "integers"),
    ],
)
def test_bad_updates_raise_and_change_nothing(
    path: str, bad_index: Any, bad_priorities: Any, error: type[Exception], match: str
) -> None:
    it = iter(_loader(path, batch_size=4))
    batch = next(it)
    before = it.priority_state()
    index = batch.index[:1] if bad_index is None else np.asarray(bad_index)
    if isinstance(bad_index, str):
        index = np.setdiff1d(np.arange(100), batch.index)[:1]
    priorities = np.ones(3) if bad_priorities == "short" else np.asarray(bad_priorities)
    with pytest.raises(error, match=match):
        it.update_priorities(index, priorities)
    after = it.priority_state()
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key], err_msg=key)


def _rows_where_dominant(it: Any, steps: int, row: int) -> list[int]:
    out = []
    for step in range(steps):
        if (next(it).index == row).all():
            out.append(step)
    return out


@pytest.mark.parametrize(("workers", "buffer", "lag"), [(0, 2, 0), (2, 2, 3), (1, 3, 2)])
def test_an_update_reaches_draws_after_the_documented_lag(
    path: str, workers: int, buffer: int, lag: int
) -> None:
    with iter(_loader(path, worker_count=workers, worker_buffer_size=buffer)) as it:
        batches = [next(it) for _ in range(3)]
        row = int(batches[2].index[0])
        it.update_priorities([row], [1e12])  # after batch 2: stamped 3
        dominant = _rows_where_dominant(it, 10, row)
    assert dominant and dominant[0] == lag, dominant
    assert dominant == list(range(dominant[0], 10))


def _run(path: str, steps: int, **kwargs: Any) -> list[np.ndarray]:
    out = []
    with iter(_loader(path, **kwargs)) as it:
        for _ in range(steps):
            batch = next(it)
            out.append(batch.index.copy())
            it.update_priorities(batch.index, (batch.index % 5).astype(np.float64))
    return out


def test_draws_depend_on_seed_and_updates_only(path: str) -> None:
    a, b = _run(path, 15, worker_count=2), _run(path, 15, worker_count=2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    c = _run(path, 15, worker_count=2, seed=1)
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))


def _save(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    buf = io.BytesIO()
    np.savez(buf, **state)
    buf.seek(0)
    return dict(np.load(buf))


@pytest.mark.parametrize("workers", [0, 2])
def test_checkpoint_resumes_identically(path: str, workers: int) -> None:
    with iter(_loader(path, worker_count=workers)) as it:
        for _ in range(5):
            batch = next(it)
            it.update_priorities(batch.index, batch.index.astype(np.float64))
        state, priorities = it.get_state(), _save(it.priority_state())
        want = []
        for _ in range(6):
            batch = next(it)
            want.append((batch.index.copy(), batch.weight.copy()))
            it.update_priorities(batch.index, 1.0 + batch.index % 3)
    with iter(_loader(path, worker_count=workers)) as fresh:
        fresh.set_state(state)
        fresh.set_priority_state(priorities)
        for index, weight in want:
            batch = next(fresh)
            np.testing.assert_array_equal(batch.index, index)
            np.testing.assert_array_equal(batch.weight, weight)
            fresh.update_priorities(batch.index, 1.0 + batch.index % 3)


def test_priority_state_of_other_settings_is_refused(path: str) -> None:
    it = iter(_loader(path))
    next(it)
    state = it.priority_state()
    other = iter(_loader(path, sampling=gr.PrioritizedReplay(alpha=0.5)))
    with pytest.raises(gr.InvalidSamplingError, match="alpha"):
        other.set_priority_state(state)
    with pytest.raises(gr.InvalidSamplingError, match="Not a prioritized"):
        other.set_priority_state({})


def test_resume_with_another_worker_count_names_both_in_user_terms(path: str) -> None:
    with iter(_loader(path, worker_count=2)) as it:  # worker_buffer_size 2: 3 batches ahead
        next(it)
        state, priorities = it.get_state(), _save(it.priority_state())
    assert priorities["workers"].tolist() == [2, 2]
    fresh = iter(_loader(path, worker_count=0))
    with pytest.raises(gr.ReplayCheckpointError) as e:
        fresh.set_state(state)
    msg = str(e.value)
    for part in (
        "saved by a loader with worker_count=2 (worker_buffer_size=2)",
        "this loader has worker_count=0 (worker_buffer_size=2)",
        "Fix: resume with worker_count=2 and worker_buffer_size=2",
    ):
        assert part in msg, msg
    assert "lag" not in msg and "(alpha, eps" not in msg
    assert isinstance(e.value, gr.InvalidSamplingError) and isinstance(e.value, ValueError)
    with pytest.raises(gr.ReplayCheckpointError, match="worker_count=2 and"):
        fresh.set_priority_state(priorities)
    # a state saved before the worker settings were kept names what it can
    older = {k: v for k, v in priorities.items() if k != "workers"}
    with pytest.raises(gr.ReplayCheckpointError, match=r"worker_count \* worker_buffer_size = 4"):
        fresh.set_priority_state(older)
    # the same settings (or another pair reading as far ahead) resume
    with iter(_loader(path, worker_count=2)) as again:
        again.set_state(state)
        again.set_priority_state(priorities)
        next(again)
    fresh.close()


def test_priority_state_of_another_process_or_alpha_says_so(path: str) -> None:
    it = iter(_loader(path))
    next(it)
    state = it.priority_state()
    with pytest.raises(gr.ReplayCheckpointError, match=r"process 1 of 2; this is process 0"):
        iter(_loader(path)).set_priority_state({**state, "shard": np.array([1, 2])})
    other = iter(_loader(path, sampling=gr.PrioritizedReplay(alpha=0.5)))
    with pytest.raises(gr.ReplayCheckpointError, match=r"resume with PrioritizedReplay\(alpha=1"):
        other.set_priority_state(state)


def test_priority_state_from_another_position_is_refused_at_next(path: str) -> None:
    it = iter(_loader(path))
    next(it)
    old = it.get_state()
    for _ in range(80):  # past the draws kept for a consumer that reads ahead (64)
        next(it)
    newer = it.priority_state()
    fresh = iter(_loader(path))
    fresh.set_state(old)
    fresh.set_priority_state(newer)
    with pytest.raises(gr.InvalidSamplingError, match="same checkpoint"):
        next(fresh)


@pytest.mark.parametrize(
    "kwargs",
    [{"alpha": -1.0}, {"beta": 1.5}, {"eps": float("nan")}, {"alpha": "x"}, {"refresh_every": 0}],
)
def test_bad_options_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(gr.InvalidSamplingError):
        gr.PrioritizedReplay(**kwargs)


def test_replay_dataset_iterator_takes_updates_and_checkpoints(path: str) -> None:
    ds = gr.replay_dataset(
        gr.NpyDataSource(path), batch_size=8, sampling=gr.PrioritizedReplay(alpha=1.0)
    )
    it = iter(ds)
    batch = next(it)
    it.update_priorities(batch.index, np.full(8, 1e9))  # these rows dominate from now on
    state, priorities = it.get_state(), _save(it.priority_state())
    assert isinstance(state, dict)
    want = [next(it).index for _ in range(3)]
    assert all(np.isin(w, batch.index).all() for w in want)
    again = iter(ds)
    again.set_state(state)
    again.set_priority_state(priorities)
    for w in want:
        np.testing.assert_array_equal(next(again).index, w)


def test_an_edited_batch_index_is_checked_again_not_taken_for_the_drawn_rows(path: str) -> None:
    it = iter(_loader(path, batch_size=4))
    batch = next(it)
    never = np.setdiff1d(np.arange(100), batch.index)[0]
    before = it.priority_state()
    batch.index[1] = never  # the learner edits the array it got (a drawn batch no more)
    with pytest.raises(gr.PriorityIndexError, match=rf"rows \[{never}\] were never handed out"):
        it.update_priorities(batch.index, np.ones(4))
    np.testing.assert_array_equal(it.priority_state()["values"], before["values"])
    batch.index[1] = batch.data["id"][1]  # the drawn batch again: accepted
    it.update_priorities(batch.index, np.full(4, 5.0))
    next(it)
    values = it.priority_state()["values"]
    np.testing.assert_allclose(values[batch.index], 5.0 + 1e-6)


def _zero_every_row(it: Any, rows: int) -> None:
    """Draws and sets priority 0 (eps=0) until every one of ``rows`` rows is at 0."""
    zeroed: set[int] = set()
    for _ in range(200):
        batch = next(it)
        it.update_priorities(batch.index, np.zeros(len(batch.index)))
        zeroed.update(batch.index.tolist())
        if len(zeroed) == rows:
            return
    raise AssertionError(f"only {len(zeroed)} of {rows} rows drawn")


@pytest.mark.parametrize("bounded", [False, True])
def test_every_priority_zero_draws_uniformly_with_weights_one(
    tmp_path: Path, bounded: bool
) -> None:
    path = str(tmp_path / "s")
    ids = np.arange(24, dtype=np.int64)
    if bounded:  # capacity 16: rows 8..23 live, 0..7 evicted
        with gr.ReplayWriter(path, "npy", capacity=16, segment_rows=8) as w:
            w.append({"id": ids})
    else:
        gr.write_npy(path, {"id": ids[:16]})
    live = set(range(8, 24)) if bounded else set(range(16))
    sampling = gr.PrioritizedReplay(alpha=0.6, eps=0.0, beta=0.4)
    it = iter(gr.make_data_loader(gr.open_source(path), batch_size=4, sampling=sampling))
    batch = next(it)
    it.update_priorities(batch.index, np.zeros(4))  # some rows at 0: weights stay positive
    batch = next(it)
    assert (batch.weight > 0).all(), batch.weight
    _zero_every_row(it, 16)
    counts = dict.fromkeys(live, 0)
    for _ in range(200):  # 800 rows drawn, 50 a row expected
        batch = next(it)
        np.testing.assert_array_equal(batch.weight, np.ones(4, np.float32))
        got = np.asarray(batch.data["id"])
        if not bounded:  # a plain store's index is the row
            np.testing.assert_array_equal(got, batch.index)
        for i in got.tolist():
            counts[i] += 1  # a KeyError: an evicted row
    assert min(counts.values()) >= 25 and max(counts.values()) <= 75, counts
    # a priority given again leaves the uniform draw: only that row is drawn
    it.update_priorities(batch.index[:1], np.ones(1))
    again = next(it)
    assert set(np.asarray(again.data["id"]).tolist()) == {int(np.asarray(batch.data["id"])[0])}
    it.close()


def test_empty_store_still_says_it_has_no_rows(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    w = gr.ReplayWriter(path, "npy", capacity=16)
    w.append({"id": np.arange(4, dtype=np.int64)})  # pending, never committed
    loader = gr.make_data_loader(
        gr.open_source(path), batch_size=4, sampling=gr.PrioritizedReplay(eps=0.0)
    )
    with pytest.raises(gr.InvalidSamplingError, match=r"has no live rows.*Fix"):
        next(iter(loader))
    w.close()
