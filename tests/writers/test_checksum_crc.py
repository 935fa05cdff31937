"""The writers' block CRC-32s: libdeflate's where installed, always equal to zlib's."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.store import integrity


def test_the_fast_crc_is_zlibs_crc32() -> None:
    pytest.importorskip("deflate")
    assert integrity.crc32 is not zlib.crc32  # the fast extra is installed: it is used
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 4096, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        seed = int(rng.integers(0, 1 << 32))
        assert integrity.crc32(data) == zlib.crc32(data)
        assert integrity.crc32(data, seed) == zlib.crc32(data, seed)
        view = integrity.as_bytes(np.frombuffer(data, np.uint8))
        half = len(view) // 2
        assert integrity.crc32(view[half:], integrity.crc32(view[:half])) == zlib.crc32(data)


def test_without_deflate_zlibs_crc32_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deflate", None)  # import deflate raises ImportError
    assert integrity._crc32() is zlib.crc32


@pytest.mark.parametrize("fmt", ["npy", "hdf5", "zarr"])
def test_recorded_checksums_are_zlibs_crc32_of_the_rows(tmp_path: Path, fmt: str) -> None:
    """A store written with either CRC verifies with the other: the recorded blocks are
    zlib.crc32 of each block of rows, whatever computed them."""
    rows = 3000
    tree = {
        "obs": np.random.default_rng(1).standard_normal((rows, 70)).astype(np.float32),
        "done": np.arange(rows) % 7 == 0,
    }
    path = str(tmp_path / f"store.{ {'npy': 'npy', 'hdf5': 'h5', 'zarr': 'zarr'}[fmt] }")
    with gr.ReplayWriter(path, fmt) as w:
        for start in range(0, rows, 512):  # appends that split checksum blocks
            w.append({k: v[start : start + 512] for k, v in tree.items()})
    src = gr.open_source(path)
    assert src.checksums is not None
    for key, arr in tree.items():
        rec = src.checksums[key]
        r = rec["block_rows"]
        want = [zlib.crc32(arr[i : i + r].tobytes()) for i in range(0, rows, r)]
        assert rec["blocks"] == want, key
    assert integrity.verify_source(src, src.checksums).ok
