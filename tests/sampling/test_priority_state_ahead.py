"""The prioritized state at position k is a function of k, not of how far the draws ran ahead.

A consumer that reads ahead (``sharded_device_put``'s producer, loader workers) has drawn
batches past the one it last handed on; the checkpoint at that batch undoes those draws
(their updates back in the queue, their leaves and handed-out bits as before), so its
bytes are the same whatever ran ahead, and a restore draws the uninterrupted run's
batches. Only a draw ahead that looked at the store keeps the draws ahead (what the look
saw depends on when it ran).
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sampling.priority import PrioritySampler

N, B = 96, 8
PREFETCH = 3  # the read-ahead the updates are stamped with


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("ahead") / "replay")
    ids = np.arange(N, dtype=np.int64)
    gr.write_npy(path, {"id": ids, "obs": np.ones((N, 2), np.float32) * ids[:, None]})
    return path


def _loader(store: str, workers: int = 0, refresh_every: int | None = None) -> Any:
    return gr.make_data_loader(
        gr.NpyDataSource(store),
        batch_size=B,
        seed=5,
        num_epochs=None,
        sampling=gr.PrioritizedReplay(alpha=1.0, beta=0.5, refresh_every=refresh_every),
        worker_count=workers,
        worker_buffer_size=1,
    )


def _priorities(batch: Any, step: int) -> np.ndarray:
    return 0.5 + (np.asarray(batch.index) * (step + 3)) % 7


def _parts(batch: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's index, weight and data, as numpy."""
    return np.asarray(batch.index), np.asarray(batch.weight), np.asarray(batch.data["id"])


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for parts, wanted in zip(got, want):
        for a, b in zip(parts, wanted, strict=True):
            np.testing.assert_array_equal(a, b)


def _consume(
    it: Any, pulled: list[Any], start: int, stop: int, ahead: int, prefetch: int = PREFETCH
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Hands out batches ``start`` to ``stop - 1`` as a learner behind a producer ``ahead``
    batches ahead (at most ``prefetch``): each update is stamped as sharded_device_put
    stamps it, after the batch, with the batches handed out plus ``prefetch``. At the end
    the producer has pulled ``stop + ahead`` batches."""
    got = []
    for step in range(start, stop):
        while len(pulled) < max(step + 1, step + ahead):  # the producer, up to its bound
            pulled.append(next(it))
        batch = pulled[step]
        got.append(_parts(batch))
        it.update_priorities(batch.index, _priorities(batch, step), handed_out=step + 1 + prefetch)
    while len(pulled) < stop + ahead:
        pulled.append(next(it))
    return got


def _fresh(
    store: str, k: int, ahead: int, prefetch: int = PREFETCH
) -> tuple[Any, list[Any], list[Any]]:
    it = iter(_loader(store))
    pulled: list[Any] = []
    got = _consume(it, pulled, 0, k, ahead, prefetch)
    return it, pulled, got


def _priority_arrays(state: bytes) -> dict[str, Any]:
    priorities: dict[str, Any] = json.loads(state)["priorities"]
    return priorities


def _next_draw(state: bytes) -> int:
    saved = _priority_arrays(state)["next_draw"]
    return int(np.frombuffer(base64.b64decode(saved["data"]), saved["dtype"])[0])


@pytest.mark.parametrize("k", [1, 6])
def test_the_state_at_k_is_the_same_bytes_however_far_the_draws_ran_ahead(
    store: str, k: int
) -> None:
    states = []
    for ahead in (0, 1, PREFETCH):
        it, _, _ = _fresh(store, k, ahead)
        states.append(it.get_state_at(k))
        it.close()
    assert states[1] == states[0]
    assert states[2] == states[0]
    assert _next_draw(states[0]) == k  # nothing drawn from k on
    assert _priority_arrays(states[0])["drawn_step"]["shape"] == [0]


def test_drawn_ahead_with_updates_applied_ahead_the_state_is_the_one_before_them(
    store: str,
) -> None:
    # The updates after batches 1 to 4 are stamped 5 to 8 (4 + PREFETCH): the run ahead
    # (8 batches drawn) applied those stamped 5 to 7; at batch 5 all four are queued.
    it, _, _ = _fresh(store, 5, PREFETCH)
    ahead = it.get_state_at(5)
    plain, _, _ = _fresh(store, 5, 0)
    assert ahead == plain.get_state_at(5)
    pending = _priority_arrays(ahead)["pending_stamp"]
    assert pending["shape"] == [4]
    it.close()
    plain.close()


@pytest.mark.parametrize("ahead", [0, PREFETCH])
def test_restoring_the_state_at_k_gives_the_uninterrupted_batches(store: str, ahead: int) -> None:
    k, more = 6, 12
    it, pulled, _ = _fresh(store, k, ahead)
    state = it.get_state_at(k)
    want = _consume(it, pulled, k, k + more, ahead)
    it.close()

    restored = iter(_loader(store))
    restored.set_state(state)
    got = _consume(restored, [None] * k, k, k + more, PREFETCH - ahead)
    restored.close()
    _same(got, want)


def test_a_look_ahead_keeps_the_draws_ahead_and_a_restore_repeats_them(store: str) -> None:
    k = 4
    it = iter(_loader(store))
    pulled: list[Any] = []
    _consume(it, pulled, 0, k, 0)
    it.refresh()  # the draw of step k looks at the store: what it saw depends on timing
    _consume(it, pulled, k, k, PREFETCH)
    state = it.get_state_at(k)
    assert _priority_arrays(state)["drawn_step"]["shape"] == [PREFETCH]
    assert _next_draw(state) == k + PREFETCH
    want = _consume(it, pulled, k, k + 8, PREFETCH)
    it.close()

    restored = iter(_loader(store))
    restored.set_state(state)
    got = _consume(restored, [None] * k, k, k + 8, 0)
    restored.close()
    _same(got, want)


def _wait_drawn(it: Any, steps: int) -> None:
    """Waits (with a deadline) until the loader iterator has drawn ``steps`` batches."""
    deadline = time.monotonic() + 60
    while it._next_draw < steps:
        assert time.monotonic() < deadline, f"drew {it._next_draw} of {steps} batches"
        time.sleep(0.005)


def test_with_workers_the_state_undoes_the_workers_draws_ahead(store: str) -> None:
    k, more = 5, 8
    it = iter(_loader(store, workers=2))
    got = []
    for step in range(k + more):
        if step == k:
            _wait_drawn(it, k + 1)  # the workers drew ahead (worker_count * buffer = 2)
            state = it.get_state()
            assert _priority_arrays(state)["drawn_step"]["shape"] == [0]
            assert _next_draw(state) == k
        batch = next(it)
        got.append(_parts(batch))
        it.update_priorities(batch.index, _priorities(batch, step))
    it.close()

    restored = iter(_loader(store, workers=2))
    restored.set_state(state)
    again = []
    for step in range(k, k + more):
        batch = next(restored)
        again.append(_parts(batch))
        restored.update_priorities(batch.index, _priorities(batch, step))
    restored.close()
    _same(again, got[k:])


@pytest.mark.parametrize(("packed", "prefetch"), [(True, PREFETCH), (False, PREFETCH), (True, 0)])
def test_through_sharded_device_put_with_its_queue_full_the_state_is_the_plain_one(
    store: str, packed: bool, prefetch: int
) -> None:
    k, more = 5, 6
    plain, pulled, _ = _fresh(store, k, 0, prefetch)
    want_state = plain.get_state_at(k)
    want = _consume(plain, pulled, k, k + more, 0, prefetch)
    plain.close()

    states = []
    for _ in range(2):
        with gr.sharded_device_put(_loader(store), prefetch=prefetch, packed=packed) as it:
            for step in range(k):
                batch = next(it)
                it.update_priorities(batch.index, _priorities(batch, step))
            _wait_drawn(it._inner, k + prefetch)  # the producer filled its queue
            states.append(it.get_state())
            got = []
            for step in range(k, k + more):
                batch = next(it)
                got.append(_parts(batch))
                it.update_priorities(batch.index, _priorities(batch, step))
        _same(got, want)
    assert states[0] == want_state
    assert states[1] == want_state

    # restored through sharded_device_put: the uninterrupted run's batches
    with gr.sharded_device_put(_loader(store), prefetch=prefetch, packed=packed) as it:
        it.set_state(states[0])
        again = []
        for step in range(k, k + more):
            batch = next(it)
            again.append(_parts(batch))
            it.update_priorities(batch.index, _priorities(batch, step))
    _same(again, want)


def _sampler(store: str) -> PrioritySampler:
    options = gr.PrioritizedReplay(alpha=1.0, refresh_every=None)
    return PrioritySampler(gr.NpyDataSource(store), options, B, seed=1, lag=0)


def _equal(a: dict[str, np.ndarray] | None, b: dict[str, np.ndarray]) -> None:
    assert a is not None and a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_the_sampler_undoes_draws_and_their_updates_and_knows_when_it_cannot(
    store: str,
) -> None:
    sampler, plain = _sampler(store), _sampler(store)
    first, _ = sampler.draw(0)
    plain.draw(0)
    for s in (sampler, plain):
        s.update(first, np.full(len(first), 9.0), stamp=1)  # reaches draw 1
        s.update(first[:2], np.full(2, 0.25), stamp=2)  # reaches draw 2
    before = plain.state()
    for step in (1, 2, 3):
        sampler.draw(step)
    sampler.update(first[:1], np.full(1, 4.0), stamp=5)  # queued after the draws ahead
    plain.update(first[:1], np.full(1, 4.0), stamp=5)
    assert not np.array_equal(sampler.state()["values"], before["values"])
    _equal(sampler.state_at(1, 4), plain.state())  # both updates queued again, in order
    _equal(sampler.state_at(4, 4), sampler.state())  # nothing drawn from 4 on

    sampler.forget(2)  # draw 1 is forgotten: no state before it any more
    assert sampler.state_at(1, 4) is None
    assert sampler.state_at(2, 4) is not None
    sampler.apply_updates(5)  # the tree changed outside a draw: nothing to undo to
    assert sampler.state_at(2, 4) is None


def test_over_workers_through_sharded_device_put_the_state_is_the_bare_iterators(
    store: str,
) -> None:
    k = 5
    bare = iter(_loader(store, workers=2))
    for step in range(k):
        batch = next(bare)
        bare.update_priorities(batch.index, _priorities(batch, step), handed_out=step + 1 + 2)
    _wait_drawn(bare, k + 1)  # the workers drew ahead
    want = bare.get_state()
    bare.close()
    with gr.sharded_device_put(_loader(store, workers=2), prefetch=2) as it:
        for step in range(k):
            batch = next(it)
            it.update_priorities(batch.index, _priorities(batch, step))
        _wait_drawn(it._inner, k + 2 + 1)  # its queue full, and the workers ahead of it
        assert it.get_state() == want
