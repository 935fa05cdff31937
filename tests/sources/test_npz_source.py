from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np
import pytest
from conformance import DataSourceTests, N, flat, make_tree, slow_in_this_class
from format_checks import assert_loader_delivers_every_record

import grain_replay as gr
from grain_replay.rl import build_episode_index
from grain_replay.store.formats import detect_format


class _NpzTests(DataSourceTests):
    cls = gr.NpzDataSource
    suffix = ".npz"
    save: Any = staticmethod(np.savez)

    def write(self, path: str, tree: Any) -> str:
        self.save(path, **flat(tree))
        return path

    @pytest.fixture
    def tree(self) -> dict[str, Any]:
        # A foreign store's leaves come back naturally sorted: the reference tree is, too.
        return _sorted(make_tree())

    def test_spec_gives_per_record_dtype_and_shape(self, src: gr.ReplaySource) -> None:
        # A foreign store: members naturally sorted, whatever their order in the archive.
        assert src.spec["obs/pixels"].shape == (3, 4)
        assert src.spec["obs/pixels"].dtype == np.uint8
        assert src.spec["action"].shape == ()
        assert list(src.spec) == ["action", "done", "obs/pixels", "obs/vec", "reward"]

    def test_reads_equal_numpy_load(self, src: gr.NpzDataSource) -> None:
        idx = np.random.default_rng(1).integers(0, N, 50)
        got = src.read_flat(idx)
        with np.load(src.path, allow_pickle=False) as z:
            for k in src.keys:
                np.testing.assert_array_equal(got[k], z[k + ""][idx], err_msg=k)


def _sorted(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _sorted(tree[k]) for k in sorted(tree)}
    return tree


class TestNpzStored(_NpzTests):
    save = staticmethod(np.savez)

    def test_members_are_mapped_in_place_read_only(self, src: gr.NpzDataSource) -> None:
        src[0]
        array = src._handle.readers["reward"]._array  # type: ignore[union-attr]
        assert not array.flags.writeable and not array.flags.owndata
        assert array.base is not None  # a view of the archive's map, not a decoded copy

    def test_misaligned_members_come_back_aligned(self, src: gr.NpzDataSource, tree: Any) -> None:
        # A member's data starts wherever its zip header ends: members at an offset their
        # dtype does not divide are gathered as whole rows of bytes, returned aligned.
        src[0]
        readers = src._handle.readers  # type: ignore[union-attr]
        odd = [k for k in src.keys if hasattr(readers[k], "_rows")]
        assert odd, "the fixture has misaligned members"
        want = flat(tree)
        for k in odd:
            assert not readers[k]._rows._array.flags.owndata  # still the archive's map
            got = src.read_flat([3, 1])[k]
            assert got.flags.aligned and got.dtype == want[k].dtype
            np.testing.assert_array_equal(got, want[k][[3, 1]])


class TestNpzCompressed(_NpzTests):
    # Grain's worker loader (seconds of spawns): make test runs it on TestNpzStored.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        DataSourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    save = staticmethod(np.savez_compressed)

    def test_members_inflate_once_per_process(self, src: gr.NpzDataSource) -> None:
        src.read_batch([0, 1])
        handle = src._handle
        src.read_batch([2, 3])
        assert src._handle is handle and src._opens == 1


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_loader_and_sharded_device_put(tmp_path: Any, workers: int, save: Any) -> None:
    tree = make_tree(64)
    tree["index"] = np.arange(64, dtype=np.int64)
    path = str(tmp_path / "l.npz")
    save(path, **flat(tree))
    assert_loader_delivers_every_record(gr.NpzDataSource(path), "index", workers=workers)


def test_open_source_detects_npz(tmp_path: Any) -> None:
    path = str(tmp_path / "x.npz")
    np.savez(path, a=np.arange(4))
    assert detect_format(path) == "npz"
    src = gr.open_source(path)
    assert isinstance(src, gr.NpzDataSource) and src.read_batch([3, 0])["a"].tolist() == [3, 0]


def test_zip64_directory_records_are_read(tmp_path: Any, monkeypatch: Any) -> None:
    # zipfile writes zip64 central-directory fields and end records past ZIP64_LIMIT.
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 16)
    tree = {"a": np.arange(40.0).reshape(20, 2), "b": np.arange(20, dtype=np.int8)}
    for save in (np.savez, np.savez_compressed):
        path = str(tmp_path / f"z64_{save.__name__}.npz")
        save(path, **tree)
        with open(path, "rb") as f:
            assert b"PK\x06\x06" in f.read()  # the zip64 end-of-central-directory record
        src = gr.NpzDataSource(path)
        np.testing.assert_array_equal(src.read_batch([19, 0])["a"], tree["a"][[19, 0]])
        np.testing.assert_array_equal(src.read_batch([5])["b"], tree["b"][[5]])


def test_fortran_ordered_members_read_correctly(tmp_path: Any) -> None:
    a = np.asfortranarray(np.arange(60, dtype=np.float32).reshape(12, 5))
    for save in (np.savez, np.savez_compressed):
        path = str(tmp_path / f"f_{save.__name__}.npz")
        save(path, a=a)
        np.testing.assert_array_equal(gr.NpzDataSource(path).read_batch([11, 2])["a"], a[[11, 2]])


def test_ogbench_layout_gives_episodes_from_terminals(tmp_path: Any) -> None:
    # OGBench's files: observations, actions, terminals (1 on each trajectory's last
    # step), and per-step extras such as qpos; float32 flags.
    lengths = [5, 3, 7]
    n = sum(lengths)
    terminals = np.zeros(n, np.float32)
    terminals[np.cumsum(lengths) - 1] = 1.0
    rng = np.random.default_rng(0)
    data = {
        "observations": rng.standard_normal((n, 29)).astype(np.float32),
        "actions": rng.uniform(-1, 1, (n, 8)).astype(np.float32),
        "terminals": terminals,
        "qpos": rng.standard_normal((n, 15)).astype(np.float32),
    }
    path = str(tmp_path / "antmaze-tiny-navigate-v0.npz")
    np.savez_compressed(path, **data)
    src = gr.open_source(path)
    assert len(src) == n and set(src.keys) == set(data)
    index = build_episode_index(src, cache=False)
    assert index.ends.tolist() == np.cumsum(lengths).tolist()
    windows = gr.SequenceDataSource(src, offsets={"observations": [0, 1]}, pad="edge")
    last = windows[4]["observations"]  # the last step of the first episode: edge-padded
    np.testing.assert_array_equal(last[1], data["observations"][4])


# -- bad input ---------------------------------------------------------------------------


def test_object_member_is_refused_without_unpickling(tmp_path: Any) -> None:
    path = str(tmp_path / "o.npz")
    np.savez(path, ok=np.arange(3), meta=np.array([{"a": 1}, None, 3], dtype=object))
    with pytest.raises(gr.InvalidStoreError, match=r"o\.npz.*'meta\.npy'.*allow_pickle=False"):
        gr.NpzDataSource(path)
    assert gr.NpzDataSource(path, keys=["ok"]).read_batch([2])["ok"].tolist() == [2]


def test_members_of_different_lengths_name_them_and_keys_picks(tmp_path: Any) -> None:
    path = str(tmp_path / "m.npz")
    np.savez(path, a=np.arange(10), b=np.arange(10), lengths=np.array([4, 6]))
    with pytest.raises(gr.InvalidStoreError, match=r"'lengths' has 2 records but expected 10"):
        gr.NpzDataSource(path)
    assert len(gr.NpzDataSource(path, keys=["a", "b"])) == 10


def test_scalar_member_is_refused_naming_it(tmp_path: Any) -> None:
    path = str(tmp_path / "s.npz")
    np.savez(path, a=np.arange(10), version=np.int64(3))
    with pytest.raises(gr.InvalidStoreError, match=r"'version\.npy' is a scalar.*keys="):
        gr.NpzDataSource(path)


def test_truncated_archive_names_the_file(tmp_path: Any) -> None:
    path = str(tmp_path / "t.npz")
    np.savez(path, a=np.arange(1000))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(gr.InvalidStoreError, match=r"t\.npz.*truncated"):
        gr.open_source(path)


def test_damaged_deflated_member_fails_its_crc_naming_it(tmp_path: Any) -> None:
    path = str(tmp_path / "c.npz")
    np.savez_compressed(path, a=np.arange(5000, dtype=np.int64), b=np.arange(5000))
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("a.npy")
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 30 + len("a.npy") + len(info.extra) + info.compress_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    src = gr.NpzDataSource(path, keys=["b"])
    assert src.read_batch([7])["b"].tolist() == [7]  # the sound member reads
    with pytest.raises(gr.InvalidStoreError, match=r"c\.npz: member 'a\.npy'.*corrupt"):
        gr.NpzDataSource(path).read_batch([0])


def test_deflated_members_over_the_budget_say_to_convert(tmp_path: Any) -> None:
    path = str(tmp_path / "big.npz")
    np.savez_compressed(path, x=np.zeros((1000, 100), np.float32), y=np.zeros(1000))
    with pytest.raises(
        gr.InvalidStoreError, match=r"'x\.npy'.*400,000 bytes.*10,000 bytes.*grain-replay convert"
    ):
        gr.NpzDataSource(path, cache_bytes=10_000)
    assert len(gr.NpzDataSource(path, keys=["y"], cache_bytes=10_000)) == 1000


def test_unsupported_compression_names_method_and_member(tmp_path: Any) -> None:
    path = str(tmp_path / "bz.npz")
    np.save(tmp_path / "a.npy", np.arange(10))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_BZIP2) as z:
        z.write(tmp_path / "a.npy", "a.npy")
    with pytest.raises(gr.InvalidStoreError, match=r"'a\.npy' is compressed with bzip2"):
        gr.NpzDataSource(path)


def test_archive_without_arrays_or_not_a_zip(tmp_path: Any) -> None:
    path = str(tmp_path / "e.npz")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("README.txt", "no arrays")
    with pytest.raises(gr.InvalidStoreError, match=r"no \.npy member"):
        gr.NpzDataSource(path)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(gr.InvalidStoreError, match="end-of-central-directory"):
        gr.NpzDataSource(str(junk))
    with pytest.raises(FileNotFoundError):
        gr.NpzDataSource(str(tmp_path / "missing.npz"))
