"""A restore checks every writer of a many-writer store against the checkpoint's watermark.

Through ``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore`` on
``gr.sharded_device_put`` over a replay loader, in every format, with 0 and 2
loader workers: rows committed after the watermark and rows evicted since are
fine (the restored learner draws what the uninterrupted run drew, below the
watermark until its next look); a writer part cut back below its mark or
deleted is refused, naming the store, the writer and the fix.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from tests.helpers.orbax_items import restore_item as _restore
from tests.helpers.orbax_items import save_item as _save

ocp = pytest.importorskip("orbax.checkpoint")  # in the test extra

B = 8
CAP = 64
SEG = 16
SEQ_MASK = (1 << 40) - 1
WRITERS = ("actor-0", "actor-1")
FORMATS = ["npy", "hdf5", "zarr"]
_LOOK = 3  # refresh_every: the restored learner's first look is at step 6


def _rows(k: int, start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.int64) + 1000 * k
    return {"id": ids, "obs": np.zeros((n, 2), np.float32) + ids[:, None]}


def _append(path: str, fmt: str, n: int) -> None:
    for k, wid in enumerate(WRITERS):
        with gr.ReplayWriter(path, fmt, capacity=CAP, writer_id=wid, segment_rows=SEG) as w:
            w.append(_rows(k, w.committed, n))


def _store(tmp_path: Path, fmt: str) -> str:
    if fmt == "zarr":
        pytest.importorskip("zarr")
    path = str(tmp_path / "replay")
    _append(path, fmt, 40)  # below capacity: 40 rows each, none evicted yet
    return path


def _batches(path: str, mode: str, workers: int) -> Any:
    sampling: Any = (
        gr.UniformReplay(refresh_every=_LOOK)
        if mode == "uniform"
        else gr.PrioritizedReplay(alpha=1.0, beta=0.5, refresh_every=_LOOK)
    )
    loader = gr.make_data_loader(
        gr.open_source(path),
        batch_size=B,
        seed=7,
        sampling=sampling,
        worker_count=workers,
        worker_buffer_size=1,
    )
    return gr.sharded_device_put(loader)


def _step(it: Any, mode: str, step: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows of the next batch as ``1000 * writer + seq`` (-1: not read), and weights."""
    batch = next(it)
    if mode == "uniform":
        return np.asarray(batch["id"]).copy(), None
    index = np.asarray(batch.index)
    ok = index >= 0
    rows = np.where(ok, (index >> 40) * 1000 + (index & SEQ_MASK), -1)
    np.testing.assert_array_equal(np.asarray(batch.data["id"])[ok], rows[ok])
    it.update_priorities(batch.index, 1.0 + (rows * (step + 1)) % 5)
    return rows, np.asarray(batch.weight).copy()


def _wait_drawn(it: Any, steps: int) -> None:
    """Waits until the loader under ``it`` has drawn its first ``steps`` batches.

    Its workers draw ahead in the background; a draw that looks at the store (every
    ``_LOOK`` steps) sees a later append or not depending on when it runs. Waiting
    for the pipeline to fill before the test appends makes the uninterrupted run's
    draws a function of the test, not of the machine's speed.
    """
    sampling = it._inner  # the SamplingIterator under sharded_device_put
    deadline = time.monotonic() + 60
    while sampling._next_draw < steps:
        assert time.monotonic() < deadline, f"drew {sampling._next_draw} of {steps} batches"
        time.sleep(0.005)


def _uniform(path: str) -> Any:
    loader = gr.make_data_loader(gr.open_source(path), batch_size=B, sampling=gr.UniformReplay())
    return iter(loader)


def _below(rows: np.ndarray, mark: gr.Watermark) -> bool:
    """Whether every row read lies below its writer's watermark (ordinal k is WRITERS[k])."""
    read = rows[rows >= 0]
    marks = np.array([mark.rows_for(w) for w in WRITERS])
    return bool(((read % 1000) < marks[read // 1000]).all())


# Every mode and format in process; with loader workers, each mode once in make test
# (prioritized on npy, uniform on hdf5), the other four under -m slow.
_WORKERS_IN_MAKE_TEST = {("prioritized", "npy"), ("uniform", "hdf5")}


@pytest.mark.parametrize(
    ("mode", "fmt", "workers"),
    [
        pytest.param(
            mode, fmt, workers,
            marks=() if not workers or (mode, fmt) in _WORKERS_IN_MAKE_TEST else pytest.mark.slow,
        )
        for mode in ("prioritized", "uniform")
        for fmt in FORMATS
        for workers in (0, 2)
    ],
)  # fmt: skip
def test_restore_checks_every_writer_of_the_watermark(
    tmp_path: Path, fmt: str, workers: int, mode: str
) -> None:
    path = _store(tmp_path, fmt)
    ckpt = tmp_path / "ckpt"
    with _batches(path, mode, workers) as it:
        for step in range(4):
            _step(it, mode, step)
        if workers:  # 2 pulled ahead by sharded_device_put (4, 5), 1 by the workers (6)
            _wait_drawn(it, 7)
        _save(it, ckpt, 4)
        _append(path, fmt, 8)  # (d) rows committed after the watermark: 48 each
        want = [_step(it, mode, step) for step in range(4, 10)]
    mark = gr.read_watermark(ckpt / "4" / "data")
    assert mark.writers == {"actor-0": 40, "actor-1": 40}

    # (d) Rows after the mark: the restore succeeds and draws what the uninterrupted
    # run drew, below the watermark until the first look (step 6), the new rows after.
    # (With workers the uninterrupted run drew ahead, its look at step 6 before the
    # new rows came; prioritized replay restores those draws ahead, uniform redraws.)
    same = 6 if mode == "uniform" and workers else 10
    with _batches(path, mode, workers) as fresh:
        _restore(fresh, ckpt, 4)
        got = [_step(fresh, mode, step) for step in range(4, 10)]
    for (rows, weight), (got_rows, got_weight) in zip(want[: same - 4], got):
        np.testing.assert_array_equal(got_rows, rows)
        if weight is not None:
            np.testing.assert_allclose(got_weight, weight, rtol=1e-6)
    assert all(_below(rows, mark) for rows, _ in got[:2])
    assert not all(_below(rows, mark) for rows, _ in got[2:])  # the new rows, after a look

    # (c) Rows evicted since the checkpoint: 72 committed, the oldest 8 of each gone.
    _append(path, fmt, 24)
    with _batches(path, mode, workers) as fresh:
        _restore(fresh, ckpt, 4)
        for step, (rows, weight) in zip(range(4, 6), want):
            got_rows, got_weight = _step(fresh, mode, step)
            if weight is None:  # uniform: an evicted row may have a live row of its writer
                other = got_rows != rows  # as a stand-in (when its segment is gone)
                assert ((rows[other] % 1000) < 8).all() and ((got_rows[other] % 1000) >= 8).all()
                np.testing.assert_array_equal(got_rows[other] // 1000, rows[other] // 1000)
                continue
            lost = got_rows < 0  # a drawn row evicted since: -1 with weight 0, never another
            assert (got_weight[lost] == 0).all()
            assert ((rows[lost] % 1000) < 8).all()
            np.testing.assert_array_equal(got_rows[~lost], rows[~lost])
            np.testing.assert_allclose(got_weight[~lost], weight[~lost], rtol=1e-6)

    # (b) A writer cut back below its mark (an earlier watermark) is refused.
    gr.truncate_to_watermark(path, gr.Watermark(path, writers={"actor-0": 72, "actor-1": 36}))
    with _batches(path, mode, workers) as fresh:
        with pytest.raises(gr.ReplayCheckpointError, match="writer 'actor-1' holds 36") as info:
            _restore(fresh, ckpt, 4)
        assert path in str(info.value) and "Fix:" in str(info.value)

    # (a) A deleted writer part is refused.
    shutil.rmtree(Path(path) / "writers" / "actor-0")
    with _batches(path, mode, workers) as fresh:
        with pytest.raises(gr.ReplayCheckpointError, match=r"writer 'actor-0'.*is gone") as info:
            _restore(fresh, ckpt, 4)
        assert path in str(info.value) and "Fix:" in str(info.value)


def test_a_replaced_store_of_the_other_kind_is_refused(tmp_path: Path) -> None:
    path = _store(tmp_path, "npy")
    it = _uniform(path)
    next(it)
    state = it.get_state()
    it.close()
    shutil.rmtree(path)
    gr.write_npy(path, _rows(0, 0, 100))  # a plain store at the same path
    plain = _uniform(path)
    with pytest.raises(gr.ReplayCheckpointError, match="replaced"):
        plain.set_state(state)
    plain_state = plain.get_state()
    shutil.rmtree(path)
    _append(path, "npy", 40)  # and a many-writer store where a plain one was
    many = _uniform(path)
    with pytest.raises(gr.ReplayCheckpointError, match="replaced"):
        many.set_state(plain_state)


def test_a_writer_with_rows_only_after_the_checkpoint_is_allowed(tmp_path: Path) -> None:
    path = _store(tmp_path, "npy")
    it = _uniform(path)
    next(it)
    state = it.get_state()
    with gr.ReplayWriter(path, "npy", capacity=CAP, writer_id="actor-9") as w:
        w.append(_rows(9, 0, 5))  # a writer that started after the checkpoint
    fresh = _uniform(path)
    fresh.set_state(state)
    assert fresh.position == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_uniform_watermark_covers_every_row_drawn_while_writers_commit(
    tmp_path: Path, workers: int
) -> None:
    """The watermark is the view the draws come from, not the reading copy's snapshot
    (which, with workers, the consuming process never refreshes)."""
    path = _store(tmp_path, "npy")
    writers = [
        gr.ReplayWriter(path, "npy", capacity=CAP, writer_id=w, segment_rows=SEG) for w in WRITERS
    ]
    drawn = []
    loader = gr.make_data_loader(gr.open_source(path), batch_size=B, seed=1,
                                 sampling=gr.UniformReplay(refresh_every=1),
                                 worker_count=workers)  # fmt: skip
    with gr.sharded_device_put(loader) as it:
        for _ in range(6):
            for k, w in enumerate(writers):
                w.append(_rows(k, w.committed, 4))
                w.flush()
            drawn.append(np.asarray(next(it)["id"]))
        mark = gr.read_watermark(it)
    for w in writers:
        w.close()
    rows = np.concatenate(drawn)
    assert (rows % 1000).max() >= 40  # rows committed while it drew were drawn
    assert _below(rows, mark)
    assert all(40 < mark.rows_for(w) <= 64 for w in WRITERS)


def test_a_damaged_uniform_layout_is_refused(tmp_path: Path) -> None:
    path = _store(tmp_path, "npy")
    it = _uniform(path)
    next(it)
    state = json.loads(it.get_state())
    assert [row[0] for row in state["sampler"]["writers"]] == list(WRITERS)
    fresh = _uniform(path)
    for bad in ([["actor-0", 0, 0, 40]], [["actor-0", 0, 10, 5], ["actor-1", 1, 0, 85]], "x"):
        damaged = {**state, "sampler": {**state["sampler"], "writers": bad}}
        with pytest.raises(gr.ReplayCheckpointError, match="layout"):
            fresh.set_state(json.dumps(damaged).encode())
        assert fresh.position == 0  # nothing changed
    fresh.set_state(it.get_state())
    np.testing.assert_array_equal(next(fresh)["id"], next(it)["id"])
