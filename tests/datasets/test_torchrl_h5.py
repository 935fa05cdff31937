"""torchrl dumps by ``H5StorageCheckpointer`` (``storage/checkpoint.h5``), read in place.

The files are written to torchrl's layout by tests/helpers/torchrl_fixture.py (checked
against files torchrl itself wrote in test_formats_peer.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import h5py
import numpy as np
import pytest
from conformance import SourceTests, assert_flat_equal, flat, slow_in_this_class
from format_checks import assert_loader_delivers_every_record
from torchrl_fixture import h5_records, write_h5_checkpoint

import grain_replay as gr
from grain_replay.store.formats import detect_format


def ted_storage(capacity: int, lengths: list[int], seed: int = 0) -> tuple[dict, int, int]:
    """A round-robin storage after writing episodes of ``lengths`` steps: (storage, len, shift)."""
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    step = np.arange(total)
    episode = np.repeat(np.arange(len(lengths)), lengths)
    last = np.zeros(total, bool)
    last[np.cumsum(lengths) - 1] = True
    obs = np.stack([step, episode, step * 0.5], 1).astype(np.float32)
    pixels = rng.integers(0, 255, (total, 2, 3), dtype=np.uint8)
    # torchrl's checkpointer assumes next/<key> is <key> of the next step, but at an episode's end.
    next_obs, next_pixels = np.roll(obs, -1, 0), np.roll(pixels, -1, 0)
    next_obs[last] = np.stack([step[last] + 1, episode[last], -np.ones(last.sum())], 1)
    next_pixels[last] = rng.integers(0, 255, (int(last.sum()), 2, 3), dtype=np.uint8)
    rows = {
        "index": step,
        "action": rng.integers(0, 4, (total, 2)),
        "observation": obs,
        "pixels": pixels,
        "collector/traj_ids": episode,
        "done": np.zeros((total, 1), bool),
        "terminated": np.zeros((total, 1), bool),
        "next/observation": next_obs,
        "next/pixels": next_pixels,
        "next/reward": rng.standard_normal((total, 1)).astype(np.float32),
        "next/done": last[:, None].copy(),
        "next/terminated": last[:, None] & (episode[:, None] % 2 == 0),
        "next/truncated": last[:, None] & (episode[:, None] % 2 == 1),
    }
    storage: dict[str, Any] = {}
    for key, a in rows.items():
        full = np.zeros((capacity, *a.shape[1:]), a.dtype)
        full[step % capacity] = a  # later writes overwrite the oldest slots
        node = storage
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = full
    return storage, min(total, capacity), (total - 1) % capacity + 1


def write_case(path: str, capacity: int, lengths: list[int], **kw: Any) -> tuple[str, dict]:
    storage, length, shift = ted_storage(capacity, lengths)
    write_h5_checkpoint(path, storage, length=length, shift=shift, **kw)
    return path, h5_records(storage, length=length, shift=shift)


class _H5Tests(SourceTests):
    capacity = 120
    lengths = (9, 14, 1, 30, 7, 22, 11)

    def make(self, tmp_path: Any, scale: int) -> Any:
        os.makedirs(tmp_path, exist_ok=True)
        path, _ = write_case(str(tmp_path / "rb"), 200 * scale, [13] * (8 * scale))
        return gr.TorchRLDataSource(path)

    @pytest.fixture
    def case(self, tmp_path: Any) -> tuple[str, dict]:
        return write_case(str(tmp_path / "rb"), self.capacity, list(self.lengths))

    @pytest.fixture
    def src(self, case: tuple[str, dict]) -> gr.ReplaySource:
        return gr.TorchRLDataSource(case[0])

    @pytest.fixture
    def expect(self, case: tuple[str, dict]) -> Any:
        return lambda ids: {k: v[ids] for k, v in case[1].items()}

    def test_records_are_the_steps_torchrl_loads_oldest_first(
        self, src: gr.ReplaySource, case: tuple[str, dict]
    ) -> None:
        want = case[1]
        assert len(src) == min(self.capacity, sum(self.lengths))
        assert_flat_equal(src.read_flat(np.arange(len(src))), want)
        assert src[0]["index"] == sum(self.lengths) - len(src)  # the oldest step kept
        got = src.read_flat(np.arange(len(src)))
        # next/observation of a step is the observation of the next step of its episode.
        same = ~got["next/done"][:-1, 0]
        np.testing.assert_array_equal(
            got["next/observation"][:-1][same], got["observation"][1:][same]
        )
        assert not got["done"].any() and got["next/done"].sum() >= 1


class TestH5PartlyFilled(_H5Tests):
    """94 of 120 rows: the last group is the unfilled rows, which are not records."""


class TestH5Wrapped(_H5Tests):
    # Grain's worker loader (seconds of spawns): make test runs it on TestH5PartlyFilled.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    capacity = 60  # 94 steps through 60 slots: the groups are rolled, oldest first


def test_open_source_detects_the_dump_its_storage_and_the_file(tmp_path: Any) -> None:
    path, want = write_case(str(tmp_path / "rb"), 50, [10, 20, 5])
    storage = os.path.join(path, "storage")
    for where in (path, storage):
        assert detect_format(where) == "torchrl"
        src = gr.open_source(where)
        assert isinstance(src, gr.TorchRLDataSource) and len(src) == 35
    src = gr.TorchRLDataSource(os.path.join(storage, "checkpoint.h5"))
    assert_flat_equal(src.read_flat([34, 0]), {k: v[[34, 0]] for k, v in want.items()})
    assert "checkpoint.h5" in repr(src)
    only = gr.TorchRLDataSource(path, keys=["next"])
    assert only.keys == [k for k in want if k.startswith("next/")]
    windows = only.read_windows("next/reward", [0, 30], 5)
    np.testing.assert_array_equal(windows[1, :, 0], want["next/reward"][30:35, 0])


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_with_workers_and_sharded_device_put(tmp_path: Any, workers: int) -> None:
    path, _ = write_case(str(tmp_path / "rb"), 48, [20, 15, 30])  # wrapped: 65 steps, 48 slots
    src = gr.open_source(path)
    assert_loader_delivers_every_record(src, "index", workers=workers, offset=65 - 48)


def test_compressed_datasets_read_through_h5py_with_a_warning(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path, want = write_case(
        str(tmp_path / "rb"), 70, [12, 30, 9], h5_kwargs={"compression": "gzip"}
    )
    src = gr.TorchRLDataSource(path)
    idx = np.array([50, 0, 11, 12, 50, 20])
    with caplog.at_level(logging.WARNING):
        got = src.read_flat(idx)
    assert_flat_equal(got, {k: v[idx] for k, v in want.items()})
    assert "chunked or compressed" in caplog.text and "grain-replay convert" in caplog.text


# -- bad input ---------------------------------------------------------------------------


def _h5(path: str) -> str:
    return os.path.join(path, "storage", "checkpoint.h5")


def test_a_file_that_is_not_hdf5_names_it_and_the_fix(tmp_path: Any) -> None:
    storage = tmp_path / "rb" / "storage"
    storage.mkdir(parents=True)
    (storage / "checkpoint.h5").write_bytes(b"\x89HDF\r\n\x1a\n")
    assert detect_format(str(tmp_path / "rb")) == "torchrl"
    with pytest.raises(gr.InvalidStoreError, match=r"checkpoint\.h5: not a readable HDF5.*Fix"):
        gr.open_source(str(tmp_path / "rb"))


def test_an_hdf5_file_of_another_writer_is_refused(tmp_path: Any) -> None:
    file = tmp_path / "rb" / "storage" / "checkpoint.h5"
    file.parent.mkdir(parents=True)
    with h5py.File(file, "w") as f:
        f["obs"] = np.zeros((4, 2))
    with pytest.raises(gr.InvalidStoreError, match=r"checkpoint\.h5: no '_len'.*H5Storage"):
        gr.open_source(str(tmp_path / "rb"))
    with h5py.File(file, "a") as f:
        f["_len"] = 4
    with pytest.raises(gr.InvalidStoreError, match=r"no traj_\* group"):
        gr.open_source(str(tmp_path / "rb"))


def test_groups_that_disagree_name_the_group_and_leaf(tmp_path: Any) -> None:
    path, _ = write_case(str(tmp_path / "rb"), 50, [10, 20, 5])
    with h5py.File(_h5(path), "a") as f:
        del f["traj_1/action"]
        f["traj_1/action"] = np.zeros((20, 3), np.int64)  # 3 columns where traj_0 has 2
    with pytest.raises(gr.InvalidStoreError, match=r"traj_1/action is int64 \(20, 3\)"):
        gr.TorchRLDataSource(path)
    with h5py.File(_h5(path), "a") as f:
        del f["traj_1/action"]
    with pytest.raises(gr.InvalidStoreError, match=r"'traj_1' has no dataset 'action'"):
        gr.TorchRLDataSource(path)
    with h5py.File(_h5(path), "a") as f:
        f["traj_0/odd"] = np.zeros(4)  # neither 10 nor 11 rows
    with pytest.raises(gr.InvalidStoreError, match=r"traj_0/odd has 4 rows.*10 steps"):
        gr.TorchRLDataSource(path)


def test_length_past_the_trajectories_and_several_dims_are_refused(tmp_path: Any) -> None:
    path, _ = write_case(str(tmp_path / "rb"), 50, [10, 20, 5])
    with h5py.File(_h5(path), "a") as f:
        del f["_len"]
        f["_len"] = 99
    with pytest.raises(gr.InvalidStoreError, match=r"'_len' says 99 records.*hold 50"):
        gr.TorchRLDataSource(path)
    with h5py.File(_h5(path), "a") as f:
        del f["_len"], f["_storage_shape"]
        f["_len"] = 35
        f["_storage_shape"] = np.array([25, 2])
    with pytest.raises(gr.InvalidStoreError, match=r"shape is \[25, 2\].*ndim=1"):
        gr.TorchRLDataSource(path)


def test_string_leaves_are_refused_only_when_selected(tmp_path: Any) -> None:
    path, _ = write_case(str(tmp_path / "rb"), 50, [10, 20, 5])
    with h5py.File(_h5(path), "a") as f:
        for g, n in (("traj_0", 10), ("traj_1", 20), ("traj_2", 5), ("traj_3", 15)):
            f[f"{g}/note"] = np.array([b"x"] * n, dtype="S1").astype(h5py.string_dtype())
    with pytest.raises(gr.InvalidStoreError, match=r"leaf 'note' \(traj_0/note\).*keys="):
        gr.TorchRLDataSource(path)
    assert gr.TorchRLDataSource(path, keys=["action"]).keys == ["action"]


def test_truncated_file_names_it(tmp_path: Any) -> None:
    path, _ = write_case(str(tmp_path / "rb"), 50, [10, 20, 5])
    src = gr.TorchRLDataSource(path, keys=["observation"])
    with h5py.File(_h5(path)) as f:
        end = f["traj_2/observation"].id.get_offset() + 8
    with open(_h5(path), "r+b") as f:
        f.truncate(end)
    with pytest.raises(gr.InvalidStoreError, match=r"checkpoint\.h5.*(truncated|reading failed)"):
        src.read_batch([0])


def test_pickled_source_carries_no_trajectory_index(tmp_path: Any) -> None:
    import pickle

    path, want = write_case(str(tmp_path / "rb"), 500, [3] * 150)
    src = gr.TorchRLDataSource(path)
    src.read_batch([0])
    clone = pickle.loads(pickle.dumps(src))
    assert len(pickle.dumps(src)) < 4096
    assert_flat_equal(flat(clone.read_batch([449, 3])), {k: v[[449, 3]] for k, v in want.items()})
