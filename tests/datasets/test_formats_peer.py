"""Our readers against the libraries that wrote the files: torchrl buffer dumps written by
``ReplayBuffer.dumps`` and flashbax Vaults written by ``flashbax.vault.Vault``, compared with what
torchrl's ``ReplayBuffer.loads`` and flashbax's ``Vault.read()`` return.

torch, torchrl and flashbax live in their own venv: ``make test-formats`` creates it
(``.venv-formats/``) and sets ``FORMATS_PYTHON``; without it these tests skip. The peer side
(tests/helpers/formats_peer.py) runs there and hands its reads over as ``.npy`` files.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import numpy as np
import pytest
from format_checks import assert_loader_delivers_every_record

import grain_replay as gr

PEER = os.environ.get("FORMATS_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not (PEER and os.access(PEER, os.X_OK)),
    reason="needs torchrl and flashbax: run `make test-formats` (sets FORMATS_PYTHON)",
)
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "helpers", "formats_peer.py")


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> str:
    out = str(tmp_path_factory.mktemp("peer"))
    run = subprocess.run([PEER, SCRIPT, out], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def _expect(root: str, case: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    folder = os.path.join(root, case + ".expect")
    with open(os.path.join(folder, "info.json")) as f:
        info = json.load(f)
    return {k: np.load(os.path.join(folder, v)) for k, v in info["files"].items()}, info


@pytest.mark.parametrize(
    "case",
    [
        "torchrl_partial",
        "torchrl_wrapped",
        "torchrl_pytree",
        "torchrl_h5_partial",  # H5StorageCheckpointer's checkpoint.h5
        "torchrl_h5_wrapped",
    ],
)
def test_torchrl_dump_equals_torchrl_loads_oldest_first(root: str, case: str) -> None:
    want, info = _expect(root, case)
    src = gr.open_source(os.path.join(root, case))
    assert isinstance(src, gr.TorchRLDataSource)
    assert len(src) == info["len"] and sorted(src.keys) == sorted(want)
    wrapped = info.get("written", 0) > info["capacity"]
    start = info["cursor"] % info["capacity"] if wrapped else 0
    rows = (np.arange(len(src)) + start) % info["len"]  # storage row of each record
    got = src.read_flat(np.arange(len(src)))
    for k, w in want.items():
        g = got[k].astype(np.float32) if got[k].dtype.name == "bfloat16" else got[k]
        assert g.dtype == w.dtype, (k, g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w[rows], err_msg=k)
    if wrapped:  # oldest first: the rows written last are the last records
        assert got["index"].tolist() == list(range(info["written"] - info["len"], info["written"]))


def test_vault_equals_flashbax_read(root: str) -> None:
    want, info = _expect(root, "peer.vlt")
    src = gr.open_source(os.path.join(root, "peer.vlt"))  # the vault_name directory
    assert isinstance(src, gr.VaultDataSource)
    batch, time = want["index"].shape[:2]
    assert (src.batch_size, src.vault_index, len(src)) == (batch, info["vault_index"], batch * time)
    got = src.read_flat(np.arange(len(src)))
    for k, w in want.items():
        np.testing.assert_array_equal(got[k], w.reshape(batch * time, *w.shape[2:]), err_msg=k)
    ends, terminated, _ = src.episode_bounds()
    flags = (want["terminals"] | want["truncations"]).reshape(batch, time, -1).any(-1)
    flags[:, -1] = True
    assert ends.tolist() == (np.flatnonzero(flags.reshape(-1)) + 1).tolist()
    term = want["terminals"].reshape(batch * time, -1).any(-1)
    assert terminated.tolist() == term[ends - 1].tolist()


@pytest.mark.parametrize("case", ["torchrl_wrapped", "torchrl_h5_wrapped", "peer.vlt"])
def test_library_files_through_two_workers_and_sharded_device_put(root: str, case: str) -> None:
    src = gr.open_source(os.path.join(root, case))
    _, info = _expect(root, case)
    # torchrl's index counts every row written; the records start at the oldest one kept.
    offset = info.get("written", len(src)) - len(src)
    assert_loader_delivers_every_record(src, "index", workers=2, offset=offset)
