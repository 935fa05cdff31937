"""MinariDataSource against datasets recorded by minari's own DataCollector."""

from __future__ import annotations

import os
import pickle
from typing import Any

import h5py
import numpy as np
import pytest
from conformance import SourceTests, flat, slow_in_this_class
from rl_fixtures import collect_minari, register_dict_env, write_minari_file

import grain_replay as gr
from grain_replay.datasets import MinariDataSource
from grain_replay.rl import WindowDataSource

minari = pytest.importorskip("minari")
pytest.importorskip("gymnasium")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _dataset(root: str, dataset_id: str) -> str:
    return os.path.join(root, *dataset_id.split("/"))


@pytest.fixture(scope="module")
def cartpole(minari_root: str) -> str:
    # 12 episodes: episode_10 and episode_11 must come after episode_9.
    collect_minari("CartPole-v1", "cartpole/random-v0", 12, max_steps=15)
    return _dataset(minari_root, "cartpole/random-v0")


@pytest.fixture(scope="module")
def dict_dataset(minari_root: str) -> str:
    collect_minari(register_dict_env(), "dictenv/random-v0", 14, record_infos=True)
    return _dataset(minari_root, "dictenv/random-v0")


def _expect_from_minari(dataset_id: str, infos: bool = False) -> Any:
    """``{key: array}`` of every transition, from minari.load_dataset().iterate_episodes()."""
    cols: dict[str, list[np.ndarray]] = {}
    for ep in minari.load_dataset(dataset_id).iterate_episodes():
        obs = flat({"o": ep.observations})
        rec = {f"observations{k[1:]}": v[:-1] for k, v in obs.items()}
        rec |= flat({"actions": ep.actions})
        rec |= {
            "rewards": ep.rewards, "terminations": ep.terminations,
            "truncations": ep.truncations,
        }  # fmt: skip
        rec |= {f"next_observations{k[1:]}": v[1:] for k, v in obs.items()}
        if infos:
            rec |= {f"infos/{k}": np.asarray(v)[1:] for k, v in ep.infos.items()}
        for k, v in rec.items():
            cols.setdefault(k, []).append(np.asarray(v))
    leaves = {k: np.concatenate(v) for k, v in cols.items()}
    return lambda ids: {k: v[ids] for k, v in leaves.items()}


class TestMinariCartPole(SourceTests):
    def make(self, tmp_path: Any, scale: int) -> MinariDataSource:
        tmp_path.mkdir(parents=True, exist_ok=True)
        return MinariDataSource(write_minari_file(str(tmp_path / "m.hdf5"), [5, 3] * scale))

    @pytest.fixture
    def src(self, cartpole: str) -> MinariDataSource:
        return MinariDataSource(cartpole)

    @pytest.fixture
    def expect(self, cartpole: str) -> Any:
        return _expect_from_minari("cartpole/random-v0")

    def test_every_transition_in_episode_order_matches_minari(
        self, src: MinariDataSource, expect: Any
    ) -> None:
        n = len(src)
        assert n == minari.load_dataset("cartpole/random-v0").total_steps
        got = src.read_flat(np.arange(n))
        want = expect(np.arange(n))
        assert list(got) == [
            "observations", "actions", "rewards", "terminations", "truncations",
            "next_observations",
        ]  # fmt: skip
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)

    def test_episodes_follow_the_episode_groups(self, src: MinariDataSource) -> None:
        eps = list(minari.load_dataset("cartpole/random-v0").iterate_episodes())
        idx = src.episodes
        assert idx.lengths.tolist() == [len(e.rewards) for e in eps]
        assert idx.terminated.tolist() == [bool(e.terminations[-1]) for e in eps]
        assert not idx.terminated.all()  # max_steps=15 truncates some

    def test_windows_over_minari_use_its_episodes(self, src: MinariDataSource) -> None:
        windows = WindowDataSource(src, length=4, keys=["rewards"])
        steps, _ = windows.window_steps(np.arange(len(windows)))
        ep = src.episodes.episode_of(steps)
        assert np.all(ep == ep[:, :1])
        assert len(windows) == int(np.maximum(src.episodes.lengths - 3, 0).sum())

    def test_path_may_be_the_data_folder_or_the_file(self, cartpole: str) -> None:
        a = MinariDataSource(os.path.join(cartpole, "data"))
        b = MinariDataSource(os.path.join(cartpole, "data", "main_data.hdf5"))
        assert repr(a) == repr(b) == repr(MinariDataSource(cartpole))


class TestMinariDictSpace(SourceTests):
    # Grain's worker loader (seconds of spawns): make test runs it on TestMinariCartPole.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    make = TestMinariCartPole.make

    @pytest.fixture
    def src(self, dict_dataset: str) -> MinariDataSource:
        return MinariDataSource(dict_dataset)

    @pytest.fixture
    def expect(self, dict_dataset: str) -> Any:
        return _expect_from_minari("dictenv/random-v0")

    def test_dict_and_tuple_spaces_become_dicts_and_tuples(self, src: MinariDataSource) -> None:
        rec = src[0]
        assert list(rec["observations"]) == ["mode", "pair", "pos"]
        assert isinstance(rec["observations"]["pair"], tuple)
        assert isinstance(rec["next_observations"]["pair"], tuple)
        assert src.spec["observations/pair/0"].shape == (3,)

    def test_infos_are_the_info_returned_by_the_step(self, dict_dataset: str) -> None:
        src = MinariDataSource(dict_dataset, infos=True)
        want = _expect_from_minari("dictenv/random-v0", infos=True)(np.arange(len(src)))
        got = src.read_flat(np.arange(len(src)))
        np.testing.assert_array_equal(got["infos/t"], want["infos/t"])
        np.testing.assert_array_equal(got["infos/t"], got["rewards"].astype(np.int64))

    def test_keys_select_leaves_and_groups(self, dict_dataset: str) -> None:
        src = MinariDataSource(dict_dataset, keys=["observations/pos", "rewards"])
        assert list(src.spec) == ["observations/pos", "rewards"]
        with pytest.raises(gr.UnknownLeafError, match="nope"):
            MinariDataSource(dict_dataset, keys=["nope"])


# -- unhappy paths ----------------------------------------------------------------------


def test_missing_dataset_raises_file_not_found_with_fix(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match="No Minari dataset"):
        MinariDataSource(str(tmp_path / "nope"))
    with pytest.raises(gr.StoreNotFoundError, match=r"data/main_data\.hdf5"):
        MinariDataSource(str(tmp_path))


def test_not_hdf5_raises_invalid_store(tmp_path: Any) -> None:
    path = tmp_path / "main_data.hdf5"
    path.write_bytes(b"plain text")
    with pytest.raises(gr.InvalidStoreError, match="not an HDF5 file"):
        MinariDataSource(str(path))


def test_file_without_episodes_raises_with_fix(tmp_path: Any) -> None:
    path = str(tmp_path / "main_data.hdf5")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(gr.InvalidStoreError, match="no episode_<k> group"):
        MinariDataSource(path)


def test_episode_added_after_pickling_raises_changed(tmp_path: Any) -> None:
    path = write_minari_file(str(tmp_path / "main_data.hdf5"), [2, 3])
    blob = pickle.dumps(MinariDataSource(path))
    with h5py.File(path, "a") as f:
        f.copy("episode_1", "episode_2")
    with pytest.raises(gr.InvalidStoreError, match="changed since the source was made"):
        pickle.loads(blob)[0]
    assert len(MinariDataSource(path)) == 8


def test_mapped_and_h5py_read_paths_agree(tmp_path: Any) -> None:
    """Contiguous, single-chunk, multi-chunk and compressed episodes read the same."""
    path = str(tmp_path / "main_data.hdf5")
    lengths = [4, 6, 5, 3]
    with h5py.File(path, "w") as f:
        for e, n in enumerate(lengths):
            g = f.create_group(f"episode_{e}")
            obs = (np.arange(n + 1, dtype=np.float32)[:, None] + 10 * e) * np.ones(3, np.float32)
            kwargs: dict[str, Any] = [
                {}, {"chunks": True}, {"chunks": (2, 3)}, {"compression": "gzip"}
            ][e]  # fmt: skip
            g.create_dataset("observations", data=obs, **kwargs)
            g["actions"] = np.full(n, e, np.int64)
            g["rewards"] = np.arange(n, dtype=np.float64)
            g["terminations"] = np.arange(n) == n - 1
            g["truncations"] = np.zeros(n, bool)
    src = MinariDataSource(path)
    idx = np.random.default_rng(0).integers(0, len(src), 100)
    got = src.read_flat(idx)
    episode = np.repeat(np.arange(4), lengths)[idx]
    t = idx - (np.cumsum(lengths) - lengths)[episode]
    np.testing.assert_array_equal(got["observations"][:, 0], t + 10 * episode)
    np.testing.assert_array_equal(got["next_observations"][:, 2], t + 1 + 10 * episode)
    np.testing.assert_array_equal(got["actions"], episode)
    addr = src._handle.readers["observations"]._addr
    assert (addr >= 0).tolist() == [True, True, False, False]


def test_episode_with_too_few_observations_raises(tmp_path: Any) -> None:
    path = write_minari_file(str(tmp_path / "main_data.hdf5"), [3, 2])
    with h5py.File(path, "a") as f:
        del f["episode_1/observations"]
        f["episode_1/observations"] = np.zeros(2, np.float32)
    src = MinariDataSource(path)
    src[0]
    with pytest.raises(gr.InvalidStoreError, match=r"episode 1 has 2 rows of 'observations'"):
        src.read_batch([3, 4])
