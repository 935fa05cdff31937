"""gr.DeviceReplay: a store's live rows in a device ring, sampled inside jax.jit."""

from __future__ import annotations

import os

# Must precede the first jax import: 8 fake CPU devices, as `make test` runs.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.device.replay_state import DeviceReplayState

N = 120


def _rows(start: int, n: int, rng: np.random.Generator | None = None) -> dict[str, Any]:
    """Transitions whose every leaf says which row they are (``seq``), of every dtype kind."""
    rng = rng or np.random.default_rng(start)
    seq = np.arange(start, start + n)
    return {
        "obs": {"vec": (seq[:, None] + np.arange(5) / 10).astype(np.float32)},
        "pixels": rng.integers(0, 255, (n, 6, 6, 3), dtype=np.uint8),
        "action": seq.astype(np.int32),
        "reward": (seq * 0.5).astype(np.float64),  # float32 on the device
        "done": seq % 3 == 0,
        "seq": seq.astype(np.int64),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("device_replay") / "store")
    gr.write(path, _rows(0, N))
    return path


def _host(replay: gr.DeviceReplay, ids: np.ndarray) -> Any:
    src = replay.source
    if isinstance(src, gr.PartsDataSource):
        return src.read_ids(ids)
    return src.read_batch(ids)


def _assert_matches_host(replay: gr.DeviceReplay, state: Any, batch: Any) -> None:
    ids = replay.row_ids(state, np.asarray(batch.index))
    assert (ids >= 0).all()
    want = _host(replay, ids)
    got = jax.tree.map(np.asarray, batch.data)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        w = np.asarray(w, dtype=jax.dtypes.canonicalize_dtype(w.dtype))
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def _counts(replay: gr.DeviceReplay, state: Any, draws: int, batch: int = 500) -> np.ndarray:
    sample = jax.jit(lambda s, k: replay.sample(s, k, batch).index)
    keys = jax.random.split(jax.random.key(3), draws // batch)
    index = np.concatenate([np.asarray(sample(state, k)) for k in keys])
    return np.bincount(index, minlength=replay.capacity)


# -- values, order, distributions -------------------------------------------------------


@pytest.mark.parametrize("prioritized", [False, True])
def test_sample_gives_the_host_rows_inside_jit(store: str, prioritized: bool) -> None:
    sampling = gr.PrioritizedReplay() if prioritized else gr.UniformReplay()
    replay = gr.DeviceReplay(store, sampling=sampling)
    state = replay.init()
    batch = jax.jit(lambda s, k: replay.sample(s, k, 64))(state, jax.random.key(0))
    assert isinstance(batch, gr.Sampled)
    assert batch.index.dtype == jnp.int32 and batch.weight.dtype == jnp.float32
    assert batch.data["reward"].dtype == jnp.float32  # float64 on disk, as the host put gives
    _assert_matches_host(replay, state, batch)
    assert state.rows[0].devices() == {jax.devices()[0]}


def test_sample_is_a_function_of_the_key(store: str) -> None:
    replay = gr.DeviceReplay(store, sampling=gr.UniformReplay())
    state = replay.init()
    sample = jax.jit(lambda s, k: replay.sample(s, k, 32).index)
    a, b = sample(state, jax.random.key(1)), sample(state, jax.random.key(1))
    c = sample(state, jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(replay.sample(state, jax.random.key(1), 32).index, a)


def test_uniform_draws_spread_evenly_over_live_slots_only(store: str) -> None:
    replay = gr.DeviceReplay(store, sampling=gr.UniformReplay(), capacity=2 * N)
    state = replay.init()
    counts = _counts(replay, state, 60_000)
    assert counts[N:].sum() == 0  # never an empty slot
    expected = 60_000 / N
    chi2 = ((counts[:N] - expected) ** 2 / expected).sum()
    assert chi2 < 2 * N  # N-1 degrees of freedom: mean ~N, far below 2N


def test_prioritized_draws_follow_priorities_and_weights_follow_the_formula(store: str) -> None:
    opts = gr.PrioritizedReplay(alpha=0.7, beta=0.5, eps=0.01)
    replay = gr.DeviceReplay(store, sampling=opts)
    state = replay.init()
    prio = np.random.default_rng(0).uniform(0, 4, N).astype(np.float32)
    prio[:10] = 0.0
    update = jax.jit(replay.update_priorities)
    state = update(state, jnp.arange(N, dtype=jnp.int32), jnp.asarray(prio))
    assert float(replay.view(state).max_priority) == pytest.approx(prio.max())
    p = (prio.astype(np.float64) + opts.eps) ** opts.alpha
    counts = _counts(replay, state, 100_000)
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq, p / p.sum(), atol=0.004)
    batch = replay.sample(state, jax.random.key(5), 256)
    want = (p.min() / p[np.asarray(batch.index)]) ** opts.beta
    np.testing.assert_allclose(np.asarray(batch.weight), want, rtol=1e-5)
    annealed = jax.jit(lambda s, k, b: replay.sample(s, k, 256, beta=b))(
        state, jax.random.key(5), 1.0
    )
    np.testing.assert_allclose(
        np.asarray(annealed.weight), p.min() / p[np.asarray(annealed.index)], rtol=1e-5
    )


def test_update_priorities_inside_jit_skips_what_cannot_apply(store: str) -> None:
    replay = gr.DeviceReplay(store, sampling=gr.PrioritizedReplay(), capacity=N + 8)

    @jax.jit
    def step(state: Any, key: jax.Array) -> Any:
        batch = replay.sample(state, key, 16)
        return replay.update_priorities(state, batch.index, batch.data["reward"] + 2.0), batch

    state = replay.init()
    new, batch = step(state, jax.random.key(0))
    got = np.asarray(replay.view(new).priority)[np.asarray(batch.index)]
    np.testing.assert_allclose(got, np.asarray(batch.data["reward"]) + 2.0)
    bad = replay.update_priorities(
        new, jnp.array([-1, N + 3, 0, 1]), jnp.array([5.0, 5.0, jnp.nan, -1.0])
    )
    np.testing.assert_array_equal(
        np.asarray(replay.view(bad).priority), np.asarray(replay.view(new).priority)
    )


@pytest.mark.parametrize("prioritized", [False, True])
def test_the_state_is_its_row_buffers_and_two_arrays_its_view_names_every_part(
    store: str, prioritized: bool
) -> None:
    # a jitted step that takes and returns the state pays the host per array: few of them
    sampling = gr.PrioritizedReplay(alpha=0.6) if prioritized else gr.UniformReplay()
    replay = gr.DeviceReplay(store, sampling=sampling, capacity=300, max_writers=3)
    state = replay.init()
    assert len(jax.tree.leaves(state)) == len(state.rows) + 2
    assert state.book.dtype == jnp.int32 and state.mass.dtype == jnp.float32
    v = replay.view(state)
    for name in ("slot_hi", "slot_lo", "order", "live", "priority"):
        assert getattr(v, name).shape == (300,), name
    assert v.live.dtype == jnp.bool_ and int(v.live.sum()) == int(v.n_live) == N
    assert v.live_slots.shape == (3, 128) and v.mark_hi.shape == v.mark_lo.shape == (3,)
    assert sorted(np.asarray(v.live_slots).reshape(-1)[:N]) == list(np.flatnonzero(v.live))
    ids = replay.row_ids(state, np.arange(300))
    np.testing.assert_array_equal(ids[np.asarray(v.live)], np.arange(N))  # a plain store
    assert (ids[~np.asarray(v.live)] == -1).all() and (np.asarray(v.slot_hi)[N:] == -1).all()
    assert int(v.mark_lo[0]) == N and int(v.refreshes) == 1 and float(v.max_priority) == 1.0
    assert len(v.sums) == (2 if prioritized else 0) and len(v.mins) == len(v.sums) - prioritized
    with pytest.raises(gr.ArgumentTypeError, match="init"):
        replay.view({"book": state.book})


# -- refresh -------------------------------------------------------------------------------


def test_refresh_brings_in_a_growing_store_in_place_and_keeps_the_newest(tmp_path: Path) -> None:
    path = str(tmp_path / "grow")
    with gr.ReplayWriter(path, "npy") as w:
        w.append(_rows(0, 40))
        w.flush()
        replay = gr.DeviceReplay(path, sampling=gr.PrioritizedReplay(), capacity=100)
        state = replay.init()
        assert int(replay.view(state).n_live) == 40
        state = replay.update_priorities(state, jnp.array([0]), jnp.array([7.0]))
        shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
        for k in range(1, 6):
            w.append(_rows(40 * k, 40))
            w.flush()
            old = state
            state = replay.refresh(state)
            assert all(x.is_deleted() for x in jax.tree.leaves(old.rows))  # donated
            assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == shapes
        assert replay.refresh_traces == 1  # 40 new rows each time: compiled once
        ids = replay.row_ids(state, np.arange(100))
        np.testing.assert_array_equal(np.sort(ids), np.arange(140, 240))  # the newest 100
        held = np.asarray(replay.view(state).priority)
        assert (held == 7.0).all()  # new rows at the largest priority given so far
        batch = replay.sample(state, jax.random.key(0), 64)
        _assert_matches_host(replay, state, batch)
        assert replay.refresh(state) is state  # nothing new: the state as it was
        np.testing.assert_array_equal(replay.row_ids(state, [-1, 100, 0]), [-1, -1, ids[0]])


def _bounded(path: str, writers: dict[str, int], capacity: int) -> dict[str, Any]:
    out = {}
    for wid, start in writers.items():
        w = gr.ReplayWriter(path, "npy", capacity=capacity, writer_id=wid)
        w.append(_rows(start, 25))
        w.flush()
        out[wid] = w
    return out


def test_refresh_of_a_bounded_store_never_draws_an_evicted_row(tmp_path: Path) -> None:
    path = str(tmp_path / "bounded")
    writers = _bounded(path, {"a": 0, "b": 100_000}, capacity=50)
    try:
        replay = gr.DeviceReplay(path, sampling=gr.UniformReplay())
        assert replay.capacity == 100  # the writers' capacities
        state = replay.init()
        assert int(replay.view(state).n_live) == 50
        sample = jax.jit(lambda s, k: replay.sample(s, k, 256))
        for rnd in range(1, 5):
            for wid, w in writers.items():
                start = (0 if wid == "a" else 100_000) + 25 * rnd
                w.append(_rows(start, 25 if wid == "a" else 40))
                w.flush()
            state = replay.refresh(state)
            src = replay.source
            live = set(src.ids(np.arange(len(src))).tolist())
            held = replay.row_ids(state, np.flatnonzero(np.asarray(replay.view(state).live)))
            assert set(held.tolist()) <= live
            assert int(replay.view(state).n_live) == len(held)
            batch = sample(state, jax.random.key(rnd))
            drawn = replay.row_ids(state, np.asarray(batch.index))
            assert set(drawn.tolist()) <= live  # never an evicted row
            _assert_matches_host(replay, state, batch)
        assert int(replay.view(state).n_live) == 100  # both writers' newest 50
    finally:
        for w in writers.values():
            w.close()


def test_unbounded_many_writer_store_needs_a_capacity(tmp_path: Path) -> None:
    path = str(tmp_path / "unbounded")
    with gr.ReplayWriter(path, "npy", writer_id="a") as w:
        w.append(_rows(0, 10))
        w.flush()
        with pytest.raises(gr.InvalidArgumentError, match="capacity="):
            gr.DeviceReplay(path).init()
        replay = gr.DeviceReplay(path, capacity=16)
        state = replay.init()
        w.append(_rows(10, 30))
        w.flush()
        state = replay.refresh(state)
        assert sorted(replay.row_ids(state, np.arange(16)) & ((1 << 40) - 1)) == list(range(24, 40))


# -- checkpointing -------------------------------------------------------------------------


def test_orbax_round_trip_samples_the_same_and_refreshes_on(tmp_path: Path) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    path = str(tmp_path / "grow")
    with gr.ReplayWriter(path, "npy") as w:
        w.append(_rows(0, 30))
        w.flush()
        replay = gr.DeviceReplay(path, sampling=gr.PrioritizedReplay(), capacity=64)
        state = replay.init()
        state = replay.update_priorities(state, jnp.arange(5), jnp.arange(5.0) + 1)
        ckpt = tmp_path / "ckpt"
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(ckpt, state)
        fresh = gr.DeviceReplay(path, sampling=gr.PrioritizedReplay(), capacity=64)
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(ckpt, fresh.init())
        assert isinstance(restored, DeviceReplayState)
        key = jax.random.key(9)
        a, b = replay.sample(state, key, 32), fresh.sample(restored, key, 32)
        np.testing.assert_array_equal(a.index, b.index)
        np.testing.assert_array_equal(a.weight, b.weight)
        w.append(_rows(30, 20))
        w.flush()
        state, restored = replay.refresh(state), fresh.refresh(restored)
        for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert int(replay.view(restored).n_live) == 50


# -- errors ----------------------------------------------------------------------------------


def test_bad_arguments_raise_errors_naming_the_fix(store: str, tmp_path: Path) -> None:
    with pytest.raises(gr.ArgumentTypeError, match="UniformReplay"):
        gr.DeviceReplay(store, sampling="epochs")
    with pytest.raises(gr.InvalidSamplingError, match="beta must be a float"):
        gr.DeviceReplay(store, sampling=gr.PrioritizedReplay(beta=lambda s: 0.4))
    with pytest.raises(gr.InvalidSamplingError, match="samples_per_insert"):
        gr.DeviceReplay(store, sampling=gr.UniformReplay(samples_per_insert=1.0))
    for bad in (0, -3, 1.5, True):
        with pytest.raises(gr.InvalidArgumentError, match="capacity must be a positive int"):
            gr.DeviceReplay(store, capacity=bad)
    with pytest.raises(gr.InvalidArgumentError, match="below min_size"):
        gr.DeviceReplay(store, sampling=gr.UniformReplay(min_size=50), capacity=10).init()
    replay = gr.DeviceReplay(store)
    state = replay.init()
    for bad in (0, -1, 2.0):
        with pytest.raises(gr.InvalidArgumentError, match="batch_size"):
            replay.sample(state, jax.random.key(0), bad)
    with pytest.raises(gr.InvalidPriorityError, match="one priority per index"):
        replay.update_priorities(state, jnp.arange(3), jnp.ones(4))


def test_empty_store_is_refused_at_init_naming_the_path(tmp_path: Path) -> None:
    path = str(tmp_path / "empty")
    gr.write(path, {k: v[:0] for k, v in _rows(0, 1).items() if k != "obs"})
    with pytest.raises(gr.InvalidSamplingError, match=r"empty.* no committed rows.*ReplayWriter"):
        gr.DeviceReplay(path).init()


def test_a_state_of_another_replay_is_refused(store: str) -> None:
    small = gr.DeviceReplay(store, capacity=16)
    big = gr.DeviceReplay(store, capacity=32)
    state = small.init()
    with pytest.raises(gr.InvalidArgumentError, match="not one of this replay"):
        big.refresh(state)
    with pytest.raises(gr.InvalidArgumentError, match="not one of this replay"):
        jax.jit(big.update_priorities)(state, jnp.arange(2), jnp.ones(2))
    with pytest.raises(gr.ArgumentTypeError, match="init"):
        small.sample({"rows": 1}, jax.random.key(0), 4)
