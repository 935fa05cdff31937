"""gr.shutdown_distributed(): processes of a gloo job leave together, without the exit stall.

With a bare ``jax.distributed.shutdown()`` after ``sync_global_devices``, about one
job in five on the loaded 2-core CI machine stalled ~150 s at exit: the other local
devices' collectives were still connecting their gloo pairs when the first device's
result let the process go on (docs/multihost.md, "Leaving the job"). Each job here
must finish within the job limit (``procs.JOB_TIMEOUT_S``, 120 s: below the stall).
"""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from procs import run_workers

import grain_replay as gr

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "multihost_shutdown_worker.py"


def _run_job(num_processes: int, out_dir: Path) -> list[dict[str, object]]:
    return run_workers(WORKER, num_processes, out_dir, f"--num-processes={num_processes}")


@pytest.mark.parametrize("attempt", [0, 1])
def test_two_processes_leave_within_the_job_limit_after_sync_global_devices(
    tmp_path: Path, attempt: int
) -> None:
    results = _run_job(2, tmp_path)
    assert [r["process_index"] for r in results] == [0, 1]
    assert all(r["process_count"] == 2 for r in results)
    assert not any(r["initialized_after"] for r in results)


def test_one_initialized_process_is_shut_down(tmp_path: Path) -> None:
    (result,) = _run_job(1, tmp_path)
    assert result["process_count"] == 1
    assert result["initialized_after"] is False


def test_without_a_distributed_job_it_does_nothing() -> None:
    assert not jax.distributed.is_initialized()
    gr.shutdown_distributed()
    assert not jax.distributed.is_initialized()
    assert float(jax.numpy.ones(3).sum()) == 3.0  # the backend is untouched
