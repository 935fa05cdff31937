"""Uniform replay and mixtures over bounded, many-writer stores that evict while read."""

from __future__ import annotations

from pathlib import Path

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


def _live(batch: dict[str, np.ndarray], committed: dict[int, tuple[int, int]]) -> None:
    """Each row is whole and was live (per writer) at some commit the test made."""
    check_rows(batch)
    for tag, seq in zip(np.asarray(batch["tag"]), np.asarray(batch["seq"])):
        lo, hi = committed[int(tag)]
        assert lo <= seq < hi, (tag, seq, lo, hi)


@pytest.mark.parametrize(("fmt", "workers"), FORMATS_AND_WORKERS)
def test_uniform_reads_only_live_rows_while_writers_evict(
    tmp_path: Path, fmt: str, workers: int
) -> None:
    path = str(tmp_path / "store")
    ws = open_writers(path, fmt)
    tags = {f"w{i}": tag_of(f"w{i}") for i in range(2)}
    # rows ever live: [0, committed) per writer; the batch must hold rows of the
    # snapshot it was drawn from, which are newer than committed - capacity then.
    seen_low = {tag_of(f"w{i}"): 0 for i in range(2)}
    loader = gr.make_data_loader(
        gr.open_source(path),
        batch_size=16,
        sampling=gr.UniformReplay(refresh_every=2),
        worker_count=workers,
        worker_buffer_size=1,
    )
    with gr.sharded_device_put(loader) as batches:
        for step in range(6):
            batch = {k: np.asarray(v) for k, v in next(batches).items()}
            committed = {
                tags[f"w{i}"]: (seen_low[tags[f"w{i}"]], w.committed) for i, w in enumerate(ws)
            }
            _live(batch, committed)
            for i, w in enumerate(ws):  # evict: more than a segment each step
                w.append(make_rows(f"w{i}", w.committed, 40))
                w.flush()
            # rows drawn before this commit were live at most two snapshots ago
            if step >= 1:
                for i, w in enumerate(ws):
                    seen_low[tags[f"w{i}"]] = max(0, w.committed - 40 * 4 - 120)
        late = {k: np.asarray(v) for k, v in next(batches).items()}
    assert late["seq"].max() > 250  # new rows were drawn
    for w in ws:
        w.close()


def test_uniform_over_a_static_bounded_store_matches_workers_and_resumes(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    for w in open_writers(path, "npy", n=3):
        w.close()
    args = dict(batch_size=8, sampling=gr.UniformReplay(), seed=3)
    plain = iter(gr.make_data_loader(gr.open_source(path), **args))
    with iter(gr.make_data_loader(gr.open_source(path), worker_count=2, **args)) as workers:
        for _ in range(5):
            a, b = next(plain), next(workers)
            check_rows(a)
            np.testing.assert_array_equal(a["seq"], b["seq"])
            np.testing.assert_array_equal(a["tag"], b["tag"])
        state = workers.get_state()
        want = [next(workers)["seq"] for _ in range(3)]
    fresh = iter(gr.make_data_loader(gr.open_source(path), **args))
    fresh.set_state(state)
    for w in want:
        np.testing.assert_array_equal(next(fresh)["seq"], w)


def test_mixture_of_an_offline_dataset_and_an_online_bounded_store(tmp_path: Path) -> None:
    offline = str(tmp_path / "offline")
    gr.write_npy(offline, make_rows("offline", 0, 500))
    online = str(tmp_path / "online")
    ws = open_writers(online, "npy")
    loader = gr.make_data_loader(
        {"offline": gr.open_source(offline), "online": gr.open_source(online)},
        weights={"offline": 0.5, "online": 0.5},
        batch_size=16,
        sampling=gr.UniformReplay(refresh_every=1),
        source_leaf="source",
        worker_count=2,
        worker_buffer_size=1,
    )
    with iter(loader) as it:
        for _ in range(6):
            batch = next(it)
            check_rows(batch)
            online_rows = batch["source"] == 1
            assert online_rows.sum() == 8
            assert (batch["tag"][~online_rows] == tag_of("offline")).all()
            for i, w in enumerate(ws):
                w.append(make_rows(f"w{i}", w.committed, 40))
                w.flush()
            lows = [max(0, w.committed - 120 - 40 * 4) for w in ws]
            assert (batch["seq"][online_rows] >= min(lows)).all()
    for w in ws:
        w.close()


def test_a_row_gone_before_any_reader_opened_it_is_an_error_not_another_row(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "store")
    (w,) = open_writers(path, "npy", n=1)
    drawer = gr.open_source(path)
    ids = drawer.ids(np.arange(5))  # the oldest live rows
    reader = gr.open_source(path)
    for _ in range(8):  # evicted, and their segments unlinked (past the retired one)
        w.append(make_rows("w0", w.committed, 40))
        w.flush()
    np.testing.assert_array_equal(drawer.read_ids(ids)["seq"], np.arange(30, 35))  # held open
    reader.close()  # a reader that never mapped them and whose snapshot is gone
    fresh = gr.open_source(path)
    with pytest.raises(gr.GrainReplayError, match=r"writer 'w0'.*evicted.*Fix"):
        fresh.read_ids(ids)
    w.close()


def test_writer_processes_and_a_learner_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    flags = ("--blocks", "150", "--block", "10", "--segment-rows", "20")
    procs = [spawn_writer(path, "npy", f"p{i}", 100, *flags) for i in range(2)]
    try:
        wait_for_commit(path, "p1", procs)
        src = gr.open_source(path)
        it = iter(gr.make_data_loader(src, batch_size=32, sampling=gr.UniformReplay(1)))
        while any(p.poll() is None for p in procs):
            check_rows(next(it))
    finally:
        for p in procs:
            p.wait(timeout=120)
    assert gr.open_source(path).refresh() == 200
