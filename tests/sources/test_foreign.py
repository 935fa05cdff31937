"""Stores written without grain_replay (h5py, np.save, zarr) open as sources."""

from __future__ import annotations

import grain
import h5py
import numpy as np
import pytest
import zarr

import grain_replay as gr

N = 10


def _seed_era_arrays() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(12):
        shape = (N,) if i % 3 == 0 else (N, i % 4 + 1)
        out.append((rng.normal(size=shape) * 100).astype(np.float32 if i % 2 else np.int64))
    out[0] = np.arange(N, dtype=np.int64) * 7 + 1  # distinct: identifies the record
    return tuple(out)


@pytest.fixture
def seed_era_h5(tmp_path):
    """The old h5py pattern: one dataset per tuple element, named arr_<i>."""
    tup = _seed_era_arrays()
    path = str(tmp_path / "old.h5")
    with h5py.File(path, "w") as f:
        [f.create_dataset(f"arr_{i}", data=a) for i, a in enumerate(tup)]
    return path, tup


@pytest.fixture
def nested_h5(tmp_path):
    path = str(tmp_path / "nested.h5")
    data = {
        "reward": np.arange(N, dtype=np.float32),
        "obs/b": np.arange(N * 2).reshape(N, 2),
        "obs/a": np.arange(N * 3, dtype=np.int16).reshape(N, 3),
        "obs/deep/x": np.arange(N, dtype=np.uint8),
        "done": np.arange(N) % 3 == 0,
    }
    with h5py.File(path, "w") as f:
        for key, value in data.items():
            f.create_dataset(key, data=value)
    return path, data


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}/"))
        return out
    return {prefix.rstrip("/"): tree}


# -- HDF5 ---------------------------------------------------------------------------


@pytest.mark.parametrize("opener", [gr.HDF5DataSource, gr.open_source], ids=["hdf5", "open"])
def test_hdf5_seed_era_layout_opens_as_dict_in_natural_order(seed_era_h5, opener):
    path, tup = seed_era_h5
    with opener(path) as src:
        assert isinstance(src, gr.HDF5DataSource)
        names = [f"arr_{i}" for i in range(12)]
        assert len(src) == N
        assert src.keys == names
        assert list(src.spec) == names
        rec = src[7]
        assert isinstance(rec, dict)
        assert list(rec) == names
        batch = src.read_batch(np.arange(N))
        assert list(batch) == names
        for i, a in enumerate(tup):
            assert batch[f"arr_{i}"].dtype == a.dtype
            np.testing.assert_array_equal(batch[f"arr_{i}"], a)
            np.testing.assert_array_equal(rec[f"arr_{i}"], a[7])
        assert f"arr_{10}" in repr(src)


def test_hdf5_nested_groups_become_nested_sorted_dicts(nested_h5):
    path, data = nested_h5
    with gr.open_source(path) as src:
        rec = src[4]
        assert list(rec) == ["done", "obs", "reward"]
        assert list(rec["obs"]) == ["a", "b", "deep"]
        assert list(rec["obs"]["deep"]) == ["x"]
        batch = _flat(src.read_batch(np.arange(N)))
        assert set(batch) == set(data)
        for key, value in data.items():
            assert batch[key].dtype == value.dtype
            np.testing.assert_array_equal(batch[key], value)


def test_hdf5_keys_selects_group(nested_h5):
    path, data = nested_h5
    with gr.HDF5DataSource(path, keys=["obs"]) as src:
        assert src.keys == ["obs/a", "obs/b", "obs/deep/x"]
        rec = src[2]
        assert list(rec) == ["obs"]
        np.testing.assert_array_equal(rec["obs"]["a"], data["obs/a"][2])
        np.testing.assert_array_equal(rec["obs"]["deep"]["x"], data["obs/deep/x"][2])


def test_hdf5_keys_selects_leaves(nested_h5):
    path, data = nested_h5
    with gr.open_source(path, keys=["obs/a", "reward"]) as src:
        assert sorted(src.keys) == ["obs/a", "reward"]
        batch = src.read_batch([9, 0, 9])
        assert set(batch) == {"obs", "reward"}
        assert list(batch["obs"]) == ["a"]
        np.testing.assert_array_equal(batch["obs"]["a"], data["obs/a"][[9, 0, 9]])
        np.testing.assert_array_equal(batch["reward"], data["reward"][[9, 0, 9]])


@pytest.mark.parametrize("keys", [["nope"], ["obs/zzz"], ["reward", "missing_leaf"]])
def test_hdf5_unknown_key_raises_unknown_leaf_error(nested_h5, keys):
    path, _ = nested_h5
    with pytest.raises(gr.UnknownLeafError) as info:
        gr.HDF5DataSource(path, keys=keys)
    assert isinstance(info.value, ValueError)
    assert repr(keys[-1]) in str(info.value)
    assert "Fix" in str(info.value)


def test_hdf5_chunked_compressed_foreign_datasets_read(tmp_path):
    path = str(tmp_path / "chunked.h5")
    obs = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
    act = np.arange(50, dtype=np.int32)
    with h5py.File(path, "w") as f:
        f.create_dataset("obs", data=obs, chunks=(7, 3), compression="gzip")
        f.create_dataset("act", data=act, chunks=(4,), compression="lzf")
    idx = np.array([49, 0, 6, 7, 7, 13, 48])
    with gr.open_source(path) as src:
        batch = src.read_batch(idx)
        np.testing.assert_array_equal(batch["obs"], obs[idx])
        np.testing.assert_array_equal(batch["act"], act[idx])
        np.testing.assert_array_equal(src[-1]["obs"], obs[-1])


def test_hdf5_scalar_datasets_skipped(tmp_path):
    path = str(tmp_path / "scalar.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(5))
        f.create_dataset("version", data=3)
    with gr.open_source(path) as src:
        assert src.keys == ["x"]
        np.testing.assert_array_equal(src.read_batch(np.arange(5))["x"], np.arange(5))


@pytest.fixture
def mixed_lengths_h5(tmp_path):
    path = str(tmp_path / "mixed.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("observations", data=np.arange(20).reshape(10, 2))
        f.create_dataset("rewards", data=np.arange(10.0))
        f.create_dataset("infos/qpos", data=np.arange(3))
    return path


def test_hdf5_mixed_lengths_raise_invalid_store_error_suggesting_keys(mixed_lengths_h5):
    with pytest.raises(gr.InvalidStoreError) as info:
        gr.open_source(mixed_lengths_h5)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'infos/qpos'" in msg
    assert "3" in msg and "10" in msg
    assert "keys=" in msg
    assert "'observations'" in msg and "'rewards'" in msg
    assert "Fix" in msg


def test_hdf5_mixed_lengths_fixed_by_keys(mixed_lengths_h5):
    with gr.open_source(mixed_lengths_h5, keys=["observations", "rewards"]) as src:
        assert len(src) == 10
        np.testing.assert_array_equal(src[3]["observations"], [6, 7])
        np.testing.assert_array_equal(src.read_batch([1, 2])["rewards"], [1.0, 2.0])


@pytest.fixture
def vlen_h5(tmp_path):
    path = str(tmp_path / "strings.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(3))
        f.create_dataset("meta/name", data=["a", "bc", "def"], dtype=h5py.string_dtype())
    return path


def test_hdf5_vlen_string_dataset_raises_invalid_store_error(vlen_h5):
    with pytest.raises(gr.InvalidStoreError) as info:
        gr.open_source(vlen_h5)
    assert isinstance(info.value, ValueError)
    assert "'meta/name'" in str(info.value)
    assert vlen_h5 in str(info.value)
    assert "Fix" in str(info.value)


def test_hdf5_vlen_string_dataset_excluded_by_keys(vlen_h5):
    with gr.HDF5DataSource(vlen_h5, keys=["x"]) as src:
        assert src.keys == ["x"]
        np.testing.assert_array_equal(src.read_batch([2, 0])["x"], [2, 0])


# -- .npy --------------------------------------------------------------------------


def test_npy_plain_file_rows_are_records(tmp_path):
    path = str(tmp_path / "plain.npy")
    data = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
    np.save(path, data)
    for src in (gr.NpyDataSource(path), gr.open_source(path)):
        with src:
            assert isinstance(src, gr.NpyDataSource)
            assert len(src) == N
            for i in (0, 4, -1):
                assert isinstance(src[i], np.ndarray)
                np.testing.assert_array_equal(src[i], data[i])
            batch = src.read_batch([9, 1, 1])
            assert batch.dtype == data.dtype
            np.testing.assert_array_equal(batch, data[[9, 1, 1]])


def test_npy_plain_1d_file_and_fortran_order(tmp_path):
    np.save(tmp_path / "v.npy", np.arange(6))
    np.save(tmp_path / "f.npy", np.asfortranarray(np.arange(12).reshape(4, 3)))
    with gr.open_source(tmp_path / "v.npy") as src:
        np.testing.assert_array_equal(src[5], 5)
    with gr.open_source(tmp_path / "f.npy") as src:
        np.testing.assert_array_equal(src[1], [3, 4, 5])
        np.testing.assert_array_equal(src.read_batch([3, 0]), [[9, 10, 11], [0, 1, 2]])


def test_npy_object_file_raises_invalid_store_error(tmp_path):
    path = str(tmp_path / "obj.npy")
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(gr.InvalidStoreError, match="Fix"):
        gr.open_source(path)


def test_npy_directory_with_nested_subdirectory(tmp_path):
    root = tmp_path / "replay"
    (root / "obs").mkdir(parents=True)
    data = {
        "reward": np.arange(N, dtype=np.float64),
        "obs/pixels": np.arange(N * 4, dtype=np.uint8).reshape(N, 2, 2),
        "obs/arr_10": np.arange(N),
        "obs/arr_2": np.arange(N) * 2,
    }
    for key, value in data.items():
        np.save(root / f"{key}.npy", value)
    (root / "README.txt").write_text("not a leaf")
    with gr.open_source(root) as src:
        assert isinstance(src, gr.NpyDataSource)
        assert src.keys == ["obs/arr_2", "obs/arr_10", "obs/pixels", "reward"]
        rec = src[3]
        assert list(rec) == ["obs", "reward"]
        assert list(rec["obs"]) == ["arr_2", "arr_10", "pixels"]
        batch = _flat(src.read_batch(np.arange(N)))
        for key, value in data.items():
            assert batch[key].dtype == value.dtype
            np.testing.assert_array_equal(batch[key], value)
    with gr.NpyDataSource(root, keys=["obs/pixels"]) as src:
        np.testing.assert_array_equal(src[1]["obs"]["pixels"], data["obs/pixels"][1])


# -- Zarr --------------------------------------------------------------------------


def test_zarr_foreign_group_compressed_unaligned_chunks(tmp_path):
    path = str(tmp_path / "foreign.zarr")
    group = zarr.open_group(path, mode="w")
    reward = np.arange(23, dtype=np.float32)
    obs = np.arange(23 * 3, dtype=np.int32).reshape(23, 3)
    vel = np.linspace(0, 1, 23 * 2).reshape(23, 2)
    zstd = (zarr.codecs.ZstdCodec(),)

    def put(parent, name, value, chunks):
        arr = parent.create_array(
            name, shape=value.shape, chunks=chunks, dtype=value.dtype, compressors=zstd
        )
        arr[:] = value

    put(group, "reward", reward, (5,))
    sub = group.create_group("obs")
    put(sub, "pos", obs, (7, 2))
    put(sub, "vel", vel, (3, 2))
    with gr.open_source(path) as src:
        assert isinstance(src, gr.ZarrDataSource)
        assert len(src) == 23
        assert src.keys == ["obs/pos", "obs/vel", "reward"]
        # A batch of 4 never lines up with chunks of 5, 7 and 3 rows.
        for start in range(0, 23, 4):
            idx = np.arange(start, min(start + 4, 23))
            batch = src.read_batch(idx)
            np.testing.assert_array_equal(batch["reward"], reward[idx])
            np.testing.assert_array_equal(batch["obs"]["pos"], obs[idx])
            np.testing.assert_array_equal(batch["obs"]["vel"], vel[idx])
        idx = np.array([22, 0, 13, 13, 6, 7, 21])
        batch = src.read_batch(idx)
        np.testing.assert_array_equal(batch["obs"]["pos"], obs[idx])
        np.testing.assert_array_equal(src[-1]["reward"], reward[-1])
    with gr.ZarrDataSource(path, keys=["obs/vel"]) as src:
        np.testing.assert_array_equal(src[5]["obs"]["vel"], vel[5])


# -- missing and unreadable stores --------------------------------------------------


@pytest.mark.parametrize("name", ["missing.h5", "missing", "missing.zarr", "missing.npy"])
def test_open_source_missing_path_raises_store_not_found(tmp_path, name):
    path = str(tmp_path / name)
    with pytest.raises(gr.StoreNotFoundError) as info:
        gr.open_source(path)
    assert isinstance(info.value, FileNotFoundError)
    assert path in str(info.value)


@pytest.mark.parametrize(
    "cls", [gr.HDF5DataSource, gr.NpyDataSource, gr.ZarrDataSource], ids=lambda c: c.__name__
)
def test_source_missing_path_raises_store_not_found(tmp_path, cls):
    with pytest.raises(FileNotFoundError):
        cls(tmp_path / "missing.h5")


@pytest.mark.parametrize("name", ["notes.txt", "fake.h5", "fake.npy"])
def test_open_source_text_file_raises_invalid_store(tmp_path, name):
    path = tmp_path / name
    path.write_text("this is not a replay store\n")
    with pytest.raises(gr.InvalidStoreError) as info:
        gr.open_source(path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value)
    assert "Fix" in str(info.value)


def test_hdf5_source_text_file_raises_invalid_store(tmp_path):
    path = tmp_path / "fake.h5"
    path.write_text("this is not a replay store\n")
    with pytest.raises(gr.InvalidStoreError):
        gr.HDF5DataSource(path)


def test_open_source_empty_directory_raises_invalid_store(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(gr.InvalidStoreError, match="Fix"):
        gr.open_source(tmp_path / "empty")


# -- through a stock grain.DataLoader ----------------------------------------------


def test_grain_public_modules_exist():
    assert hasattr(grain, "DataLoader")
    assert hasattr(grain.samplers, "IndexSampler")
    assert hasattr(grain.transforms, "Batch")
    assert hasattr(grain.sharding, "NoSharding")


def _loader(src, worker_count=1):
    # One grain worker process: the source pickled into it and read there (each grain worker
    # imports jax, ~2 s of CPU), as tests/helpers/conformance.py's test does.
    return grain.DataLoader(
        data_source=src,
        sampler=grain.samplers.IndexSampler(
            len(src),
            shuffle=True,
            seed=0,
            num_epochs=1,
            shard_options=grain.sharding.NoSharding(),
        ),
        operations=[grain.transforms.Batch(4, drop_remainder=False)],
        worker_count=worker_count,
        shard_options=grain.sharding.NoSharding(),
    )


def _plain_npy(tmp_path):
    path = str(tmp_path / "plain.npy")
    data = np.arange(N * 2, dtype=np.int64).reshape(N, 2) * 3
    np.save(path, data)
    return path, data


@pytest.mark.parametrize("store", ["seed_era_h5", "plain_npy"])
def test_grain_dataloader_workers_read_every_record_once(request, tmp_path, store):
    if store == "seed_era_h5":
        path, tup = request.getfixturevalue("seed_era_h5")
    else:
        path, data = _plain_npy(tmp_path)
    with gr.open_source(path) as src:
        batches = list(_loader(src))
    if store == "plain_npy":
        got = np.concatenate([np.asarray(b) for b in batches])
        assert got.shape == data.shape
        np.testing.assert_array_equal(got[np.argsort(got[:, 0])], data)
        return
    # arr_0 is distinct and increasing, so sorting by it restores the file order.
    order = np.argsort(np.concatenate([np.asarray(b["arr_0"]) for b in batches]))
    assert len(order) == N
    for i, a in enumerate(tup):
        got = np.concatenate([np.asarray(b[f"arr_{i}"]) for b in batches])
        assert got.dtype == a.dtype
        np.testing.assert_array_equal(got[order], a, err_msg=f"arr_{i}")
