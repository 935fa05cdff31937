"""grain-replay info | convert | verify, run as a user would."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.cli import main

SUFFIX = {"hdf5": ".h5", "npy": "", "zarr": ".zarr"}


def _tree(n: int = 3000) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "obs": {"vec": rng.standard_normal((n, 5)).astype(np.float32)},
        "action": rng.integers(0, 4, n).astype(np.int64),
        "reward": rng.standard_normal(n).astype(np.float16),
        "done": (np.arange(n) % 100) == 99,
    }


def _assert_same(a: str, b: str) -> None:
    sa, sb = gr.open_source(a), gr.open_source(b)
    assert len(sa) == len(sb)
    assert list(sa.spec) == list(sb.spec)
    idx = np.arange(len(sa))
    fa, fb = sa.read_flat(idx), sb.read_flat(idx)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        assert fa[k].tobytes() == fb[k].tobytes(), k  # bit-exact


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), list(itertools.product(SUFFIX, SUFFIX)))
def test_convert_round_trips_bit_exactly_every_format_pair(
    tmp_path: Any, src_fmt: str, dst_fmt: str
) -> None:
    src = gr.write(str(tmp_path / f"src{SUFFIX[src_fmt]}"), _tree(), format=src_fmt)
    dst = str(tmp_path / f"dst{SUFFIX[dst_fmt]}")
    assert main(["convert", src, dst, "--format", dst_fmt, "--quiet", "--block-bytes", "4096"]) == 0
    _assert_same(src, dst)
    back = str(tmp_path / f"back{SUFFIX[src_fmt]}")
    assert main(["convert", dst, back, "--format", src_fmt, "--quiet"]) == 0
    _assert_same(src, back)
    assert gr.open_source(back).read_batch([5])["obs"]["vec"].shape == (1, 5)


def test_convert_refuses_existing_destination_without_overwrite(tmp_path: Any, capsys) -> None:
    src = gr.write(str(tmp_path / "a.h5"), _tree(100))
    dst = gr.write(str(tmp_path / "b.zarr"), _tree(10))
    assert main(["convert", src, dst, "--quiet"]) == 2
    assert "overwrite" in capsys.readouterr().err
    assert len(gr.open_source(dst)) == 10
    assert main(["convert", src, dst, "--quiet", "--overwrite"]) == 0
    assert len(gr.open_source(dst)) == 100


def test_convert_with_compression(tmp_path: Any) -> None:
    src = gr.write(str(tmp_path / "a"), _tree())
    dst = str(tmp_path / "b.h5")
    assert main(["convert", src, dst, "--compression", "gzip", "--quiet"]) == 0
    _assert_same(src, dst)


@pytest.mark.parametrize("fmt", list(SUFFIX))
def test_verify_names_corrupt_leaf_and_rows_after_bytes_flip(
    tmp_path: Any, fmt: str, capsys
) -> None:
    n = 200_000  # several checksum blocks for obs/vec (20 B rows, 52,428 rows per block)
    path = gr.write(str(tmp_path / f"s{SUFFIX[fmt]}"), _tree(n), format=fmt)
    assert main(["verify", path, "--quiet"]) == 0
    assert "checksums match" in capsys.readouterr().out
    # Flip bytes of obs/vec row 120,000 on disk, whatever the format's layout.
    src = gr.open_source(path)
    row = src.read_leaf("obs/vec", [120_000])[0].tobytes()
    files = (
        [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        if os.path.isdir(path)
        else [path]
    )
    flipped = False
    for file in files:
        data = bytearray(Path(file).read_bytes())
        at = data.find(row)
        if at >= 0:
            data[at] ^= 0xFF
            with open(file, "wb") as f:
                f.write(bytes(data))
            flipped = True
            break
    assert flipped
    assert main(["verify", path, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "CORRUPT" in err and "'obs/vec'" in err and "[104856, 157284)" in err


def test_info_reports_format_records_leaves_episodes(tmp_path: Any, capsys) -> None:
    path = gr.write(str(tmp_path / "s.h5"), _tree())
    assert main(["info", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "hdf5" and info["num_records"] == 3000
    assert info["leaves"]["obs/vec"] == {"dtype": "float32", "shape": [5]}
    assert info["episodes"]["count"] == 30 and info["checksums"] is True
    assert main(["info", path]) == 0
    assert "episodes: 30" in capsys.readouterr().out


def test_missing_store_exits_2_with_message(tmp_path: Any, capsys) -> None:
    assert main(["info", str(tmp_path / "nope.h5")]) == 2
    assert "nope.h5" in capsys.readouterr().err


def test_console_script_runs(tmp_path: Any) -> None:
    path = gr.write(str(tmp_path / "s.zarr"), _tree(50))
    exe = os.path.join(os.path.dirname(sys.executable), "grain-replay")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "grain_replay.cli"]
    out = subprocess.run([*cmd, "info", path], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "records: 50" in out.stdout
