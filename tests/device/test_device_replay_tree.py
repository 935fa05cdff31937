"""gr.DeviceReplay's sum and min trees of 128-wide lines: sums, draws, updates, refreshes."""

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
from grain_replay.device import replay_draws as draws
from grain_replay.device import replay_tree as tree
from grain_replay.device.replay_state import StateLayout

C = 40_000  # three levels: 313 lines, 3, 1
ALPHA, EPS, BETA = 0.6, 0.01, 0.4


def _reference(priority: np.ndarray, live: np.ndarray) -> tuple[list[Any], list[Any]]:
    """Each level's sums and mins (float64), flat, without padding."""
    mass = np.where(live, (priority.astype(np.float64) + EPS) ** ALPHA, 0.0)
    sums, mins = [mass], [np.where(live, mass, np.inf)]
    while len(sums[-1]) > 128:  # the top: one line
        pad = -len(sums[-1]) % 128
        sums.append(np.pad(sums[-1], (0, pad)).reshape(-1, 128).sum(1))
        mins.append(np.pad(mins[-1], (0, pad), constant_values=np.inf).reshape(-1, 128).min(1))
    return sums, mins


def _assert_trees(sums: Any, mins: Any, priority: np.ndarray, live: np.ndarray) -> None:
    want_s, want_m = _reference(priority, live)
    assert len(sums) == len(want_s) and len(mins) == len(want_s) - 1
    for level, (got, want) in enumerate(zip(sums, want_s, strict=True)):
        got = np.asarray(got).reshape(-1)
        np.testing.assert_allclose(got[: len(want)], want, rtol=2e-6, err_msg=f"sums {level}")
        assert (got[len(want) :] == 0).all()
    level0 = np.asarray(sums[0]).reshape(-1)
    assert (np.signbit(level0[: len(live)]) == ~live).all()  # -0.0: empty
    for level, (got, want) in enumerate(zip(mins, want_m[1:], strict=True), 1):
        got = np.asarray(got).reshape(-1)
        np.testing.assert_allclose(got[: len(want)], want, rtol=2e-6, err_msg=f"mins {level}")


def _ring(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    live = rng.random(C) < 0.7
    priority = np.where(live, rng.uniform(0, 4, C), 0.0).astype(np.float32)
    return priority, live


def test_levels_per_capacity() -> None:
    assert tree.level_lines(1) == [1]
    assert tree.level_lines(128) == [1]
    assert tree.level_lines(129) == [2, 1]
    assert tree.level_lines(1 << 20) == [8192, 64, 1]
    assert tree.level_lines(128**3) == [16384, 128, 1]
    assert tree.level_lines(128**3 + 1) == [16385, 129, 2, 1]


@pytest.mark.parametrize(
    "dense, one_hot",
    [(True, True), (True, False), (False, False)],
    ids=["one-hot-rebuilt", "scatter-rebuilt", "scatter-touched-lines"],
)
def test_tree_sums_and_mins_follow_updates_with_the_last_of_a_repeated_slot(
    dense: bool, one_hot: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every way an update sets entries and recomputes the levels above (by the ring's size)
    monkeypatch.setattr(tree, "DENSE_SLOTS", 1 << 30 if dense else 0)
    monkeypatch.setattr(tree, "ONE_HOT_LINES", 1 << 30 if one_hot else 0)
    priority, live = _ring(0)
    sums, mins = jax.jit(tree.build, static_argnums=(2, 3))(priority, live, ALPHA, EPS)
    _assert_trees(sums, mins, priority, live)
    # a function of its own: jax's trace cache is keyed by the function, not the jit
    at = StateLayout(C, 1, prioritized=True)
    update = jax.jit(lambda *a: draws.updated_priorities(a[0], at, *a[1:], ALPHA, EPS))
    mass = jax.jit(at.mass)(jnp.asarray(priority), jnp.float32(1.0), sums, mins)
    top = 1.0
    rng = np.random.default_rng(1)
    for _ in range(5):
        index = rng.integers(-1, C + 5, 256).astype(np.int32)
        index[::9] = index[0]  # one slot many times: the last one wins
        index[100:120] = rng.integers(0, 256, 20)  # many in one line
        given = rng.uniform(0, 9, 256).astype(np.float32)
        given[5], given[6] = np.nan, -1.0
        mass = update(mass, jnp.asarray(live), index, given)
        for i, g in zip(index, given, strict=True):  # the host rule, in order
            if 0 <= i < C and live[i] and np.isfinite(g) and g >= 0:
                priority[i] = g
                top = max(top, float(g))
        np.testing.assert_array_equal(np.asarray(at.priority(mass)), priority)
        assert float(mass[at.lines, 0]) == top
        sums, mins = at.sums(mass), at.mins(mass)
        _assert_trees(sums, mins, priority, live)
    rebuilt = tree.build(at.priority(mass), jnp.asarray(live), ALPHA, EPS)
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves((sums, mins)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6)


def _last_of_each(index: np.ndarray, ok: np.ndarray) -> np.ndarray:
    n = len(index)
    return np.array(
        [ok[i] and not (ok[i + 1 :] & (index[i + 1 :] == index[i])).any() for i in range(n)]
    )


@pytest.mark.parametrize("n", [1000, 3000])  # pairwise; sorted (over 2048)
def test_last_of_each_keeps_the_last_valid_entry_of_a_slot(n: int) -> None:
    rng = np.random.default_rng(2)
    index = rng.integers(0, n // 6, n).astype(np.int32)
    ok = rng.random(n) < 0.8
    got = np.asarray(draws.last_of_each(jnp.asarray(index), jnp.asarray(ok)))
    np.testing.assert_array_equal(got, _last_of_each(index, ok))


def test_prioritized_frequencies_follow_the_masses_over_three_levels() -> None:
    rng = np.random.default_rng(3)
    live = np.zeros(C, bool)
    live[rng.choice(C, 300, replace=False)] = True  # spread over the lines
    priority = np.where(live, rng.uniform(0, 4, C), 0.0).astype(np.float32)
    priority[np.flatnonzero(live)[:20]] = 0.0  # eps keeps them drawable
    sums, mins = tree.build(jnp.asarray(priority), jnp.asarray(live), ALPHA, EPS)
    sample = jax.jit(lambda k: draws.prioritized(k, sums, mins, 512, BETA))
    slots, weights = zip(
        *(sample(k) for k in jax.random.split(jax.random.key(0), 400)), strict=True
    )
    slots, weights = np.concatenate(slots), np.concatenate(weights)
    assert live[slots].all()  # never an empty slot
    mass = (priority.astype(np.float64) + EPS) ** ALPHA
    expected = mass[live] / mass[live].sum() * len(slots)
    counts = np.bincount(slots, minlength=C)[live]
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 299 + 6 * np.sqrt(2 * 299)  # 299 degrees of freedom
    want = (mass[live].min() / mass[slots]) ** BETA
    np.testing.assert_allclose(weights, want, rtol=2e-6)


def test_a_ring_with_no_mass_draws_minus_one() -> None:
    sums, mins = tree.build(jnp.zeros(300), jnp.zeros(300, bool), ALPHA, EPS)
    slots, weights = draws.prioritized(jax.random.key(0), sums, mins, 8, BETA)
    assert (np.asarray(slots) == -1).all() and (np.asarray(weights) == 0).all()


def _rows(start: int, n: int) -> dict[str, np.ndarray]:
    seq = np.arange(start, start + n)
    return {"seq": seq.astype(np.int32), "obs": (seq[:, None] + np.arange(3.0)).astype(np.float32)}


@pytest.mark.parametrize("capacity", [None, 200])
def test_trees_and_weights_through_refreshes_with_evictions(
    tmp_path: Path, capacity: int | None
) -> None:
    """A bounded two-writer store evicts; the trees match the live slots' priorities, draws
    are live, weights use p_min over the live slots only."""
    path = str(tmp_path / "bounded")
    opts = gr.PrioritizedReplay(alpha=ALPHA, beta=BETA, eps=EPS)
    writers = {}
    for wid in ("a", "b"):
        writers[wid] = gr.ReplayWriter(path, "npy", capacity=150, writer_id=wid)
        writers[wid].append(_rows(0 if wid == "a" else 10**6, 100))
        writers[wid].flush()
    try:
        replay = gr.DeviceReplay(path, sampling=opts, capacity=capacity)
        state = replay.init()
        step = jax.jit(
            lambda s, k: (
                lambda b: (replay.update_priorities(s, b.index, b.data["obs"][:, 0] % 7), b)
            )(replay.sample(s, k, 64))
        )
        rng = np.random.default_rng(4)
        for rnd in range(1, 6):
            for i, w in enumerate(writers.values()):
                w.append(_rows(10**6 * i + 100 * rnd, int(rng.integers(30, 90))))
                w.flush()
            state = replay.refresh(state)
            for t in range(3):
                state, batch = step(state, jax.random.key(10 * rnd + t))
                live = np.asarray(replay.view(state).live)
                assert live[np.asarray(batch.index)].all()
            priority = np.asarray(replay.view(state).priority)
            _assert_trees(replay.view(state).sums, replay.view(state).mins, priority, live)
            batch = replay.sample(state, jax.random.key(rnd), 128)
            mass = (priority.astype(np.float64) + EPS) ** ALPHA
            want = (mass[live].min() / mass[np.asarray(batch.index)]) ** BETA
            np.testing.assert_allclose(np.asarray(batch.weight), want, rtol=2e-6)
            held = replay.source.read_ids(replay.row_ids(state, np.asarray(batch.index)))
            np.testing.assert_array_equal(np.asarray(batch.data["seq"]), held["seq"])
    finally:
        for w in writers.values():
            w.close()


@pytest.mark.parametrize("n", [1, 5, 300])
def test_set_entries_by_matmul_is_the_scatter_bit_for_bit(
    n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(4)
    blocks = [
        jnp.asarray(np.where(rng.random((n, 128)) < 0.3, -0.0, rng.random((n, 128)) * 1e3)).astype(
            jnp.float32
        )
        for _ in range(2)
    ]
    slots = rng.choice(n * 128, min(256, n * 128), replace=False).astype(np.int32)
    b = len(slots)
    ok = rng.random(b) < 0.8
    values = [
        # every normal magnitude float32 has (a subnormal one may come out 0: flushed, as
        # a TPU's arithmetic does anyway), zero, the smallest normal and nearly the largest
        ((0.5 + rng.random(b) / 2) * 2.0 ** rng.integers(-125, 128, b)).astype(np.float32),
        np.concatenate([[0.0, 1.1754944e-38, 3.4e38], rng.random(b - 3)])[:b].astype(np.float32),
    ]
    values[0][~ok] = np.nan  # skipped entries' values never reach the blocks
    args = (jnp.asarray(slots // 128), jnp.asarray(slots % 128))
    vals = [jnp.asarray(v) for v in values]
    monkeypatch.setattr(tree, "ONE_HOT_LINES", 1 << 30)
    got = tree.set_entries(blocks, *args, vals, jnp.asarray(ok))
    monkeypatch.setattr(tree, "ONE_HOT_LINES", 0)
    want = tree.set_entries(blocks, *args, vals, jnp.asarray(ok))
    for g, w, blk in zip(got, want, blocks, strict=True):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint32), np.asarray(w).view(np.uint32))
        untouched = np.ones((n, 128), bool)
        untouched[slots[ok] // 128, slots[ok] % 128] = False
        np.testing.assert_array_equal(  # -0.0 (an empty slot) kept, sign bit included
            np.asarray(g).view(np.uint32)[untouched], np.asarray(blk).view(np.uint32)[untouched]
        )


def test_a_priority_whose_mass_overflows_is_skipped_not_an_infinite_total() -> None:
    at = StateLayout(300, 1, prioritized=True)
    live = jnp.ones(300, bool)
    priority = jnp.ones(300, jnp.float32)
    sums, mins = tree.build(priority, live, 2.0, 0.0)
    mass = at.mass(priority, jnp.float32(1.0), sums, mins)
    index = jnp.asarray([3, 4], jnp.int32)
    mass = draws.updated_priorities(mass, at, live, index, jnp.asarray([1e30, 2.0]), 2.0, 0.0)
    assert float(at.priority(mass)[3]) == 1.0  # skipped: (1e30) ** 2 is past float32
    assert float(at.priority(mass)[4]) == 2.0
    assert float(at.sums(mass)[-1].sum()) == 299.0 + 4.0


def test_entries_are_set_by_matmul_on_a_tpu_only_and_up_to_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert tree.ONE_HOT_LINES is None  # the default: by the backend
    calls: list[str] = []
    real_dot = jax.lax.dot_general
    monkeypatch.setattr(
        jax.lax, "dot_general", lambda *a, **k: calls.append("dot") or real_dot(*a, **k)
    )
    args = (
        jnp.asarray([1], jnp.int32),
        jnp.asarray([2], jnp.int32),
        [jnp.ones(1)],
        jnp.ones(1, bool),
    )
    for backend, lines, want in (("cpu", 4, []), ("tpu", 4, ["dot"]), ("tpu", 4096, [])):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        block = [jnp.zeros((lines, 128), jnp.float32)]
        calls.clear()
        (out,) = tree.set_entries(block, *args[:2], args[2], args[3])
        assert calls == want, (backend, lines)
        assert float(out[1, 2]) == 1.0 and float(out.sum()) == 1.0
