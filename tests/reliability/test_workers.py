"""Grain worker processes over months: a killed worker is reported, nothing leaks, nothing is lost.

- A worker SIGKILLed mid-epoch makes the consuming process raise within 30 s, with
  the cause in the message, and leaves no child process behind once the loader
  and its iterator are gone.
- Soak: epochs with 2 workers read every record exactly once per epoch while
  open file descriptors (of this process and the workers, /dev/shm ones
  included) and RssAnon (of this process and the workers) stay within 5 % of
  their level after the first epoch; then the loader is dropped mid-epoch and no
  child process or descriptor may remain. 3 epochs in the default suite, 20 per
  format under ``-m slow``.

Workers are found as the children of this process (``psutil`` if installed, else
``/proc``), less those that existed before the loader and multiprocessing's
resource tracker (one per interpreter, by design).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from procs import children as _children
from procs import cmdline as _cmdline
from procs import new_children as _new_children
from procs import wait_no_new_children as _wait_no_new_children

import grain_replay as gr

N = 4096
BATCH = 64
WORKERS = 2
KILL_DEADLINE_S = 30.0
FLAT = 1.05  # later epochs may exceed the first by at most 5 %
QUIESCE_S = 0.5  # pause before each measurement, so that in-flight batches are at capacity


# -- processes, descriptors, memory ---------------------------------------------------------


def _wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_anon_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


def _shm_fds(pid: int) -> int:
    """Descriptors of ``pid`` open on /dev/shm (grain passes batches in shared memory)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/")
        except OSError:
            pass
    return n


def _snapshot(workers: list[int]) -> dict[str, int]:
    me = os.getpid()
    return {
        "fds_main": _fd_count(me),
        "fds_workers": sum(_fd_count(p) for p in workers),
        "shm_fds_all": _shm_fds(me) + sum(_shm_fds(p) for p in workers),
        "rss_anon_main_kib": _rss_anon_kib(me),
        "rss_anon_workers_kib": sum(_rss_anon_kib(p) for p in workers),
    }


# -- stores -------------------------------------------------------------------------------------


def _write_store(root: Any, fmt: str) -> str:
    path = str(root / {"hdf5": "soak.h5", "npy": "soak", "zarr": "soak.zarr"}[fmt])
    idx = np.arange(N, dtype=np.int64)
    tree = {"idx": idx, "obs": np.repeat(idx[:, None].astype(np.float32), 8, axis=1)}
    gr.write(path, tree, format=fmt)
    return path


@pytest.fixture(scope="module")
def npy_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _write_store(tmp_path_factory.mktemp("workers"), "npy")


# Whether a loader with workers has run in this process: the first one opens
# process-lifetime descriptors (multiprocessing's resource tracker pipe, its shared
# heap arena), which a leak check must not count.
_LOADERS_RAN = [False]


def _run_loader_once(store: str) -> None:
    loader = gr.make_data_loader(
        gr.NpyDataSource(store), batch_size=BATCH, worker_count=WORKERS, num_epochs=1
    )
    for i, _ in enumerate(loader):
        if i == 1:
            break
    loader = None
    gc.collect()
    _LOADERS_RAN[0] = True


@pytest.fixture
def warm_process(npy_store: str, baseline: set[int]) -> None:
    """Runs one short loader first, unless an earlier test of this process did."""
    if not _LOADERS_RAN[0]:
        _run_loader_once(npy_store)
        _wait_no_new_children(baseline)


@pytest.fixture
def baseline() -> Iterator[set[int]]:
    """This process's children before the test; the test must leave no others behind."""
    gc.collect()
    before = _children()
    yield before
    for pid in _new_children(before):  # a failed test must not leak workers into the next
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- the tests ----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_worker_sigkill_raises_in_consumer_within_30s_without_orphans(
    npy_store: str, baseline: set[int]
) -> None:
    loader = gr.make_data_loader(
        gr.NpyDataSource(npy_store), batch_size=BATCH, worker_count=WORKERS, num_epochs=None
    )
    state = {"it": iter(loader)}
    next(state["it"])  # the workers are up
    workers = _wait_for(
        lambda: (w := _new_children(baseline)) and len(w) >= WORKERS and w, 60, "2 workers"
    )
    for _ in range(3):  # mid-epoch
        next(state["it"])
    os.kill(workers[0], signal.SIGKILL)
    killed_at = time.monotonic()
    _LOADERS_RAN[0] = True
    outcome: dict[str, Any] = {}

    def consume() -> None:
        try:
            for _ in state["it"]:
                outcome["batches_after_kill"] = outcome.get("batches_after_kill", 0) + 1
        except BaseException as e:
            outcome["error"] = e
        outcome["elapsed_s"] = time.monotonic() - killed_at

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(KILL_DEADLINE_S)
    assert not consumer.is_alive(), (
        f"HANG: the consumer got no error {KILL_DEADLINE_S} s after worker {workers[0]} was "
        f"SIGKILLed ({outcome.get('batches_after_kill', 0)} batches after the kill). grain "
        "does not notice; grain_replay needs a watchdog on its workers."
    )
    err = outcome.get("error")
    assert err is not None, f"the loader ended normally after the kill: {outcome}"
    message = str(err)
    print(
        f"\nworker {workers[0]} killed; consumer raised {type(err).__name__} after "
        f"{outcome['elapsed_s']:.2f} s and {outcome.get('batches_after_kill', 0)} more batches: "
        f"{message[:200]!r}"
    )
    assert "terminated" in message and "-9" in message, f"cause not named: {message!r}"

    state.clear()
    loader = None
    outcome.clear()
    err = None
    _wait_no_new_children(baseline)


def _soak(path: str, epochs: int, baseline: set[int]) -> list[dict[str, int]]:
    """Reads ``epochs`` epochs, measuring after each, then drops the loader mid-epoch."""
    fds_before = _fd_count(os.getpid())
    per_epoch = N // BATCH
    # One epoch more than measured: the last measurement is taken while the workers
    # still run ahead, as in training, and the loader is then dropped mid-epoch.
    loader = gr.make_data_loader(
        gr.open_source(path), batch_size=BATCH, worker_count=WORKERS, num_epochs=epochs + 1, seed=7
    )
    state = {"it": iter(loader)}
    metrics: list[dict[str, int]] = []
    seen: list[np.ndarray] = []
    workers: list[int] = []
    t0 = time.monotonic()
    for i, batch in enumerate(state["it"]):
        np.testing.assert_array_equal(batch["obs"][:, 3], batch["idx"].astype(np.float32))
        seen.append(batch["idx"].copy())  # a view would pin the batch's shared memory
        if len(metrics) == epochs and len(seen) == per_epoch // 2:
            break  # mid-epoch
        if (i + 1) % per_epoch == 0:
            epoch = (i + 1) // per_epoch
            ids = np.concatenate(seen)
            seen = []
            np.testing.assert_array_equal(
                np.sort(ids), np.arange(N), err_msg=f"epoch {epoch} is not every record once"
            )
            if not workers:
                workers = _new_children(baseline)
                assert len(workers) == WORKERS, {p: _cmdline(p) for p in workers}
            assert _new_children(baseline) == workers, "a worker was replaced mid-run"
            del batch
            gc.collect()
            time.sleep(QUIESCE_S)  # let the workers fill their buffers: a steady state
            metrics.append(_snapshot(workers))
    assert len(metrics) == epochs and len(seen) == per_epoch // 2
    elapsed = time.monotonic() - t0
    _LOADERS_RAN[0] = True
    # Drop the iterator and the loader mid-epoch (and the last batch: with workers,
    # its arrays live in shared memory that stays open while they are referenced).
    batch = None
    state.clear()
    loader = None
    gc.collect()
    _wait_no_new_children(baseline)
    fds_after = _fd_count(os.getpid())
    print(f"\n{path}: {epochs} epochs in {elapsed:.1f} s; fds {fds_before} -> {fds_after}")
    for e, m in enumerate(metrics, 1):
        print(f"  epoch {e:2d}: {m}")
    assert fds_after <= fds_before, f"the loader left {fds_after - fds_before} descriptors open"
    return metrics


def _assert_flat(metrics: list[dict[str, int]]) -> None:
    first = metrics[0]
    for key in first:
        worst = max(m[key] for m in metrics[1:])
        limit = first[key] * FLAT
        assert worst <= limit, (
            f"{key} grew from {first[key]} after epoch 1 to {worst} "
            f"(allowed {limit:.0f}): {[m[key] for m in metrics]}"
        )


@pytest.mark.timeout(240)
def test_three_epochs_read_every_record_once_with_flat_resources_then_drop_mid_epoch(
    npy_store: str, baseline: set[int], warm_process: None
) -> None:
    _assert_flat(_soak(npy_store, 3, baseline))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fmt", ["hdf5", "npy", "zarr"])
def test_twenty_epochs_read_every_record_once_with_flat_resources_then_drop_mid_epoch(
    fmt: str, tmp_path: Any, baseline: set[int], warm_process: None
) -> None:
    _assert_flat(_soak(_write_store(tmp_path, fmt), 20, baseline))
