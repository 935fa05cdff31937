"""Compressed HDF5 chunks decoded outside h5py read exactly what h5py reads."""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.hdf5 import codecs as decode

N = 203  # the last chunk is partial


def _write(path: str, compression: str, shuffle: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    leaves = {
        "obs": rng.standard_normal((N, 6, 5)).astype("f4"),
        "act": rng.integers(0, 5, N).astype("i8"),
        "done": rng.random(N) < 0.1,
        "pix": np.repeat(rng.integers(0, 4, (N, 1, 4)), 8, axis=1).astype("u1"),
        "sparse": np.zeros((N, 3), "f8"),
    }
    with h5py.File(path, "w") as f:
        for key, data in leaves.items():
            ds = f.create_dataset(
                key, shape=data.shape, dtype=data.dtype, chunks=(16, *data.shape[1:]),
                compression=compression, shuffle=shuffle, fillvalue=2.5 if key == "sparse" else 0,
            )  # fmt: skip
            if key == "sparse":  # most chunks never written: they read as the fill value
                ds[40:60] = 1.0
            else:
                ds[...] = data
        return {k: f[k][...] for k in leaves}


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("compression", ["lzf", "gzip"])
def test_batches_equal_h5py_when_decoded_on_the_pool(
    tmp_path: Any, compression: str, shuffle: bool
) -> None:
    path = str(tmp_path / "f.h5")
    want = _write(path, compression, shuffle)
    rng = np.random.default_rng(1)
    for cache_bytes in (0, 1 << 26):
        with gr.HDF5DataSource(path, cache_bytes=cache_bytes) as src:
            for idx in (rng.integers(0, N, 64), np.arange(N), np.array([N - 1, 0, N - 1])):
                got = src.read_flat(idx)
                for key, full in want.items():
                    np.testing.assert_array_equal(got[key], full[idx], err_msg=key)


def test_lzf_chunks_decoded_by_liblzf_not_h5py(tmp_path: Any) -> None:
    path = str(tmp_path / "f.h5")
    _write(path, "lzf", True)
    with h5py.File(path, "r") as f:
        reader = decode.hdf5_direct_block_reader(f["obs"], 16, N)
        assert reader is not None
        np.testing.assert_array_equal(np.concatenate(reader(range(13))), f["obs"][...])


def test_corrupt_lzf_chunk_raises_invalid_store_error_naming_leaf(tmp_path: Any) -> None:
    path = str(tmp_path / "f.h5")
    _write(path, "lzf", False)
    with h5py.File(path, "r") as f:
        info = f["pix"].id.get_chunk_info(2)
    assert info.filter_mask == 0  # compressed (random floats would be stored as is)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * 16)
    with gr.HDF5DataSource(path) as src, pytest.raises(gr.InvalidStoreError, match="'pix'"):
        src.read_batch([2 * 16 + 3])


def test_incompressible_lzf_chunks_stored_as_is_read_without_h5py(tmp_path: Any) -> None:
    path = str(tmp_path / "f.h5")
    want = _write(path, "lzf", False)
    with h5py.File(path, "r") as f:
        assert f["obs"].id.get_chunk_info(0).filter_mask == 1  # lzf skipped: raw bytes
        reader = decode.hdf5_direct_block_reader(f["obs"], 16, N)
        assert reader is not None
        np.testing.assert_array_equal(np.concatenate(reader(range(13))), want["obs"])


def test_zlib_fallback_without_libdeflate_reads_the_same(tmp_path: Any, monkeypatch: Any) -> None:
    path = str(tmp_path / "f.h5")
    want = _write(path, "gzip", True)
    monkeypatch.setattr(decode, "_libdeflate", False)  # as if `deflate` were not installed
    idx = np.arange(N)[::-1]
    with gr.HDF5DataSource(path, cache_bytes=0) as src:
        got = src.read_flat(idx)
    for key, full in want.items():
        np.testing.assert_array_equal(got[key], full[idx], err_msg=key)
