from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import pytest
from conformance import DataSourceTests, N, flat, make_tree
from format_checks import assert_loader_delivers_every_record, sorted_tree

import grain_replay as gr
from grain_replay.store.formats import detect_format

pytest.importorskip("tensorstore")
from vault_fixture import write_vault


def _as_rows(tree: Any, batch: int) -> Any:
    """Each (N, ...) leaf as flashbax's (batch, N // batch, ...)."""
    if isinstance(tree, dict):
        return {k: _as_rows(v, batch) for k, v in tree.items()}
    a = np.asarray(tree)
    return a.reshape(batch, len(a) // batch, *a.shape[1:])


def _with_tail(tree: Any, extra: int) -> Any:
    """Steps past the committed vault_index: written, never records."""
    if isinstance(tree, dict):
        return {k: _with_tail(v, extra) for k, v in tree.items()}
    return np.concatenate([tree, np.ones((tree.shape[0], extra, *tree.shape[2:]), tree.dtype)], 1)


class TestVault(DataSourceTests):
    cls = gr.VaultDataSource

    def write(self, path: str, tree: Any) -> str:
        n = len(flat(tree)["reward"])
        return write_vault(path, _with_tail(_as_rows(tree, 1), 5), vault_index=n)

    @pytest.fixture
    def tree(self) -> dict[str, Any]:
        return sorted_tree(make_tree())

    def test_spec_gives_per_record_dtype_and_shape(self, src: gr.ReplaySource) -> None:
        assert src.spec["obs/pixels"].shape == (3, 4)
        assert src.spec["obs/pixels"].dtype == np.uint8
        assert list(src.spec) == ["action", "done", "obs/pixels", "obs/vec", "reward"]

    def test_leaves_over_the_cache_are_read_per_batch_through_tensorstore(
        self, tmp_path: Any, tree: Any, caplog: Any
    ) -> None:
        path = self.write(str(tmp_path / "small"), tree)
        src = gr.VaultDataSource(path, cache_bytes=1000)
        idx = np.array([N - 1, 0, 5, 5, -1])
        want = {k: v[idx] for k, v in flat(tree).items()}
        for k, v in src.read_flat(idx).items():
            np.testing.assert_array_equal(v, want[k], err_msg=k)
        assert "read through tensorstore" in caplog.text
        out = {"obs/vec": np.empty((2, 5), np.float32)}
        src.read_into([3, 4], out)
        np.testing.assert_array_equal(out["obs/vec"], tree["obs"]["vec"][[3, 4]])


def _experience(batch: int, time: int, agents: int = 2) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    step = np.arange(batch * time, dtype=np.int64).reshape(batch, time)
    terminals = np.zeros((batch, time, agents), bool)
    terminals[0, 2, 1] = True  # one agent's flag ends the step's episode
    truncations = np.zeros((batch, time, agents), bool)
    truncations[1, 1, :] = True
    return {
        "step": step,
        "observations": rng.standard_normal((batch, time, agents, 3)).astype(np.float32),
        "terminals": terminals,
        "truncations": truncations,
    }


def test_records_go_batch_row_by_row_time_in_order(tmp_path: Any) -> None:
    exp = _experience(3, 5)
    path = write_vault(str(tmp_path / "v" / "uid"), _with_tail(exp, 3), vault_index=5)
    for where in (path, str(tmp_path / "v")):  # the uid directory, or its vault_name parent
        assert detect_format(where) == "vault"
        src = gr.open_source(where)
        assert isinstance(src, gr.VaultDataSource)
        assert (len(src), src.batch_size, src.vault_index) == (15, 3, 5)
        assert src.read_batch(np.arange(15))["step"].tolist() == exp["step"].reshape(-1).tolist()
        np.testing.assert_array_equal(src[7]["observations"], exp["observations"][1, 2])


def test_episodes_end_at_flags_and_at_each_batch_row(tmp_path: Any) -> None:
    exp = _experience(3, 5)
    src = gr.VaultDataSource(write_vault(str(tmp_path / "v"), exp))
    ends, terminated, open_last = src.episode_bounds()
    # row 0: terminal at t=2, row end at 5; row 1: truncation at t=1, row end; row 2: row end
    assert ends.tolist() == [3, 5, 7, 10, 15]
    assert terminated.tolist() == [True, False, False, False, False]
    assert open_last
    seq = gr.SequenceDataSource(src, offsets={"step": [0, 1]}, pad="edge")
    assert seq.step_episodes.ends.tolist() == [3, 5, 7, 10, 15]
    assert seq[4]["step"].tolist() == [4, 4]  # row 0 never runs on into row 1
    assert seq[2]["step"].tolist() == [2, 2]  # the terminal step ends its episode


def test_vault_without_flags_has_no_episode_bounds(tmp_path: Any) -> None:
    src = gr.VaultDataSource(write_vault(str(tmp_path / "v"), {"x": np.zeros((2, 4))}))
    assert src.episode_bounds() is None


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_and_sharded_device_put(tmp_path: Any, workers: int) -> None:
    tree = make_tree(64)
    tree["index"] = np.arange(64, dtype=np.int64)
    src = gr.VaultDataSource(write_vault(str(tmp_path / "v"), _as_rows(tree, 4)))
    assert len(src) == 64
    assert_loader_delivers_every_record(src, "index", workers=workers)


# -- bad input ---------------------------------------------------------------------------


def test_without_tensorstore_the_error_names_the_extra(tmp_path: Any, monkeypatch: Any) -> None:
    path = write_vault(str(tmp_path / "v"), {"x": np.zeros((1, 4))})
    monkeypatch.setitem(sys.modules, "tensorstore", None)  # import fails
    with pytest.raises(gr.MissingDependencyError, match=r"grain-replay\[vault\]"):
        gr.open_source(path)


def test_several_vaults_in_one_directory_are_listed(tmp_path: Any) -> None:
    for uid in ("a", "b"):
        write_vault(str(tmp_path / "v" / uid), {"x": np.zeros((1, 4))})
    with pytest.raises(gr.InvalidStoreError, match=r"2 Vaults \(\['a', 'b'\]\).*uid"):
        gr.VaultDataSource(str(tmp_path / "v"))
    assert len(gr.VaultDataSource(str(tmp_path / "v" / "b"))) == 4


def test_damaged_metadata_or_missing_leaf_names_it(tmp_path: Any) -> None:
    path = write_vault(str(tmp_path / "v"), {"x": np.zeros((1, 4)), "y": np.ones((1, 4))})
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    meta["structure_shape"]["z"] = "(1, 4)"
    meta["structure_dtype"]["z"] = "float32"
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(gr.InvalidStoreError, match=r"leaf 'z' \(datastore 'z\.'\).*keys="):
        gr.VaultDataSource(path)
    assert gr.VaultDataSource(path, keys=["x", "y"]).keys == ["x", "y"]
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(gr.InvalidStoreError, match=r"metadata\.json: not a flashbax Vault"):
        gr.VaultDataSource(path)
    with pytest.raises(FileNotFoundError, match=r"metadata\.json and manifest\.ocdbt"):
        gr.VaultDataSource(str(tmp_path / "nothing"))
