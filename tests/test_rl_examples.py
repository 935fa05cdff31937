"""The RL examples (record_cartpole, bc_minari, nstep_q, multihost), each run at toy size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from repo_scripts import EXAMPLES, load_example

import grain_replay as gr

pytest.importorskip("gymnasium")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def record_cartpole() -> ModuleType:
    return load_example("record_cartpole")


@pytest.fixture(scope="module")
def bc_minari() -> ModuleType:
    pytest.importorskip("minari")
    return load_example("bc_minari")


@pytest.fixture(scope="module")
def nstep_q() -> ModuleType:
    return load_example("nstep_q")


@pytest.fixture(scope="module")
def multihost() -> ModuleType:
    return load_example("multihost")


# -- record_cartpole ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt",
    [
        "npy",
        "zarr",
        "hdf5",
    ],
)
def test_record_cartpole_index_matches_recorded_episodes(
    record_cartpole: ModuleType, tmp_path: Path, fmt: str
) -> None:
    out = tmp_path / {"npy": "cartpole", "zarr": "cartpole.zarr", "hdf5": "cartpole.h5"}[fmt]
    toy = f"--episodes 5 --max-steps 40 --flush-every 2 --format {fmt} --out {out}"
    result = record_cartpole.main(toy.split())
    assert result["episodes"] == 5 == result["num_episodes"]
    assert result["index_lengths"] == result["lengths"]
    assert result["num_records"] == result["steps"] == sum(result["lengths"])
    assert result["commits"] == 3  # after episodes 2, 4 and 5
    assert result["terminated"] + result["truncated"] == 5
    assert max(result["lengths"]) <= 40

    with gr.open_source(str(out)) as src:
        assert set(src.spec) == {"obs", "action", "reward", "next_obs", "terminated", "truncated"}
        rows = src.read_batch(np.arange(len(src)))
    ends = np.cumsum(result["lengths"]) - 1
    done = rows["terminated"] | rows["truncated"]
    np.testing.assert_array_equal(np.flatnonzero(done), ends)
    # next_obs[t] is obs[t + 1] inside an episode.
    inside = np.setdiff1d(np.arange(len(done) - 1), ends)
    np.testing.assert_array_equal(rows["next_obs"][inside], rows["obs"][inside + 1])

    again = record_cartpole.main(["--episodes", "3", "--max-steps", "40", "--out", str(out)])
    assert again["num_episodes"] == 8  # appended after the committed rows
    assert again["num_records"] == result["steps"] + again["steps"]


def test_record_cartpole_random_policy_without_next_obs(
    record_cartpole: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "random"
    argv = ["--episodes", "6", "--policy", "random", "--no-next-obs", "--out", str(out)]
    result = record_cartpole.main(argv)
    assert result["terminated"] == 6  # a random policy drops the pole long before 500 steps
    assert result["mean_return"] == pytest.approx(np.mean(result["lengths"]))
    with gr.open_source(str(out)) as src:
        assert "next_obs" not in src.spec
        transitions = gr.TransitionDataSource(src)  # next_obs derived from the next step
        assert len(transitions) == result["steps"]  # terminated: every step is a record


def test_record_cartpole_script(tmp_path: Path) -> None:
    cmd = [sys.executable, str(EXAMPLES / "record_cartpole.py"), "--episodes", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "records:" in proc.stdout  # the grain-replay info summary
    assert re.search(r"recorded 3 episodes, .* episode index matches", proc.stdout), proc.stdout


# -- bc_minari -------------------------------------------------------------------------------


def test_bc_minari_loss_drops_on_windows(bc_minari: ModuleType, tmp_path: Path) -> None:
    import jax

    dataset = tmp_path / "cartpole-v0"
    toy = "--episodes 6 --max-episode-steps 60 --window 4 --steps 150 --batch-size 64"
    argv = [*toy.split(), "--log-every", "0", "--dataset", str(dataset)]
    result = bc_minari.main(argv)
    assert (dataset / "data" / "main_data.hdf5").exists()  # recorded there because missing
    assert result["devices"] == jax.device_count()
    assert result["steps"] == 150
    lengths = gr.MinariDataSource(str(dataset)).episodes.lengths
    assert result["episodes"] == 6 and result["transitions"] == lengths.sum()
    assert result["windows"] == int(np.maximum(lengths - 4 + 1, 0).sum())
    assert result["initial_loss"] == pytest.approx(np.log(2), abs=0.05)
    assert result["final_loss"] < 0.75 * result["initial_loss"], result
    assert result["final_accuracy"] > 0.75, result
    assert result["steps_per_s"] > 0

    again = bc_minari.main([*argv[:-2], "--steps", "20", "--dataset", str(dataset)])
    assert again["losses"] == pytest.approx(result["losses"][:20], rel=1e-5)  # same stream


# -- nstep_q ---------------------------------------------------------------------------------


def test_nstep_q_chain_q_star_matches_value_iteration(nstep_q: ModuleType) -> None:
    length, gamma = 7, 0.9
    q = np.zeros((length, 2))
    for _ in range(200):  # value iteration on the chain's model
        v = q.max(axis=1)
        v[length - 1] = 0.0  # terminal
        for s in range(length - 1):
            for a, s2 in ((0, max(s - 1, 0)), (1, s + 1)):
                q[s, a] = float(s2 == length - 1) + gamma * v[s2]
    np.testing.assert_allclose(nstep_q.chain_q_star(length, gamma), q[:-1], rtol=1e-12)


def test_nstep_q_chain_converges_to_q_star(nstep_q: ModuleType, tmp_path: Path) -> None:
    store = tmp_path / "chain"
    toy = "--episodes 400 --steps 500 --batch-size 64 --target-every 100 --log-every 0"
    result = nstep_q.main([*toy.split(), "--store", str(store)])
    assert store.exists()
    assert result["steps"] == 500
    assert result["final_td2"] < 0.01 * result["initial_td2"], result["td2"][::50]
    assert result["q_max_abs_error"] < 0.05, (result["q"], result["q_star"])
    assert result["greedy_is_optimal"]
    # The store keeps observations once: every step of these terminated episodes is a record.
    with gr.open_source(str(store)) as src:
        assert "next_obs" not in src.spec
        assert result["transitions"] == len(src)


def test_nstep_q_cartpole_runs_on_recorded_episodes(nstep_q: ModuleType, tmp_path: Path) -> None:
    store = tmp_path / "cartpole"
    toy = "--env cartpole --episodes 8 --max-episode-steps 50 --steps 60 --batch-size 64"
    result = nstep_q.main([*toy.split(), "--eval-episodes", "1", "--store", str(store)])
    with gr.open_source(str(store)) as src:
        assert "next_obs" in src.spec  # stored: every step is a record
        assert result["transitions"] == len(src)
    assert np.all(np.isfinite(result["td2"]))
    assert result["greedy_return"] >= 1.0


# -- multihost -------------------------------------------------------------------------------


def test_multihost_two_processes_checkpoint_and_resume(
    multihost: ModuleType, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    # 2 processes x 2 CPU devices, global batch 16: one epoch of 128 records is 8 steps.
    toy = "--spawn 2 --local-cpu-devices 2 --num-records 128 --per-host-batch 8 --ckpt-every 2"
    base = [*toy.split(), "--ckpt", str(ckpt), "--log-every", "0"]
    first = multihost.main([*base, "--steps", "4"])
    assert first["process_count"] == 2 and first["global_devices"] == 4
    assert (first["start_step"], first["end_step"]) == (0, 4)
    assert all(len(ids) == 16 for ids in first["global_ids"])
    step_dir = ckpt / "step_4"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "COMMITTED", "loader_state.0", "loader_state.1", "meta.json", "params.npz",
    ]  # fmt: skip
    for r in first["processes"]:  # every process computed the same global loss
        assert r["losses"] == first["losses"]

    second = multihost.main([*base, "--steps", "8"])
    assert (second["start_step"], second["end_step"]) == (4, 8)
    ids = np.concatenate([*first["global_ids"], *second["global_ids"]])
    np.testing.assert_array_equal(np.sort(ids), np.arange(128))  # one epoch, no repeat or gap
    assert second["losses"][-1] < first["losses"][0]  # training continued from the params
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == [
        "step_6", "step_8",
    ]  # fmt: skip

    with pytest.raises(RuntimeError, match="resuming it needs the same global batch"):
        multihost.main([*base[2:], "--spawn", "1", "--steps", "10"])
    # The same global batch on 1 process: it resumes where the 2 processes stopped.
    third = multihost.main([*base[2:], "--spawn", "1", "--per-host-batch", "16", "--steps", "10"])
    assert third["process_count"] == 1
    assert (third["start_step"], third["end_step"]) == (8, 10)
    later = np.concatenate(third["global_ids"])
    assert len(np.unique(later)) == len(later) == 32  # epoch 1 goes on, no record twice


# -- rlds_bc ---------------------------------------------------------------------------------


def test_rlds_bc_learns_action_chunks_from_a_toy_rlds_dataset(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    rlds_bc = load_example("rlds_bc")
    dataset = rlds_bc.write_toy_dataset(str(tmp_path / "toy" / "1.0.0"), episodes=12, seed=0)
    src = gr.open_source(dataset)
    assert isinstance(src, gr.RLDSDataSource) and len(src.episode_ends) == 12
    argv = ["--dataset", dataset, "--steps", "300", "--log-every", "0", "--workers", "0"]
    result = rlds_bc.main(argv)
    assert result["steps"] == 300 and result["records"] == len(src)
    assert result["final_loss"] < 0.6 * result["initial_loss"], result
