"""Prioritized replay over bounded, many-writer stores: a sum-tree slot per live row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import pytest
from bounded_cases import FORMATS_AND_WORKERS
from parts_child import (
    check_rows,
    make_rows,
    open_writers,
    spawn_writer,
    tag_of,
    wait_for_commit,
)

import grain_replay as gr
from grain_replay.sampling.priority_slots import CHUNK, SlotPrioritySampler

SEQ = (1 << 40) - 1
CAP = 120


def _grow(ws: list[gr.ReplayWriter], rows: int) -> None:
    for i, w in enumerate(ws):
        w.append(make_rows(f"w{i}", w.committed, rows))
        w.flush()


def _named(batch: Any, ordinals: dict[int, int]) -> None:
    """Each row is whole and is the row its index names (writer and sequence number)."""
    data = {k: np.asarray(v) for k, v in batch.data.items()}
    check_rows(data)
    index = np.asarray(batch.index)
    ok = index >= 0
    np.testing.assert_array_equal(data["seq"][ok], index[ok] & SEQ)
    np.testing.assert_array_equal(data["tag"][ok], [ordinals[int(o)] for o in index[ok] >> 40])


def _sampler(path: str, **kwargs: Any) -> SlotPrioritySampler:
    options = gr.PrioritizedReplay(alpha=1.0, beta=1.0, eps=0.0, refresh_every=None)
    args: dict[str, Any] = {"seed": 0, "lag": 0, **kwargs}
    return SlotPrioritySampler(gr.open_source(path), options, 32, **args)


def _leaves(s: SlotPrioritySampler, ids: np.ndarray) -> np.ndarray:
    """The tree leaf of each id's slot (test-only: through the sampler's own lookup)."""
    slot = s.slots_of(ids)
    assert (slot >= 0).all()
    return s.leaves()[slot]


@pytest.mark.parametrize(("fmt", "workers"), FORMATS_AND_WORKERS)
def test_draws_only_live_rows_named_by_id_while_writers_evict(
    tmp_path: Path, fmt: str, workers: int
) -> None:
    path = str(tmp_path / "store")
    ws = open_writers(path, fmt)
    src = gr.open_source(path)
    tags = {src.writer_ordinals[f"w{i}"]: tag_of(f"w{i}") for i in range(2)}
    loader = gr.make_data_loader(
        src,
        batch_size=16,
        seed=1,
        sampling=gr.PrioritizedReplay(alpha=1.0, refresh_every=2),
        worker_count=workers,
        worker_buffer_size=1,
    )
    ordinal = [src.writer_ordinals[f"w{i}"] for i in range(2)]
    low = dict.fromkeys(ordinal, 0)
    valid: list[float] = []
    with gr.sharded_device_put(loader) as batches:
        for step in range(8):
            batch = next(batches)
            # rows and weights on the devices; the 64-bit row ids stay on the host
            assert isinstance(batch.weight, jax.Array) and isinstance(batch.data["seq"], jax.Array)
            assert isinstance(batch.index, np.ndarray) and batch.index.dtype == np.int64
            _named(batch, tags)
            index = np.asarray(batch.index)
            # a row whose segment went before the reading process opened it (this test
            # evicts two segments a step) is named -1 with weight 0, never another row
            assert (np.asarray(batch.weight)[index < 0] == 0).all()
            valid.append((index >= 0).mean())
            index = index[index >= 0]
            for o, seq in zip((index >> 40).tolist(), (index & SEQ).tolist()):
                assert seq >= low[o], (o, seq, low)
            batches.update_priorities(batch.index, 1.0 + (np.asarray(batch.index) & SEQ) % 5)
            _grow(ws, 40)
            if step >= 1:  # rows drawn later were live at most a few looks ago
                low = {o: max(0, w.committed - 40 * 5 - CAP) for o, w in zip(ordinal, ws)}
        late = np.asarray(next(batches).index)
        late = late[late >= 0] & SEQ
    assert late.max() > 300  # new rows are drawn
    assert np.median(valid) > 0.5
    for w in ws:
        w.close()


def test_new_rows_enter_at_the_largest_priority_given_so_far(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ws = open_writers(path)
    s = _sampler(path)
    ids, _ = s.draw(0)
    s.update(ids, np.full(len(ids), 7.0), stamp=0)
    s.update(ids[:1], np.array([0.5]), stamp=0)
    s.draw(1)
    assert s.max_priority == 7.0
    _grow(ws, 10)
    s.refresh()
    s.draw(2)
    src = gr.open_source(path)
    new = np.concatenate(
        [src.ids(np.arange(CAP - 10, CAP)), src.ids(np.arange(2 * CAP - 10, 2 * CAP))]
    )
    np.testing.assert_allclose(_leaves(s, new), 7.0)
    # the last update of a repeated row wins
    assert _leaves(s, ids[:1])[0] == 0.5 or ids[0] not in src.ids(np.arange(len(src)))
    for w in ws:
        w.close()


def test_an_update_of_an_evicted_row_is_ignored_and_never_changes_another(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "store")
    (w,) = open_writers(path, n=1)
    s = _sampler(path)
    drawn, _ = s.draw(0)
    s.update(drawn, np.full(len(drawn), 3.0), stamp=1)  # queued: reaches the draw of step 1
    w.append(make_rows("w0", w.committed, CAP))  # every drawn row evicted, slots reused
    w.flush()
    s.refresh()
    s.draw(1)  # the queued update meets rows that took the evicted rows' slots
    src = gr.open_source(path)
    live = src.ids(np.arange(len(src)))
    assert not np.isin(drawn, live).any()
    np.testing.assert_allclose(_leaves(s, live), 3.0)  # at max, but from no write onto them
    assert s.leaves().sum() == pytest.approx(3.0 * CAP)
    # an update after the eviction: accepted, ignored
    s.update(drawn, np.full(len(drawn), 100.0), stamp=2)
    s.draw(2)
    np.testing.assert_allclose(_leaves(s, live), 3.0)
    assert s.leaves().sum() == pytest.approx(3.0 * CAP)
    w.close()


def test_tree_size_follows_live_rows_after_ten_times_capacity(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ws = open_writers(path, n=3, rows=10)
    s = _sampler(path)
    for step in range(40):
        _grow(ws, 31)  # 10x capacity and more per writer, in flushes that wrap the ring
        s.refresh()
        ids, _ = s.draw(step)
        s.update(ids, np.arange(len(ids), dtype=np.float64) % 4, stamp=step)
    assert ws[0].committed > 10 * CAP
    assert s.live_slots == 3 * CAP
    assert s.slot_count == 3 * CAP  # the ring of a writer of capacity < CHUNK is one chunk
    assert len(s.leaves()) == s.slot_count
    src = gr.open_source(path)
    live = src.ids(np.arange(len(src)))
    ids = s.held_ids()
    np.testing.assert_array_equal(np.sort(ids[ids >= 0]), np.sort(live))
    assert (s.leaves()[ids < 0] == 0).all()
    for w in ws:
        w.close()


def test_unbounded_many_writer_store_grows_slots_per_writer(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ws = open_writers(path, capacity=None, rows=50)
    s = _sampler(path)
    s.draw(0)
    assert s.live_slots == 100 and s.slot_count == 2 * CHUNK
    _grow(ws, CHUNK)
    s.refresh()
    ids, _ = s.draw(1)
    assert s.live_slots == 2 * (CHUNK + 50) and s.slot_count == 4 * CHUNK
    assert ((ids & SEQ) < CHUNK + 50).all()
    for w in ws:
        w.close()


def test_processes_own_disjoint_rows_by_id(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ws = open_writers(path)
    samplers = [_sampler(path, shard_index=p, shard_count=2) for p in range(2)]
    drawn: list[set[int]] = [set(), set()]
    for step in range(30):
        for p, s in enumerate(samplers):
            ids, _ = s.draw(step)
            assert (((ids & SEQ) + (ids >> 40)) % 2 == p).all()
            drawn[p] |= set(ids.tolist())
        if step == 10:  # one process looks at new rows, the other not yet: no row is shared
            _grow(ws, 50)
            samplers[0].refresh()
    assert not drawn[0] & drawn[1]
    assert samplers[0].live_slots == samplers[1].live_slots == CAP
    other = np.array(sorted(drawn[1])[:3], dtype=np.int64)
    with pytest.raises(gr.PriorityIndexError, match=r"never handed out.*process 0 of 2"):
        samplers[0].update(other, np.ones(3), stamp=0)
    for w in ws:
        w.close()


def test_same_seed_and_updates_give_the_same_draws_with_0_and_2_workers(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    for w in open_writers(path, n=3):
        w.close()

    def run(workers: int) -> list[np.ndarray]:
        loader = gr.make_data_loader(
            gr.open_source(path),
            batch_size=16,
            seed=5,
            sampling=gr.PrioritizedReplay(alpha=1.0),
            worker_count=workers,
            worker_buffer_size=1,
        )
        out = []
        with iter(loader) as it:
            for step in range(6):
                batch = next(it)
                out.append(np.asarray(batch.index).copy())
                # the update reaches the same draw: 2 workers draw one batch ahead (lag 1)
                at = it.position + (1 if workers == 0 else 0)
                it.update_priorities(batch.index, (batch.index & SEQ) % 3 + step, handed_out=at)
        return out

    for a, b in zip(run(0), run(2)):
        np.testing.assert_array_equal(a, b)


def test_a_row_gone_before_the_reader_opened_it_comes_back_named_minus_one(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "store")
    (w,) = open_writers(path, n=1)
    src = gr.open_source(path)
    it = iter(
        gr.make_data_loader(
            src, batch_size=32, seed=2, sampling=gr.PrioritizedReplay(refresh_every=None)
        )
    )
    next(it)
    for _ in range(8):  # every live row evicted and its segment unlinked
        _grow([w], 40)
    src.close()  # the reader lets go of its snapshot: the drawn rows cannot be read
    batch = next(it)  # drawn from the sampler's snapshot, which still names them
    check_rows(batch.data)
    index, weight = np.asarray(batch.index), np.asarray(batch.weight)
    assert (index == -1).all() and (weight == 0).all()
    it.update_priorities(batch.index, np.ones(32))  # -1: ignored
    it.refresh()
    batch = next(it)
    assert (np.asarray(batch.index) >= 0).all()
    _named(batch, {src.writer_ordinals["w0"]: tag_of("w0")})
    w.close()


def test_bad_updates_are_refused_and_change_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ws = open_writers(path)
    s = _sampler(path)
    ids, _ = s.draw(0)
    before = s.leaves()
    src = gr.open_source(path)
    undrawn = np.setdiff1d(src.ids(np.arange(len(src))), ids)[:2]
    ahead = np.array([(ids[0] >> 40 << 40) | 10_000], dtype=np.int64)
    stranger = np.array([(77 << 40) | 3], dtype=np.int64)
    for bad in (undrawn, ahead, stranger):
        with pytest.raises(gr.PriorityIndexError, match=r"never handed out.*Fix"):
            s.update(bad, np.ones(len(bad)), stamp=0)
    with pytest.raises(gr.InvalidPriorityError, match="Fix"):
        s.update(ids, -np.ones(len(ids)), stamp=0)
    with pytest.raises(gr.InvalidPriorityError, match="one priority per index"):
        s.update(ids, np.ones(3), stamp=0)
    s.draw(1)
    np.testing.assert_array_equal(s.leaves(), before)
    for w in ws:
        w.close()


def test_an_empty_store_is_a_clear_error(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    w = gr.ReplayWriter(path, "npy", capacity=CAP, writer_id="w0")
    w.append(make_rows("w0", 0, 1))
    w.flush()
    s = SlotPrioritySampler(
        gr.open_source(path), gr.PrioritizedReplay(), 4, seed=0, lag=0, shard_index=1,
        shard_count=4,
    )  # fmt: skip
    with pytest.raises(gr.InvalidSamplingError, match=r"no live rows for process 1 of 4.*Fix"):
        s.draw(0)
    w.close()


def test_maps_run_on_the_rows_and_batches_stay_sampled(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    for w in open_writers(path):
        w.close()

    class Double(grain.transforms.Map):
        def map(self, x: Any) -> Any:
            return {**x, "vec": x["vec"] * 2}

    for workers in (0, 2):
        loader = gr.make_data_loader(
            gr.open_source(path),
            batch_size=8,
            sampling=gr.PrioritizedReplay(),
            operations=[Double()],
            worker_count=workers,
        )
        with iter(loader) as it:
            batch = next(it)
        assert isinstance(batch, gr.Sampled)
        want = make_rows("w0", 0, 1)["vec"][0] * 0  # shape only
        assert batch.data["vec"].shape == (8, *want.shape)
        seq, tag = batch.data["seq"], batch.data["tag"]
        np.testing.assert_array_equal(
            batch.data["vec"], 2 * (seq[:, None] * np.arange(1, 5) + tag[:, None])
        )


def test_writer_processes_and_a_prioritized_learner_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    flags = ("--blocks", "150", "--block", "10", "--segment-rows", "20")
    procs = [spawn_writer(path, "npy", f"p{i}", 100, *flags) for i in range(2)]
    try:
        wait_for_commit(path, "p1", procs)
        src = gr.open_source(path)
        loader = gr.make_data_loader(
            src, batch_size=32, sampling=gr.PrioritizedReplay(refresh_every=1), worker_count=2
        )
        with iter(loader) as it:
            while any(p.poll() is None for p in procs):
                batch = next(it)
                check_rows(batch.data)
                index = np.asarray(batch.index)
                ok = index >= 0
                np.testing.assert_array_equal(batch.data["seq"][ok], index[ok] & SEQ)
                it.update_priorities(batch.index, np.abs(np.sin(index)) + 0.1)
            it.refresh()
            for _ in range(3):
                batch = next(it)
            sampler = it._stream.sampler
            assert sampler.live_slots == 200  # both writers' newest 100 rows
    finally:
        for p in procs:
            p.wait(timeout=120)
