"""Batches of worker_count > 0 view the workers' shared-memory slots: a held batch is never
overwritten (grain_replay.pipeline.slots and its use in pipeline/workers.py)."""

from __future__ import annotations

import gc
import os
import signal
import time
from typing import Any

import grain
import numpy as np
import pytest
from conformance import assert_tree_equal, make_tree
from loader_sources import IntoFails, MarkedInto

import grain_replay as gr
from grain_replay.pipeline.slots import MAX_HELD, Slots

NO_SHARDING = grain.sharding.NoSharding()


class Identity(grain.transforms.Map):
    def map(self, element: Any) -> Any:
        return element


FIELDS = [
    ("a", np.dtype(np.float32), (4, 2), 8, 0, 0),
    ("b", np.dtype(">i8"), (3,), 3, 64, 0),
    ("empty", np.dtype(np.uint8), (0, 5), 0, 128, 0),
]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tree = make_tree(100)
    tree["id"] = np.arange(100, dtype=np.int64)
    p = str(tmp_path_factory.mktemp("slots") / "s.npy")
    gr.write(p, tree, format="npy")
    return p


def _loader(source: Any, workers: int, **kwargs: Any) -> grain.DataLoader:
    kwargs.setdefault("num_epochs", 2)
    return gr.make_data_loader(
        source, batch_size=8, seed=3, worker_count=workers, shard_options=NO_SHARDING, **kwargs
    )


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    return np.array(tree, copy=True)


def _add_map(slots: Slots, slot: int, size: int = 256) -> None:
    """Maps a new shared file as ``slot``, filled with the byte ``slot`` (a written batch)."""
    fd = os.memfd_create("test_slot")
    try:
        os.ftruncate(fd, size)
        slots.add_map(slot, fd, size)
    finally:
        os.close(fd)
    np.frombuffer(slots.maps[slot], np.uint8)[:] = slot


def _slots_with(granted: int = 2, **kwargs: Any) -> Slots:
    slots = Slots(granted, **kwargs)
    for s in range(granted):
        _add_map(slots, s)
    return slots


# -- Slots alone --------------------------------------------------------------------------


def test_taken_slot_is_held_until_every_view_is_dropped_then_reused() -> None:
    slots = _slots_with(2)
    leaves, give = slots.take(1, FIELDS)
    assert give == [2]  # a new slot for the worker, not the one the batch lives in
    assert leaves["a"].dtype == np.float32 and leaves["a"].shape == (4, 2)
    assert leaves["b"].dtype == np.dtype(">i8") and leaves["empty"].shape == (0, 5)
    assert type(leaves["a"]) is np.ndarray and leaves["a"].flags.writeable
    assert np.shares_memory(leaves["a"], np.frombuffer(slots.maps[1], np.uint8))
    view = leaves["a"][1:].T  # a view of a view still holds the slot
    del leaves
    gc.collect()
    assert slots.collect() == [] and slots.held == 1 and slots.idle == 0
    del view
    assert slots.collect() == [] and slots.held == 0 and slots.idle == 1
    _, give = slots.take(0, FIELDS)
    assert give == [1]  # the released slot is the next one given


def test_held_slot_map_cannot_be_closed_under_its_views() -> None:
    slots = _slots_with(1)
    leaves, _ = slots.take(0, FIELDS)
    with pytest.raises(BufferError):
        slots.maps[0].close()
    slots.close()  # batches held: their maps stay until the views go
    assert leaves["b"].tolist() == [0] * 3
    leaves["a"][:] = 7  # still mapped and writable
    assert (leaves["a"] == 7).all()


def test_past_max_held_batches_are_copied_and_the_slot_goes_straight_back() -> None:
    slots = _slots_with(1, max_held=2)
    kept, slot = [], 0
    for _ in range(2):
        leaves, give = slots.take(slot, FIELDS)
        kept.append(leaves)
        assert give != [slot]
        _add_map(slots, give[0])  # the worker writes its next batch there
        slot = give[0]
    leaves, give = slots.take(slot, FIELDS)
    assert give == [slot] and slots.held == 2
    assert not np.shares_memory(leaves["a"], np.frombuffer(slots.maps[slot], np.uint8))
    np.frombuffer(slots.maps[slot], np.uint8)[:] = 99  # the worker writes the slot again
    assert (leaves["a"].view(np.uint8) == slot).all()  # the copy kept what the slot had


def test_releases_beyond_the_idle_limit_are_dropped_and_unmapped() -> None:
    slots = _slots_with(3, idle_limit=1)
    batches = [slots.take(s, FIELDS)[0] for s in range(3)]
    assert slots.held == 3
    batches.clear()
    dropped = slots.collect()
    assert len(dropped) == 2 and slots.idle == 1 and slots.held == 0
    assert all(s not in slots.maps for s in dropped)


def test_release_in_another_thread_is_collected() -> None:
    import threading

    slots = _slots_with(1)
    box = [slots.take(0, FIELDS)[0]]
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    assert slots.collect() == [] and slots.idle == 1


# -- through make_data_loader, 0 and 2 workers ------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_held_batches_are_never_overwritten(path: str, workers: int) -> None:
    src = gr.open_source(path)
    reference = [_copy(b) for b in _loader(src, 0)]
    held = list(_loader(src, workers))  # every batch held: more than the slots read ahead
    assert len(held) == len(reference) > 4
    for got, want in zip(held, reference):
        assert_tree_equal(got, want)


@pytest.mark.parametrize("workers", [0, 2])
def test_more_batches_held_than_max_held_stay_whole(path: str, workers: int) -> None:
    src = gr.open_source(path)
    epochs = -(-(2 * MAX_HELD + 8) // 12)  # 12 batches an epoch
    reference = [_copy(b) for b in _loader(src, 0, num_epochs=epochs)]
    it = iter(_loader(src, workers, num_epochs=epochs))
    held = []
    for b in it:
        held.append(b)
        if workers:
            assert it._pool is not None
            assert all(w.slots.held <= MAX_HELD for w in it._pool.workers)
    assert len(held) > 2 * MAX_HELD
    for got, want in zip(held, reference, strict=True):
        assert_tree_equal(got, want)


def test_slots_are_reused_when_batches_are_dropped(path: str) -> None:
    it = iter(_loader(gr.open_source(path), 2, num_epochs=None))
    for _ in range(40):
        next(it)  # dropped at once
    assert it._pool is not None
    for w in it._pool.workers:
        assert len(w.slots.maps) <= 2 + 2  # buffer_size read ahead, one held, one spare
    it.close()


def test_writing_into_a_held_batch_changes_no_other_batch(path: str) -> None:
    src = gr.open_source(path)
    reference = [_copy(b) for b in _loader(src, 0)]
    got = []
    for b in _loader(src, 2):
        got.append(_copy(b))
        b["obs"]["vec"][:] = -1.0  # writable, and the slot is reused afterwards
    for g, want in zip(got, reference, strict=True):
        assert_tree_equal(g, want)


@pytest.mark.parametrize("workers", [0, 2])
def test_close_with_batches_held_keeps_them_whole(path: str, workers: int) -> None:
    src = gr.open_source(path)
    reference = [_copy(b) for b in _loader(src, 0)]
    it = iter(_loader(src, workers))
    held = [next(it) for _ in range(5)]
    it.close()
    gc.collect()
    held += list(it)  # new workers (with 2), new slots; the old ones still mapped
    for got, want in zip(held, reference, strict=True):
        assert_tree_equal(got, want)
    del it
    gc.collect()
    for got, want in zip(held, reference, strict=True):
        assert_tree_equal(got, want)


def test_killed_worker_leaves_held_batches_whole(path: str) -> None:
    src = gr.open_source(path)
    reference = [_copy(b) for b in _loader(src, 0)]
    it = iter(_loader(src, 2))
    held = [next(it) for _ in range(3)]
    time.sleep(0.3)
    assert it._pool is not None
    victim = it._pool.workers[0].process
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    with pytest.raises(gr.WorkerDiedError):
        while True:
            held.append(next(it))
    held += list(it)
    assert len(held) == len(reference)
    for got, want in zip(held, reference, strict=True):
        assert_tree_equal(got, want)


@pytest.mark.parametrize("workers", [0, 2])
def test_sharded_device_put_of_held_batches(path: str, workers: int) -> None:
    import jax

    src = gr.open_source(path)
    reference = [_copy(b) for b in _loader(src, 0)]
    on_device = list(gr.sharded_device_put(_loader(src, workers)))  # all held
    assert len(on_device) == len(reference)
    for got, want in zip(on_device, reference, strict=True):
        assert isinstance(got["id"], jax.Array)
        jax.tree.map(lambda g, w: np.testing.assert_array_equal(np.asarray(g), w), got, want)
    # One batch's leaf through jax.device_put alone, its numpy arrays dropped at once.
    it = iter(_loader(src, workers))
    arrays = [jax.device_put(next(it)["obs"]["vec"]) for _ in range(6)]
    gc.collect()
    for a, want in zip(arrays, reference, strict=False):
        np.testing.assert_array_equal(np.asarray(a), want["obs"]["vec"])


# -- batches read straight into the slot --------------------------------------------------


def test_batches_after_the_first_are_read_straight_into_the_slot(path: str) -> None:
    src = gr.open_source(path)
    reference = [b["id"].tolist() for b in _loader(src, 0)]
    got = [b["id"].tolist() for b in _loader(MarkedInto(src), 2)]
    # Each worker's first batch shows the layout (read_batch); the rest used read_into.
    assert got[:2] == reference[:2]
    assert got[2:] == [[i + 1000 for i in ids] for ids in reference[2:]]


def test_read_into_of_the_real_source_gives_the_read_batch_stream(path: str) -> None:
    src = gr.open_source(path)
    reference = [_copy(b) for b in _loader(src, 0, drop_remainder=False)]
    got = list(_loader(src, 2, drop_remainder=False))  # a short last batch each epoch
    assert [len(b["id"]) for b in got] == [len(b["id"]) for b in reference]
    assert len(reference[12]["id"]) == 4  # 100 records: 12 batches of 8, then 4
    for g, want in zip(got, reference, strict=True):
        assert_tree_equal(g, want)


def test_read_into_that_raises_falls_back_to_read_batch(path: str) -> None:
    src = gr.open_source(path)
    reference = [b["id"].tolist() for b in _loader(src, 0)]
    assert [b["id"].tolist() for b in _loader(IntoFails(src), 2)] == reference


def test_operations_turn_off_reading_into_the_slot(path: str) -> None:
    src = gr.open_source(path)
    reference = [b["id"].tolist() for b in _loader(src, 0, operations=[Identity()])]
    got = [b["id"].tolist() for b in _loader(MarkedInto(src), 2, operations=[Identity()])]
    assert got == reference
