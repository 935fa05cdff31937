"""D4RLDataSource over synthetic D4RL-layout files written with h5py."""

from __future__ import annotations

import logging
from typing import Any

import h5py
import numpy as np
import pytest
from conformance import SourceTests, slow_in_this_class
from rl_fixtures import ref_nstep, write_d4rl

import grain_replay as gr
from grain_replay.datasets import D4RLDataSource
from grain_replay.rl import EpisodeIndex, NStepDataSource, WindowDataSource

LENGTHS = [6, 1, 4, 3, 5]
TERMINATED = [True, False, False, True, True]
ORDER = ["actions", "infos/qpos", "observations", "rewards", "terminals", "timeouts"]


def _expect(data: dict[str, np.ndarray], stored: bool) -> Any:
    ref = ref_nstep(LENGTHS, TERMINATED, data["rewards"], 1, 1.0, stored)
    t = np.array([r["t"] for r in ref])
    boot = np.array([r["boot"] for r in ref])
    nxt = data["next_observations"] if stored else data["observations"]

    def expect(ids: np.ndarray) -> dict[str, Any]:
        out = {k: data[k][t[ids]] for k in ORDER}
        out["next_observations"] = nxt[boot[ids]]
        return out

    return expect


class TestD4RLStoredNextObs(SourceTests):
    stored = True

    def make(self, tmp_path: Any, scale: int) -> D4RLDataSource:
        tmp_path.mkdir(parents=True, exist_ok=True)
        path = str(tmp_path / "d4rl.hdf5")
        write_d4rl(path, LENGTHS * scale, TERMINATED * scale, next_obs=self.stored)
        return D4RLDataSource(path)

    @pytest.fixture
    def src(self, tmp_path: Any) -> D4RLDataSource:
        return self.make(tmp_path, 1)

    @pytest.fixture
    def expect(self, tmp_path: Any) -> Any:
        data = write_d4rl(str(tmp_path / "ref.hdf5"), LENGTHS, TERMINATED, next_obs=self.stored)
        return _expect(data, self.stored)

    def test_fields_keep_d4rl_names(self, src: D4RLDataSource) -> None:
        assert list(src.spec) == [*ORDER, "next_observations"]

    def test_episodes_come_from_terminals_or_timeouts(self, src: D4RLDataSource) -> None:
        assert src.step_episodes == EpisodeIndex.from_lengths(LENGTHS, TERMINATED)
        removed = 0 if self.stored else TERMINATED.count(False)
        assert len(src) == sum(LENGTHS) - removed == src.episodes.num_steps


class TestD4RLDerivedNextObs(TestD4RLStoredNextObs):
    # Grain's worker loader (seconds of spawns): make test runs it on TestD4RLStoredNextObs.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    stored = False


def test_datasets_of_other_lengths_are_skipped_with_a_log_line(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "d.hdf5")
    write_d4rl(path, LENGTHS, TERMINATED)
    with caplog.at_level(logging.INFO, logger="grain_replay.datasets.d4rl"):
        src = D4RLDataSource(path)
    assert "metadata/algorithm" in caplog.text and "metadata/policy/fc0/weight" in caplog.text
    assert not any(k.startswith("metadata") for k in src.spec)


def test_unterminated_last_episode_is_open(tmp_path: Any) -> None:
    path = str(tmp_path / "d.hdf5")
    write_d4rl(path, LENGTHS, TERMINATED, open_last=True, next_obs=False)
    src = D4RLDataSource(path)
    assert src.step_episodes.open_last
    assert len(src) == sum(LENGTHS) - TERMINATED.count(False) - 1


def test_windows_and_nstep_over_a_d4rl_file(tmp_path: Any) -> None:
    path = str(tmp_path / "d.hdf5")
    write_d4rl(path, LENGTHS, TERMINATED)
    src = D4RLDataSource(path)
    windows = WindowDataSource(src, length=3, keys=["observations"])
    assert len(windows) == sum(max(0, n - 2) for n in LENGTHS)
    obs = windows.read_batch(np.arange(len(windows)))["observations"][..., 0]
    assert np.all(np.diff(obs, axis=1) == 1)
    nstep = NStepDataSource(src.source, n=2, obs_key="observations", reward_key="rewards")
    assert nstep.read_batch([0])["next_observations"][0, 0] == 1.5  # stored next obs of step 1


def test_only_terminals_warns_and_reads(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "d.hdf5")
    write_d4rl(path, LENGTHS, TERMINATED)
    with h5py.File(path, "a") as f:
        del f["timeouts"]
    with caplog.at_level(logging.WARNING, logger="grain_replay.datasets.d4rl"):
        src = D4RLDataSource(path)
    assert "no 'timeouts'" in caplog.text
    assert src.step_episodes.num_episodes == TERMINATED.count(True)


def test_missing_file_raises_file_not_found(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match="No D4RL file"):
        D4RLDataSource(str(tmp_path / "missing.hdf5"))


def test_not_hdf5_raises_invalid_store(tmp_path: Any) -> None:
    path = tmp_path / "x.hdf5"
    path.write_bytes(b"not hdf5 at all")
    with pytest.raises(gr.InvalidStoreError, match="not an HDF5 file"):
        D4RLDataSource(str(path))


def test_missing_required_datasets_raise_listing_them(tmp_path: Any) -> None:
    path = str(tmp_path / "d.hdf5")
    with h5py.File(path, "w") as f:
        f["observations"] = np.zeros((3, 2))
    with pytest.raises(gr.InvalidStoreError, match=r"\['actions', 'rewards'\] are missing"):
        D4RLDataSource(path)


def test_no_episode_flags_raise_with_fix(tmp_path: Any) -> None:
    path = str(tmp_path / "d.hdf5")
    write_d4rl(path, LENGTHS, TERMINATED)
    with h5py.File(path, "a") as f:
        del f["timeouts"], f["terminals"]
    with pytest.raises(
        gr.InvalidStoreError, match=r"neither 'terminals' nor 'timeouts'.*done_key="
    ):
        D4RLDataSource(path)
