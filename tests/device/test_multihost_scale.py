"""2 and 4 JAX processes (gloo over localhost, 2 CPU devices each): coverage and exact resume.

Also elastic resume: a job saved on 4 processes resumes on 2, and that one's
checkpoint on 4 again, each continuing the same global stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import run_workers

import grain_replay as gr

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "multihost_resume_worker.py"
BATCH = 4  # per process
STEPS_PER_EPOCH = 3  # global batches per epoch
SAVE_AT = 2  # the resumed run starts at global step 2 and crosses into epoch 1


def _run_job(num_processes: int, out_dir: Path, *extra: str) -> list[dict[str, Any]]:
    """Runs the processes to completion; kills all and reports their output on any failure."""
    return run_workers(
        WORKER, num_processes, out_dir, f"--num-processes={num_processes}", *extra,
        local_devices=2,
    )  # fmt: skip


def _write_store(path: Path, n: int) -> str:
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((n, 3)).astype(np.float32)
    obs[:, 0] = np.arange(n)  # the jitted sums can be checked against the ids
    gr.write(str(path), {"id": np.arange(n, dtype=np.int32), "obs": obs})
    return str(path)


def _check_full_run(full: list[dict[str, Any]], num_processes: int, n: int) -> np.ndarray:
    """The job's global stream: every process saw it, each its disjoint share of every
    batch, every record once per epoch, shuffled afresh each epoch. Returns it."""
    global_batch = n // STEPS_PER_EPOCH
    assert [r["process_index"] for r in full] == list(range(num_processes))
    assert len({r["pid"] for r in full}) == num_processes
    stream = np.array(full[0]["global_ids"])
    assert stream.shape == (2 * STEPS_PER_EPOCH, global_batch)
    for r in full[1:]:  # every process saw the same global batches
        np.testing.assert_array_equal(r["global_ids"], stream)
    for step in range(len(stream)):  # each the union of the processes' disjoint shares
        shares = np.concatenate([r["local_ids"][step] for r in full])
        np.testing.assert_array_equal(np.sort(shares), np.sort(stream[step]))
    epochs = stream.reshape(2, n)
    for epoch in epochs:  # every record exactly once per epoch
        np.testing.assert_array_equal(np.sort(epoch), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh permutation each epoch
    assert not np.array_equal(epochs[0], np.arange(n))  # shuffled
    return stream


# `make test-slow`: each job of 2 (or 4) processes resumed on as many. make test covers
# the same checks in test_resume_on_another_process_count_continues_the_global_stream
# (jobs of 2, 4, 2: its last job of 2 resumes each process's own share of the first's).
@pytest.mark.slow
@pytest.mark.parametrize("num_processes", [2, 4])
def test_processes_cover_each_epoch_once_and_resume_the_identical_stream(
    tmp_path: Path, num_processes: int
) -> None:
    global_batch = num_processes * BATCH
    n = STEPS_PER_EPOCH * global_batch
    store = _write_store(tmp_path / "store.h5", n)
    common = [f"--store={store}", f"--batch-size={BATCH}", "--num-epochs=2"]
    state_dir = tmp_path / "state"

    full = _run_job(
        num_processes, tmp_path / "full", *common, f"--save-at={SAVE_AT}",
        f"--state-dir={state_dir}",
    )  # fmt: skip
    stream = _check_full_run(full, num_processes, n)
    saved = sorted(p.name for p in state_dir.iterdir())
    assert saved == [f"state.{i}" for i in range(num_processes)]

    resumed = _run_job(num_processes, tmp_path / "resumed", *common, f"--resume-dir={state_dir}")
    for r in resumed:
        np.testing.assert_array_equal(r["global_ids"], stream[SAVE_AT:])
    for p in range(num_processes):  # each process resumed its own share
        np.testing.assert_array_equal(resumed[p]["local_ids"], full[p]["local_ids"][SAVE_AT:])


def test_resume_on_another_process_count_continues_the_global_stream(tmp_path: Path) -> None:
    """A job of 2 saved, resumed on 4, that one's checkpoint resumed on 2 again: each
    continues the same global stream; the last job's processes their own shares of it."""
    global_batch = 16  # 2 processes x 8, or 4 x 4
    n = STEPS_PER_EPOCH * global_batch
    store = _write_store(tmp_path / "store.h5", n)
    common = [f"--store={store}", "--num-epochs=2"]
    on_two, on_four = tmp_path / "state2", tmp_path / "state4"

    first = _run_job(
        2, tmp_path / "two", *common, "--batch-size=8", "--save-at=1", f"--state-dir={on_two}"
    )
    stream = _check_full_run(first, 2, n)
    assert sorted(p.name for p in on_two.iterdir()) == ["state.0", "state.1"]

    second = _run_job(
        4, tmp_path / "four", *common, "--batch-size=4", f"--resume-dir={on_two}",
        "--save-at=2", f"--state-dir={on_four}",
    )  # fmt: skip
    assert len({r["pid"] for r in second}) == 4
    for r in second:  # from global step 1, saved again at step 3
        np.testing.assert_array_equal(r["global_ids"], stream[1:])
    for step in range(len(stream) - 1):  # the 4 processes' disjoint shares
        shares = np.concatenate([r["local_ids"][step] for r in second])
        np.testing.assert_array_equal(np.sort(shares), np.sort(stream[1 + step]))
    assert sorted(p.name for p in on_four.iterdir()) == [f"state.{i}" for i in range(4)]

    third = _run_job(
        2, tmp_path / "two-again", *common, "--batch-size=8", f"--resume-dir={on_four}"
    )
    for p, r in enumerate(third):  # from global step 3: crosses into epoch 1
        np.testing.assert_array_equal(r["global_ids"], stream[3:])
        # Each process resumes its own share, as the first job of 2 read it.
        np.testing.assert_array_equal(r["local_ids"], first[p]["local_ids"][3:])
    # Each run's shares: every record exactly once per epoch over the three runs.
    steps = [first[0]["global_ids"][:1], second[0]["global_ids"][:2], third[0]["global_ids"]]
    seen = np.concatenate([np.ravel(s) for s in steps if len(s)])
    for epoch in seen.reshape(2, n):
        np.testing.assert_array_equal(np.sort(epoch), np.arange(n))


def test_resident_replay_two_processes_same_stream_and_state_bytes(tmp_path: Path) -> None:
    """Each process holds a replica; the global batch is assembled as the host pipeline does."""
    import grain

    num_processes = 2
    n = STEPS_PER_EPOCH * num_processes * BATCH
    store = _write_store(tmp_path / "store.h5", n)
    # The host pipeline's stream, process by process, without a JAX job.
    src = gr.open_source(store)
    host_ids, host_states = [], []
    for p in range(num_processes):
        loader = gr.make_data_loader(
            src, batch_size=BATCH, num_epochs=2, seed=3,
            shard_options=grain.sharding.ShardOptions(p, num_processes, drop_remainder=True),
        )  # fmt: skip
        it = iter(loader)
        host_ids.append([next(it)["id"].tolist() for _ in range(2 * STEPS_PER_EPOCH)])
        resumed = iter(loader)
        for _ in range(SAVE_AT):
            next(resumed)
        host_states.append(resumed.get_state())
    stream = np.concatenate([np.array(ids) for ids in host_ids], axis=1)

    # Windows of 4 batches, not 64 (whose gather program takes seconds to compile in each
    # process): the resume at step 2 is mid-window, the stream of 6 steps two windows.
    common = [
        f"--store={store}", f"--batch-size={BATCH}", "--num-epochs=2", "--resident", "--window=4"
    ]  # fmt: skip
    state_dir = tmp_path / "state"
    full = _run_job(
        num_processes, tmp_path / "full", *common, f"--save-at={SAVE_AT}",
        f"--state-dir={state_dir}",
    )  # fmt: skip
    for p, r in enumerate(full):
        np.testing.assert_array_equal(r["global_ids"], stream)
        np.testing.assert_array_equal(r["local_ids"], host_ids[p])
        assert (state_dir / f"state.{p}").read_bytes() == host_states[p]

    resumed = _run_job(num_processes, tmp_path / "resumed", *common, f"--resume-dir={state_dir}")
    for p, r in enumerate(resumed):
        np.testing.assert_array_equal(r["global_ids"], stream[SAVE_AT:])
        np.testing.assert_array_equal(r["local_ids"], host_ids[p][SAVE_AT:])
