"""Two JAX processes (gloo over localhost, 4 CPU devices each) read one store together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import run_workers

import grain_replay as gr

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "multihost_worker.py"
NUM_PROCESSES = 2


def _run_job(store: str, batch_size: int, out_dir: Path) -> list[dict[str, Any]]:
    """Runs the two processes to completion; kills both and reports their output on any failure."""
    return run_workers(
        WORKER, NUM_PROCESSES, out_dir, f"--store={store}", f"--batch-size={batch_size}"
    )


# A divisible store under -m slow: in make test, the remainder case reads the same
# global batches and drops the rest, and every record once per epoch is checked on
# divisible stores by the RLDS case below and test_multihost_scale.py.
@pytest.mark.parametrize(
    "n", [pytest.param(96, marks=pytest.mark.slow), 100], ids=["divisible", "remainder"]
)
def test_two_processes_read_every_record_once_per_epoch(tmp_path: Path, n: int) -> None:
    b = 8
    store = str(tmp_path / "store.h5")
    gr.write(
        store,
        {
            "id": np.arange(n, dtype=np.int32),
            "obs": np.random.default_rng(0).standard_normal((n, 3)).astype(np.float32),
            "reward": (np.arange(n) * 0.5).astype(np.float32),
        },
    )
    results = _run_job(store, b, tmp_path)

    assert [r["process_index"] for r in results] == [0, 1]
    assert results[0]["pid"] != results[1]["pid"]
    per_process = n // (NUM_PROCESSES * b)
    assert results[0]["num_batches"] == results[1]["num_batches"] == per_process
    local = [np.array(r["local_ids"]) for r in results]
    assert all(x.shape == (per_process, b) for x in local)

    seen = np.concatenate([x.ravel() for x in local])
    assert len(np.unique(seen)) == len(seen) == per_process * NUM_PROCESSES * b
    if n % (NUM_PROCESSES * b) == 0:
        np.testing.assert_array_equal(np.sort(seen), np.arange(n))
    assert n - len(seen) < NUM_PROCESSES * b

    # Both processes saw the same global batches, each the union of their local halves.
    np.testing.assert_array_equal(results[0]["global_ids"], results[1]["global_ids"])
    for step, global_ids in enumerate(results[0]["global_ids"]):
        halves = np.concatenate([local[0][step], local[1][step]])
        np.testing.assert_array_equal(np.sort(global_ids), np.sort(halves))
    # A shuffled epoch, not the records in order.
    assert not np.array_equal(seen, np.arange(len(seen)))


def test_two_processes_read_an_rlds_dataset_once_per_epoch(tmp_path: Path) -> None:
    from rlds_fixture import write_rlds_columns

    n, b = 96, 8
    store = write_rlds_columns(
        tmp_path / "rlds",
        {
            "id": np.arange(n, dtype=np.int32),
            "obs": np.random.default_rng(0).standard_normal((n, 3)).astype(np.float32),
            "reward": (np.arange(n) * 0.5).astype(np.float32),
        },
        lengths=[10, 30, 7, 25, 24],
        shards=3,
    )
    assert isinstance(gr.open_source(store), gr.RLDSDataSource)
    results = _run_job(store, b, tmp_path)
    seen = np.concatenate([np.array(r["local_ids"]).ravel() for r in results])
    np.testing.assert_array_equal(np.sort(seen), np.arange(n))
    np.testing.assert_array_equal(results[0]["global_ids"], results[1]["global_ids"])
