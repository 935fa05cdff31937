"""``grain-replay verify`` opens a store in a child process first: a hostile HDF5 hang is reported.

The hanging file is the known HDF5 C library hang (SECURITY.md): a ``gr.write``
file whose global heap's free-space object header is zeroed. Reading its metadata
attribute never returns, plain h5py included; the child is killed after the timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
import zero_sweep

import grain_replay as gr
from grain_replay.cli import main
from grain_replay.cli.commands import verify_isolated

pytestmark = pytest.mark.timeout(180)


def _hanging_h5(tmp_path: Any) -> str:
    """A gr.write file whose metadata attribute hangs HDF5: its free-space object's size zeroed."""
    path = str(tmp_path / "hangs.h5")
    gr.write(path, zero_sweep.base_tree())
    (_, free, index) = zero_sweep.heap_object_headers(path)[-1]
    assert index == 0
    with open(path, "r+b") as f:
        f.seek(free + 8)
        f.write(bytes(8))
    return path


def test_plain_h5py_hangs_on_zeroed_heap_header_when_reading_metadata(tmp_path: Any) -> None:
    """The reproduction SECURITY.md gives: plain h5py, no grain_replay on the path."""
    path = _hanging_h5(tmp_path)
    code = f"import h5py; h5py.File({path!r}, 'r').attrs['grain_replay']"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=3)


def test_verify_isolated_reports_hang_within_timeout_when_hdf5_loops(tmp_path: Any) -> None:
    path = _hanging_h5(tmp_path)
    t0 = time.monotonic()
    check = verify_isolated(path, timeout=3)
    assert time.monotonic() - t0 < 30
    assert check.hung and not check.ok
    assert os.path.abspath(path) in check.message
    assert "did not return within 3 s" in check.message
    assert "do not open this file in-process" in check.message


def test_verify_isolated_ok_when_store_intact(tmp_path: Any) -> None:
    path = str(tmp_path / "ok.h5")
    gr.write(path, zero_sweep.base_tree())
    check = verify_isolated(path, timeout=60)
    assert check.ok and not check.hung, check
    assert f"{zero_sweep.N} records" in check.message


def test_verify_isolated_names_error_when_store_damaged(tmp_path: Any) -> None:
    path = str(tmp_path / "bad.h5")
    gr.write(path, zero_sweep.base_tree())
    with open(path, "r+b") as f:
        f.seek(800)
        f.write(bytes(1248))
    check = verify_isolated(path, timeout=60)
    assert not check.ok and not check.hung
    assert check.error == "InvalidStoreError", check
    assert os.path.abspath(path) in check.message


def test_cli_verify_exits_1_with_hung_line_when_hdf5_loops(tmp_path: Any, capsys: Any) -> None:
    path = _hanging_h5(tmp_path)
    assert main(["verify", path, "--timeout", "3", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"CORRUPT {os.path.abspath(path)}: hung:"), err
    assert "do not open this file in-process" in err


def test_cli_verify_still_ok_after_isolated_open_when_store_intact(
    tmp_path: Any, capsys: Any
) -> None:
    path = str(tmp_path / "ok.zarr")
    gr.write(path, zero_sweep.base_tree())
    assert main(["verify", path, "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("OK ")
