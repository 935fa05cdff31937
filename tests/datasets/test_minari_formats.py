"""MinariDataSource on what minari's DataCollector writes by default today: JPEG-encoded image
spaces (HDF5 and Arrow) and Arrow-format datasets, checked against minari.load_dataset."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
from typing import Any

import h5py
import numpy as np
import pytest
from conformance import SourceTests, slow_in_this_class
from rl_fixtures import collect_minari, register_dict_env, register_image_env, write_minari_file
from test_minari import _expect_from_minari

import grain_replay as gr
import grain_replay.datasets.minari.arrow as arrow_mod
import grain_replay.sources.reading.jpeg as jpeg_mod
from grain_replay.datasets import MinariDataSource

minari = pytest.importorskip("minari")
pytest.importorskip("gymnasium")
pytest.importorskip("pyarrow")
PIL = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _collect(root: str, dataset_id: str, env: str, episodes: int, **kwargs: Any) -> str:
    collect_minari(env, dataset_id, episodes, **kwargs)
    return os.path.join(root, *dataset_id.split("/"))


@pytest.fixture(scope="module")
def images_hdf5(minari_root: str) -> str:
    # DataCollector's defaults: HDF5, jpeg_encoding=True.
    return _collect(minari_root, "images/hdf5-v0", register_image_env(), 9)


@pytest.fixture(scope="module")
def images_arrow(minari_root: str) -> str:
    return _collect(minari_root, "images/arrow-v0", register_image_env(), 9, data_format="arrow")


@pytest.fixture(scope="module")
def dict_arrow(minari_root: str) -> str:
    return _collect(
        minari_root, "dict/arrow-v0", register_dict_env(), 14, data_format="arrow",
        record_infos=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def cartpole_arrow(minari_root: str) -> str:
    return _collect(
        minari_root, "cartpole/arrow-v0", "CartPole-v1", 12, max_steps=15, data_format="arrow"
    )


def _make(tmp_path: Any, scale: int) -> MinariDataSource:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return MinariDataSource(write_minari_file(str(tmp_path / "m.hdf5"), [5, 3] * scale))


def _check_all_match_minari(src: MinariDataSource, dataset_id: str, infos: bool = False) -> None:
    n = len(src)
    assert n == minari.load_dataset(dataset_id).total_steps
    want = _expect_from_minari(dataset_id, infos=infos)(np.arange(n))
    got = src.read_flat(np.arange(n))
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


class TestJpegImagesHdf5(SourceTests):
    # Grain's worker loader (seconds of spawns): make test runs it on
    # TestArrowCartPole (Arrow) and test_minari.py::TestMinariCartPole (HDF5).
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    make = staticmethod(_make)  # type: ignore[assignment]

    @pytest.fixture
    def src(self, images_hdf5: str) -> MinariDataSource:
        return MinariDataSource(images_hdf5)

    @pytest.fixture
    def expect(self, images_hdf5: str) -> Any:
        return _expect_from_minari("images/hdf5-v0")

    def test_frames_decode_exactly_as_minari_load_dataset(self, src: MinariDataSource) -> None:
        assert src.format == "hdf5"
        assert src.spec["observations/rgb"].shape == (40, 48, 3)
        assert src.spec["next_observations/grey"] == gr.LeafSpec(np.dtype(np.uint8), (36, 36))
        _check_all_match_minari(src, "images/hdf5-v0")

    def test_each_distinct_frame_is_decoded_once_per_batch(
        self, src: MinariDataSource, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        decoded: list[int] = []
        real = jpeg_mod.decode_jpegs

        def counting(blobs: Any, *args: Any) -> Any:
            decoded.append(len(blobs))
            return real(blobs, *args)

        monkeypatch.setattr(jpeg_mod, "decode_jpegs", counting)
        src.read_batch([3, 3, 3, 4, 0])
        # Two image leaves, each observed and next-observed: 4 readers, 3 distinct steps each.
        assert sum(decoded) == 4 * 3

    def test_episodes_and_windows_work_over_images(self, src: MinariDataSource) -> None:
        eps = list(minari.load_dataset("images/hdf5-v0").iterate_episodes())
        assert src.episodes.lengths.tolist() == [len(e.rewards) for e in eps]


class TestJpegImagesArrow(SourceTests):
    # Grain's worker loader (seconds of spawns): make test runs it on TestArrowCartPole.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    make = staticmethod(_make)  # type: ignore[assignment]

    @pytest.fixture
    def src(self, images_arrow: str) -> MinariDataSource:
        return MinariDataSource(images_arrow)

    @pytest.fixture
    def expect(self, images_arrow: str) -> Any:
        return _expect_from_minari("images/arrow-v0")

    def test_frames_decode_exactly_as_minari_load_dataset(self, src: MinariDataSource) -> None:
        assert src.format == "arrow"
        _check_all_match_minari(src, "images/arrow-v0")

    def test_each_distinct_frame_is_decoded_once_per_batch(
        self, src: MinariDataSource, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        decoded: list[int] = []
        real = arrow_mod.decode_jpegs

        def counting(blobs: Any, *args: Any) -> Any:
            decoded.append(len(blobs))
            return real(blobs, *args)

        monkeypatch.setattr(arrow_mod, "decode_jpegs", counting)
        src.read_batch([1, 1, 2])
        assert sum(decoded) == 4 * 2


class TestArrowDictSpace(SourceTests):
    # Grain's worker loader (seconds of spawns): make test runs it on TestArrowCartPole.
    test_grain_dataloader_with_workers_reads_every_record_once = slow_in_this_class(
        SourceTests.test_grain_dataloader_with_workers_reads_every_record_once
    )
    make = staticmethod(_make)  # type: ignore[assignment]

    @pytest.fixture
    def src(self, dict_arrow: str) -> MinariDataSource:
        return MinariDataSource(dict_arrow)

    @pytest.fixture
    def expect(self, dict_arrow: str) -> Any:
        return _expect_from_minari("dict/arrow-v0")

    def test_every_transition_matches_minari(self, src: MinariDataSource) -> None:
        _check_all_match_minari(src, "dict/arrow-v0")

    def test_dict_and_tuple_spaces_become_dicts_and_tuples(self, src: MinariDataSource) -> None:
        rec = src[0]
        assert list(rec["observations"]) == ["mode", "pair", "pos"]
        assert isinstance(rec["next_observations"]["pair"], tuple)

    def test_infos_are_the_info_returned_by_the_step(self, dict_arrow: str) -> None:
        src = MinariDataSource(dict_arrow, infos=True)
        _check_all_match_minari(src, "dict/arrow-v0", infos=True)
        got = src.read_flat(np.arange(len(src)))
        np.testing.assert_array_equal(got["infos/t"], got["rewards"].astype(np.int64))


class TestArrowCartPole(SourceTests):
    make = staticmethod(_make)  # type: ignore[assignment]

    @pytest.fixture
    def src(self, cartpole_arrow: str) -> MinariDataSource:
        return MinariDataSource(cartpole_arrow)

    @pytest.fixture
    def expect(self, cartpole_arrow: str) -> Any:
        return _expect_from_minari("cartpole/arrow-v0")

    def test_every_transition_in_episode_order_matches_minari(self, src: MinariDataSource) -> None:
        _check_all_match_minari(src, "cartpole/arrow-v0")

    def test_episodes_follow_minari_and_ten_follows_nine(self, src: MinariDataSource) -> None:
        eps = list(minari.load_dataset("cartpole/arrow-v0").iterate_episodes())
        assert src.episodes.lengths.tolist() == [len(e.rewards) for e in eps]
        assert src.episodes.terminated.tolist() == [bool(e.terminations[-1]) for e in eps]

    def test_path_may_be_the_data_folder(self, cartpole_arrow: str) -> None:
        a = MinariDataSource(os.path.join(cartpole_arrow, "data"))
        assert repr(a) == repr(MinariDataSource(cartpole_arrow))

    def test_numeric_columns_are_views_of_the_mapped_files(self, src: MinariDataSource) -> None:
        src[0]
        h = src._handle
        col = h.column("observations", 0)
        assert not col.flags.owndata  # a view of the Arrow buffer, not a copy

    def test_batches_are_one_gather_per_leaf_or_per_episode_beyond_the_cache(
        self, cartpole_arrow: str, expect: Any
    ) -> None:
        idx = np.random.default_rng(2).integers(0, 100, 64)
        for cache_bytes, dense in ((1 << 20, True), (0, False)):
            src = MinariDataSource(cartpole_arrow, cache_bytes=cache_bytes)
            got = src.read_flat(idx)
            for k, v in expect(idx).items():
                np.testing.assert_array_equal(got[k], v, err_msg=f"{k} {cache_bytes}")
            assert (src._handle.dense("observations") is not None) == dense

    def test_loader_and_sharded_device_put_deliver_every_transition(
        self, src: MinariDataSource, expect: Any
    ) -> None:
        n = (len(src) // 8) * 8
        loader = gr.make_data_loader(src, batch_size=8, shuffle=False, worker_count=0)
        with gr.sharded_device_put(loader) as batches:
            got = [np.asarray(b["rewards"]) for b in batches]
        np.testing.assert_array_equal(np.concatenate(got), expect(np.arange(n))["rewards"])


# -- stores that DataCollector does not write, and unhappy paths ---------------------------


def _jpeg(frame: np.ndarray) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(frame).save(buf, format="JPEG")
    return buf.getvalue()


def _image_dataset(tmp_path: Any, obs: Any, steps: int = 3) -> str:
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    box = {"type": "Box", "dtype": "uint8", "shape": [32, 32], "low": 0, "high": 255}
    meta = {"jpeg_encoding": True, "data_format": "hdf5", "observation_space": json.dumps(box)}
    (data / "metadata.json").write_text(json.dumps(meta))
    with h5py.File(data / "main_data.hdf5", "w") as f:
        g = f.create_group("episode_0")
        g.create_dataset("observations", data=obs)
        g["actions"] = np.zeros(steps, np.int64)
        g["rewards"] = np.zeros(steps)
        g["terminations"] = np.arange(steps) == steps - 1
        g["truncations"] = np.zeros(steps, bool)
    return str(tmp_path / "ds")


def test_equal_length_frames_stored_as_a_2d_uint8_array_decode(tmp_path: Any) -> None:
    # Minari writes a plain (rows, bytes) uint8 dataset when every frame encodes to the same
    # length (here: identical frames).
    frame = (np.arange(32 * 32) % 200).astype(np.uint8).reshape(32, 32)
    blob = np.frombuffer(_jpeg(frame), np.uint8)
    src = MinariDataSource(_image_dataset(tmp_path, np.stack([blob] * 4)))
    want = np.asarray(PIL.open(io.BytesIO(blob.tobytes())))
    got = src.read_batch([0, 2])
    np.testing.assert_array_equal(got["observations"], np.stack([want, want]))
    np.testing.assert_array_equal(got["next_observations"][1], want)


def test_a_frame_that_is_not_jpeg_names_the_leaf(tmp_path: Any) -> None:
    vlen = h5py.vlen_dtype(np.uint8)
    obs = np.empty(4, dtype=object)
    for i in range(4):
        obs[i] = np.frombuffer(b"not a jpeg at all", np.uint8)
    path = _image_dataset(tmp_path, obs.astype(vlen))
    with pytest.raises(gr.InvalidStoreError, match=r"'observations'.*not a readable JPEG"):
        MinariDataSource(path)[0]


def test_frame_of_the_wrong_shape_names_leaf_and_shapes(tmp_path: Any) -> None:
    blob = np.frombuffer(_jpeg(np.zeros((40, 40), np.uint8)), np.uint8)
    path = _image_dataset(tmp_path, np.stack([blob] * 4))
    with pytest.raises(gr.InvalidStoreError, match=r"\(40, 40\).*\(32, 32\)"):
        MinariDataSource(path)[1]


def test_missing_pillow_gives_the_install_hint(
    images_hdf5: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = MinariDataSource(images_hdf5)
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(gr.MissingDependencyError, match=r"grain-replay\[rl\]"):
        src[0]


def test_missing_pyarrow_gives_the_install_hint(
    cartpole_arrow: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(gr.MissingDependencyError, match="pyarrow"):
        MinariDataSource(cartpole_arrow)


def test_parquet_format_is_refused_with_fix(tmp_path: Any) -> None:
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    (data / "metadata.json").write_text(json.dumps({"data_format": "parquet"}))
    with pytest.raises(gr.InvalidStoreError, match=r"'parquet'.*data_format='arrow'"):
        MinariDataSource(str(tmp_path / "ds"))


def test_truncated_arrow_file_is_named(cartpole_arrow: str, tmp_path: Any) -> None:
    copy = str(tmp_path / "cp")
    shutil.copytree(cartpole_arrow, copy)
    part = os.path.join(copy, "data", "3", "part-0.arrow")
    with open(part, "r+b") as f:
        f.truncate(os.path.getsize(part) // 2)
    with pytest.raises(gr.InvalidStoreError, match=r"3/part-0\.arrow.*truncated or corrupt"):
        MinariDataSource(copy)


def test_arrow_dataset_without_episodes_raises_with_fix(tmp_path: Any) -> None:
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    (data / "metadata.json").write_text(json.dumps({"data_format": "arrow"}))
    with pytest.raises(gr.InvalidStoreError, match="holds no episode"):
        MinariDataSource(str(tmp_path / "ds"))


def test_arrow_episode_added_after_pickling_raises_changed(
    cartpole_arrow: str, tmp_path: Any
) -> None:
    copy = str(tmp_path / "cp")
    shutil.copytree(cartpole_arrow, copy)
    blob = pickle.dumps(MinariDataSource(copy))
    shutil.copytree(os.path.join(copy, "data", "0"), os.path.join(copy, "data", "12"))
    with pytest.raises(gr.InvalidStoreError, match="changed since the source was made"):
        pickle.loads(blob)[0]
    assert len(MinariDataSource(copy)) > len(pickle.loads(blob))


def test_stats_of_a_jpeg_arrow_dataset_match_numpy_on_minari_frames(images_arrow: str) -> None:
    src = MinariDataSource(images_arrow)
    stats = gr.compute_stats(src, keys=["observations/rgb", "rewards"], cache=False)
    want = _expect_from_minari("images/arrow-v0")(np.arange(len(src)))
    rgb = want["observations/rgb"].astype(np.float64)
    np.testing.assert_allclose(stats["observations"]["rgb"]["mean"], rgb.mean(0), rtol=1e-12)
    np.testing.assert_array_equal(stats["observations"]["rgb"]["q99"], np.quantile(rgb, 0.99, 0))
    assert float(stats["rewards"]["max"]) == want["rewards"].max()


def _arrow_dataset(tmp_path: Any, infos: Any) -> str:
    import pyarrow as pa
    import pyarrow.ipc

    folder = tmp_path / "ds" / "data" / "0"
    folder.mkdir(parents=True)
    (tmp_path / "ds" / "data" / "metadata.json").write_text(json.dumps({"data_format": "arrow"}))
    obs = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(8, dtype=np.float32)), 2)
    table = pa.table(
        {
            "observations": obs, "actions": pa.array([0, 1, 0, 0]),
            "rewards": pa.array([1.0, 2.0, 3.0, 0.0]),
            "terminations": pa.array([False, False, True, False]),
            "truncations": pa.array([False] * 4), "infos": infos,
        }
    )  # fmt: skip
    with pa.ipc.new_file(str(folder / "part-0.arrow"), table.schema) as w:
        w.write_table(table)
    return str(tmp_path / "ds")


def test_string_info_is_refused_naming_it_and_infos_false_reads(tmp_path: Any) -> None:
    import pyarrow as pa

    infos = pa.StructArray.from_arrays([pa.array(["a", "b", "c", "d"])], names=["msg"])
    path = _arrow_dataset(tmp_path, infos)
    with pytest.raises(gr.InvalidStoreError, match=r"'infos/msg'.*string.*infos=False"):
        MinariDataSource(path, infos=True)
    src = MinariDataSource(path)
    np.testing.assert_array_equal(src.read_batch([2])["next_observations"], [[6.0, 7.0]])
    assert src.episodes.terminated.tolist() == [True]
