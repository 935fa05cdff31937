"""Uniform replay over a (growing) store: draws, refresh, resume, workers."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sampling.draws import integers, uniforms


def _rows(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.int64)
    return {"id": ids, "obs": ids[:, None].astype(np.float32) * np.ones(4, np.float32)}


@pytest.fixture
def growing(tmp_path: Path) -> tuple[gr.ReplayWriter, str]:
    path = str(tmp_path / "replay")
    writer = gr.ReplayWriter(path, format="npy")
    writer.append(_rows(0, 50))
    writer.flush()
    yield writer, path
    writer.close()


def test_draws_are_a_function_of_seed_stream_step() -> None:
    a, b = uniforms(1, 0, 5, 100), uniforms(1, 0, 5, 100)
    np.testing.assert_array_equal(a, b)
    assert ((a >= 0) & (a < 1)).all()
    assert not np.array_equal(a, uniforms(1, 0, 6, 100))
    assert not np.array_equal(a, uniforms(1, 1, 5, 100))
    x = integers(0, 0, 0, 100_000, 7)
    assert x.min() == 0 and x.max() == 6
    assert abs(np.bincount(x).std() / np.bincount(x).mean()) < 0.05  # uniform enough
    assert integers(0, 0, 0, 10, 2**40).max() < 2**40


def test_uniform_reads_committed_rows_and_grows(growing: tuple[gr.ReplayWriter, str]) -> None:
    writer, path = growing
    it = iter(
        gr.make_data_loader(
            gr.NpyDataSource(path), batch_size=32, sampling=gr.UniformReplay(refresh_every=None)
        )
    )
    first = np.concatenate([next(it)["id"] for _ in range(20)])
    assert first.max() < 50 and len(np.unique(first)) > 40
    writer.append(_rows(50, 150))
    writer.flush()
    assert np.concatenate([next(it)["id"] for _ in range(5)]).max() < 50  # not looked yet
    it.refresh()
    later = np.concatenate([next(it)["id"] for _ in range(20)])
    assert later.max() >= 50 and (later >= 50).mean() > 0.5  # 150 of 200 rows are new


def test_refresh_every_looks_on_its_own(growing: tuple[gr.ReplayWriter, str]) -> None:
    writer, path = growing
    it = iter(
        gr.make_data_loader(
            gr.NpyDataSource(path), batch_size=16, sampling=gr.UniformReplay(refresh_every=4)
        )
    )
    next(it)
    writer.append(_rows(50, 1000))
    writer.flush()
    ids = [next(it)["id"] for _ in range(6)]  # steps 1..6: step 4 looks
    assert max(x.max() for x in ids[:3]) < 50 and min(x.max() for x in ids[3:]) >= 50


def test_uniform_resume_and_workers_give_identical_batches(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    gr.write_npy(path, _rows(0, 300))
    args = dict(batch_size=16, sampling=gr.UniformReplay(), seed=7)
    plain = iter(gr.make_data_loader(gr.NpyDataSource(path), **args))
    with iter(gr.make_data_loader(gr.NpyDataSource(path), worker_count=2, **args)) as workers:
        for _ in range(6):
            np.testing.assert_array_equal(next(plain)["id"], next(workers)["id"])
        state = workers.get_state()
        want = [next(workers)["id"] for _ in range(4)]
    fresh = iter(gr.make_data_loader(gr.NpyDataSource(path), **args))
    fresh.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(fresh)["id"], w)


def test_workers_see_rows_the_consumer_saw(growing: tuple[gr.ReplayWriter, str]) -> None:
    writer, path = growing
    loader = gr.make_data_loader(
        gr.NpyDataSource(path),
        batch_size=64,
        sampling=gr.UniformReplay(refresh_every=None),
        worker_count=1,
        worker_buffer_size=1,
    )
    with iter(loader) as it:
        next(it)  # the worker's copy of the source has 50 rows
        writer.append(_rows(50, 500))
        writer.flush()
        it.refresh()
        ids = np.concatenate([next(it)["id"] for _ in range(3)])
    assert ids.max() >= 50  # read by the worker after it looked for the new rows


def test_empty_store_is_refused_clearly(tmp_path: Path) -> None:
    class Empty:
        def __len__(self) -> int:
            return 0

        def read_batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
            raise AssertionError("never read")

    it = iter(gr.make_data_loader(Empty(), batch_size=4, sampling=gr.UniformReplay()))
    with pytest.raises(gr.InvalidSamplingError, match="no committed rows"):
        next(it)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_refresh_every_is_refused(bad: object) -> None:
    with pytest.raises(gr.InvalidSamplingError, match="refresh_every"):
        gr.UniformReplay(refresh_every=bad)  # type: ignore[arg-type]


def test_sampling_of_unknown_kind_and_mixture_args_are_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "s")
    gr.write_npy(path, _rows(0, 10))
    src = gr.NpyDataSource(path)
    with pytest.raises(gr.InvalidSamplingError, match="sampling must be"):
        gr.make_data_loader(src, batch_size=4, sampling="uniform")
    with pytest.raises(gr.InvalidSamplingError, match="mixture"):
        gr.make_data_loader(src, batch_size=4, sampling=gr.UniformReplay(), weights={"a": 1})
    with pytest.raises(gr.InvalidSamplingError, match="replays one source"):
        gr.make_data_loader({"a": src}, batch_size=4, sampling=gr.PrioritizedReplay())
    it = iter(gr.make_data_loader(src, batch_size=4, sampling=gr.UniformReplay()))
    with pytest.raises(gr.InvalidSamplingError, match="PrioritizedReplay"):
        it.update_priorities(np.zeros(1, np.int64), np.ones(1))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"batch_size": 0}, ValueError),
        ({"batch_size": 2.5}, TypeError),
        ({"seed": -1}, ValueError),
        ({"seed": True}, TypeError),
    ],
)
def test_bad_batch_size_or_seed_is_refused(
    tmp_path: Path, kwargs: dict[str, object], error: type[Exception]
) -> None:
    path = str(tmp_path / "s")
    gr.write_npy(path, _rows(0, 10))
    args: dict[str, object] = {"batch_size": 4, "sampling": gr.UniformReplay(), **kwargs}
    with pytest.raises(error) as e:
        gr.make_data_loader(gr.NpyDataSource(path), **args)  # type: ignore[arg-type]
    assert isinstance(e.value, gr.GrainReplayError)


@pytest.mark.parametrize("seed", [0, 7, 2**64 - 1])
def test_block_draws_equal_the_functions_in_any_order(seed: int) -> None:
    from grain_replay.sampling.draws import BLOCK, Draws

    draws = Draws(seed, 3, 64)
    steps = [0, 1, BLOCK - 1, BLOCK, 5, 3 * BLOCK + 2, 2**40 + 1, 0]
    for step in steps:
        for n in (1, 7, 1_000_003, 2**33):
            np.testing.assert_array_equal(draws.integers(step, n), integers(seed, 3, step, 64, n))
            # the first c numbers of a full draw are those of a draw of c (a mixture's share)
            np.testing.assert_array_equal(
                draws.integers(step, n)[:5], integers(seed, 3, step, 5, n)
            )
        np.testing.assert_array_equal(draws.uniforms(step), uniforms(seed, 3, step, 64))
    with pytest.raises(ValueError, match="positive"):
        draws.integers(0, 0)


def test_a_commit_within_the_same_clock_tick_is_still_seen(
    growing: tuple[gr.ReplayWriter, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two commits may leave one mtime; a stamp seen within a tick is confirmed once after it."""
    from grain_replay.sampling import store_length

    writer, path = growing
    length = store_length.StoreLength(gr.NpyDataSource(path), refresh_every=1)
    st = os.stat(path)
    monkeypatch.setattr(store_length, "_stamp", lambda p: (123_456_789, st.st_size, st.st_ino))
    now = [123_456_789 + 1_000]  # within the tick of the frozen mtime
    monkeypatch.setattr(store_length.time, "time_ns", lambda: now[0])
    assert length.at(1) == 50  # first look
    writer.append(_rows(50, 10))
    writer.flush()  # a second commit, same stamp
    assert length.at(2) == 50  # within the tick: the stamp is not trusted yet, but not re-read
    now[0] += 10**9  # the tick has passed: one confirming look
    assert length.at(3) == 60
    writer.append(_rows(60, 10))
    writer.flush()
    assert length.at(4) == 60  # settled stamp, unchanged: no look


@pytest.mark.parametrize("sampling", [gr.UniformReplay(), gr.PrioritizedReplay()])
def test_shuffle_false_with_replay_sampling_is_refused(tmp_path: Path, sampling: object) -> None:
    path = str(tmp_path / "s")
    gr.write_npy(path, _rows(0, 16))
    src = gr.open_source(path)
    name = type(sampling).__name__
    for make in (gr.make_data_loader, gr.replay_dataset):
        with pytest.raises(gr.InvalidSamplingError) as e:
            make(src, batch_size=4, shuffle=False, sampling=sampling)
        msg = str(e.value)
        assert isinstance(e.value, ValueError)
        assert f"shuffle=False with sampling={name}" in msg and "Fix: drop shuffle=" in msg
    # the default (and an explicit True) draw as before
    batch = next(iter(gr.make_data_loader(src, batch_size=4, shuffle=True, sampling=sampling)))
    assert len(batch.index if isinstance(batch, gr.Sampled) else batch["id"]) == 4


def test_shuffle_false_refused_for_a_replay_mixture_kept_for_epochs(tmp_path: Path) -> None:
    paths = [str(tmp_path / n) for n in ("a", "b")]
    for i, p in enumerate(paths):
        gr.write_npy(p, _rows(100 * i, 8))
    mix = {"a": gr.open_source(paths[0]), "b": gr.open_source(paths[1])}
    weights = {"a": 1.0, "b": 1.0}
    with pytest.raises(gr.InvalidSamplingError, match="shuffle=False with sampling=Uniform"):
        gr.make_data_loader(
            mix, batch_size=4, shuffle=False, weights=weights, sampling=gr.UniformReplay()
        )
    ordered = gr.make_data_loader(mix, batch_size=4, shuffle=False, weights=weights)
    np.testing.assert_array_equal(next(iter(ordered))["id"], [0, 1, 100, 101])
