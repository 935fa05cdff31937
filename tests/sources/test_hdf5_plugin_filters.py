"""HDF5 files compressed with hdf5plugin filters: named when missing, loaded in workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.hdf5 import filters as hdf5_filters

h5py = pytest.importorskip("h5py")
hdf5plugin = pytest.importorskip("hdf5plugin")

N = 600


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("plugin") / "plugin.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "obs", data=np.arange(N * 3, dtype=np.float32).reshape(N, 3), chunks=(64, 3),
            **hdf5plugin.Blosc(),
        )  # fmt: skip
        f.create_dataset(
            "reward", data=np.arange(N, dtype=np.float32), chunks=(64,), **hdf5plugin.Zstd()
        )
    return path


def _child(code: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter: no hdf5plugin filter registered yet."""
    env = dict(os.environ)
    env.pop("HDF5_PLUGIN_PATH", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_open_names_filter_and_fix_when_hdf5plugin_missing(plugin_file):
    out = _child(
        f"""
        import sys
        sys.modules["hdf5plugin"] = None  # as if it were not installed
        import grain_replay as gr
        try:
            gr.open_source({plugin_file!r})
        except gr.MissingDependencyError as e:
            assert isinstance(e, ImportError)
            print("ERR", e)
        else:
            print("OPENED")
        """
    )
    assert out.returncode == 0, out.stderr
    msg = out.stdout
    assert msg.startswith("ERR"), msg
    assert plugin_file in msg
    assert "'obs'" in msg and "32001 (blosc)" in msg
    assert "pip install hdf5plugin" in msg
    assert "corrupt" not in msg and "truncated" not in msg


def test_read_loads_hdf5plugin_by_itself_when_installed(plugin_file):
    out = _child(
        f"""
        import sys
        import grain_replay as gr
        assert "hdf5plugin" not in sys.modules
        src = gr.open_source({plugin_file!r})
        b = src.read_batch([5, 1, 5])
        print(b["obs"][:, 0].tolist(), b["reward"].tolist())
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[15.0,", "3.0,", "15.0]", "[5.0,", "1.0,", "5.0]"]


def test_loader_workers_load_hdf5plugin(plugin_file):
    src = gr.HDF5DataSource(plugin_file)
    loader = gr.make_data_loader(src, batch_size=100, shuffle=True, seed=3, worker_count=2)
    seen = np.concatenate([b["reward"] for b in loader])
    assert sorted(seen.tolist()) == list(range(N))
    batch = src.read_batch(np.arange(N))
    np.testing.assert_array_equal(batch["obs"], np.arange(N * 3, dtype=np.float32).reshape(N, 3))


def test_filter_name_prefers_registry_then_stored_name():
    assert hdf5_filters.filter_name(32015) == "zstd"
    assert hdf5_filters.filter_name(39999, b"my-codec\x00") == "my-codec"
    assert hdf5_filters.filter_name(39999, None) == "unregistered filter"
