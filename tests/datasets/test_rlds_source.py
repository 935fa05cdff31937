"""RLDSDataSource on datasets written to TFDS's published RLDS layout (no TensorFlow)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import struct
import subprocess
import sys
import tracemalloc
from typing import Any

import numpy as np
import pytest

pytest.importorskip("PIL")

from conformance import SourceTests, assert_flat_equal
from rlds_fixture import feature_bytes, write_rlds

import grain_replay as gr
from grain_replay.datasets.rlds import index as index_lib
from grain_replay.datasets.rlds.example import decode_varints, parse_example
from grain_replay.datasets.rlds.tfrecord import masked_crc
from grain_replay.errors import (
    InvalidArgumentError,
    InvalidStoreError,
    StoreNotFoundError,
    UnknownLeafError,
)
from grain_replay.store.formats import detect_format

LENGTHS = (5, 3, 7, 4, 6)
# Tree order: nested dicts with sorted keys (TFDS's features.json is sorted too).
STEP_KEYS = [
    "action",
    "discount",
    "is_first",
    "is_last",
    "is_terminal",
    "language_instruction",
    "observation/image",
    "observation/image_1",
    "observation/state",
    "reward",
]
META = ["episode_metadata/episode_id", "episode_metadata/file_path"]


def _shard(root: Any, i: int = 0, n: int = 3) -> str:
    return os.path.join(str(root), f"toy_rlds-train.tfrecord-{i:05d}-of-{n:05d}")


class TestRLDSConformance(SourceTests):
    def make(self, tmp_path: Any, scale: int) -> gr.RLDSDataSource:
        write_rlds(tmp_path, lengths=LENGTHS * scale, size=4)
        return gr.RLDSDataSource(tmp_path, progress=False)

    @pytest.fixture
    def data(self, tmp_path: Any) -> dict[str, np.ndarray]:
        return write_rlds(tmp_path / "ds", lengths=LENGTHS)

    @pytest.fixture
    def src(self, tmp_path: Any, data: dict[str, np.ndarray]) -> gr.RLDSDataSource:
        return gr.RLDSDataSource(tmp_path / "ds", progress=False)

    @pytest.fixture
    def expect(self, data: dict[str, np.ndarray]) -> Any:
        return lambda ids: {k: data[k][ids] for k in STEP_KEYS}


@pytest.fixture
def ds(tmp_path: Any) -> tuple[str, dict[str, np.ndarray]]:
    root = str(tmp_path / "toy_rlds" / "1.0.0")
    return root, write_rlds(root, lengths=LENGTHS)


# -- values ---------------------------------------------------------------------------


def test_steps_in_read_order_with_declared_dtypes_and_shapes(ds: Any) -> None:
    root, data = ds
    src = gr.RLDSDataSource(root, progress=False)
    assert len(src) == sum(LENGTHS)
    assert src.keys == STEP_KEYS  # episode features only when named
    spec = src.spec
    assert spec["observation/image"] == gr.LeafSpec(np.dtype(np.uint8), (8, 8, 3))
    assert spec["action"] == gr.LeafSpec(np.dtype(np.float32), (7,))
    assert spec["is_last"] == gr.LeafSpec(np.dtype(bool), ())
    width = max(len(s) for s in data["language_instruction"])
    assert spec["language_instruction"].dtype == np.dtype(f"S{width}")
    got = src.read_flat(np.arange(len(src)))
    assert_flat_equal(got, {k: data[k] for k in STEP_KEYS})
    assert src.read_batch([3])["observation"]["image"].shape == (1, 8, 8, 3)


def test_episode_metadata_repeated_per_step_when_named(ds: Any) -> None:
    root, data = ds
    src = gr.RLDSDataSource(root, keys=["action", "episode_metadata"], progress=False)
    assert src.keys == ["action", *META]
    rng = np.random.default_rng(1)
    idx = rng.integers(0, len(src), 40)
    assert_flat_equal(src.read_flat(idx), {k: data[k][idx] for k in ["action", *META]})
    one = gr.RLDSDataSource(root, keys=["episode_metadata/episode_id"], progress=False)
    assert one[7]["episode_metadata"]["episode_id"] == 1001  # step 7 is in episode 1


def test_unpacked_lists_read_like_packed(tmp_path: Any) -> None:
    data = write_rlds(tmp_path, lengths=(4, 2), shards=1, packed=False)
    src = gr.RLDSDataSource(tmp_path, keys=[*STEP_KEYS, *META], progress=False)
    assert_flat_equal(src.read_flat(np.arange(6)[::-1]), {k: data[k][::-1] for k in src.keys})


def test_keys_select_groups_and_unknown_keys_are_named(ds: Any) -> None:
    root, _ = ds
    src = gr.RLDSDataSource(root, keys=["observation"], progress=False)
    assert src.keys == ["observation/image", "observation/image_1", "observation/state"]
    with pytest.raises(UnknownLeafError, match="nope"):
        gr.RLDSDataSource(root, keys=["nope"], progress=False)


def test_open_source_detects_an_rlds_folder(ds: Any) -> None:
    root, data = ds
    assert detect_format(root) == "rlds"
    src = gr.open_source(root, keys=["action"])
    assert isinstance(src, gr.RLDSDataSource)
    np.testing.assert_array_equal(src.read_batch([0, 24])["action"], data["action"][[0, 24]])


def test_split_is_chosen_and_an_unknown_split_is_named(ds: Any) -> None:
    root, _ = ds
    assert gr.RLDSDataSource(root, split="train", progress=False).split == "train"
    with pytest.raises(InvalidArgumentError, match=r"no split 'test'.*\['train'\]"):
        gr.RLDSDataSource(root, split="test", progress=False)


# -- episodes and views -----------------------------------------------------------------


def test_episodes_come_from_the_rlds_flags(ds: Any) -> None:
    root, _ = ds
    src = gr.RLDSDataSource(root, keys=["action"], progress=False)  # flags not even read
    terminated = [e % 2 == 0 for e in range(len(LENGTHS))]
    want = gr.EpisodeIndex.from_lengths(LENGTHS, terminated)
    assert gr.build_episode_index(src) == want
    assert src.episodes == want  # offered by the dataset itself, as Minari and LeRobot do
    # A converted store keeps the flags as leaves: the views find them by name.
    full = gr.RLDSDataSource(root, progress=False)
    flags = gr.rl.EpisodeFlags().resolve(full.spec, root)
    assert (flags.done, flags.terminated) == ("is_last", "is_terminal")


def test_action_chunks_through_sequence_data_source(ds: Any) -> None:
    root, data = ds
    src = gr.RLDSDataSource(root, keys=["observation/image", "action"], progress=False)
    offsets = {"action": list(range(4)), "observation/image": [0]}
    seq = gr.SequenceDataSource(src, offsets=offsets, pad="edge")
    assert len(seq) == sum(LENGTHS)
    b = seq.read_batch([3, 5])  # episode 0's step 3 (pads past its end), episode 1's step 0
    a = data["action"]
    np.testing.assert_array_equal(b["action"][0], a[[3, 4, 4, 4]])
    np.testing.assert_array_equal(b["action_is_pad"][0], [False, False, True, True])
    np.testing.assert_array_equal(b["action"][1], a[[5, 6, 7, 7]])
    np.testing.assert_array_equal(
        b["observation"]["image"][:, 0], data["observation/image"][[3, 5]]
    )


def test_loader_with_zero_and_two_workers_and_sharded_device_put(ds: Any) -> None:
    root, data = ds
    keys = ["observation/image", "action", "is_last"]
    src = gr.RLDSDataSource(root, keys=keys, progress=False)
    for workers in (0, 2):
        loader = gr.make_data_loader(src, batch_size=8, shuffle=True, seed=3, worker_count=workers)
        seen = []
        for batch in gr.sharded_device_put(loader):
            img = np.asarray(batch["observation"]["image"])
            act = np.asarray(batch["action"])
            rows = [int(np.flatnonzero((data["action"] == r).all(1))[0]) for r in act]
            np.testing.assert_array_equal(img, data["observation/image"][rows])
            seen += rows
        assert len(seen) == 24 and len(set(seen)) == 24, workers


# -- the index ----------------------------------------------------------------------------


def test_index_is_cached_beside_the_dataset_and_reused(ds: Any, monkeypatch: Any) -> None:
    root, _ = ds
    gr.RLDSDataSource(root, progress=False)
    cached = sorted(os.listdir(os.path.join(root, index_lib.CACHE_FOLDER)))
    assert len(cached) == 3 and all(c.endswith(".npz") for c in cached)
    calls = []
    real = index_lib.index_shard
    monkeypatch.setattr(index_lib, "index_shard", lambda *a, **k: calls.append(a) or real(*a, **k))
    src = gr.RLDSDataSource(root, keys=["action"], progress=False)  # other keys: same cache
    assert calls == [] and len(src) == sum(LENGTHS)
    # A shard that changed is indexed again; the others come from the cache.
    with open(_shard(root, 1), "ab") as f:
        f.write(b"")
    os.utime(_shard(root, 1), ns=(1, 1))
    gr.RLDSDataSource(root, progress=False)
    assert [os.path.basename(c[0]) for c in calls] == [os.path.basename(_shard(root, 1))]


def test_read_only_dataset_caches_the_index_in_the_user_cache(
    tmp_path: Any, monkeypatch: Any
) -> None:
    if os.geteuid() == 0:
        # root writes anywhere: simulate a read-only folder by refusing the write there.
        real_makedirs = os.makedirs

        def makedirs(path: str, *a: Any, **k: Any) -> None:
            if index_lib.CACHE_FOLDER in path:
                raise PermissionError(13, "read-only", path)
            real_makedirs(path, *a, **k)

        monkeypatch.setattr(index_lib.os, "makedirs", makedirs)
    root = tmp_path / "ro"
    data = write_rlds(root, lengths=(3, 2), shards=2)
    os.chmod(root, stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        src = gr.RLDSDataSource(root, keys=["action"], progress=False)
        np.testing.assert_array_equal(src.read_batch([4])["action"][0], data["action"][4])
    finally:
        os.chmod(root, stat.S_IRWXU)
    user = tmp_path / "cache" / "grain_replay" / "rlds"
    (folder,) = os.listdir(user)
    assert len(os.listdir(user / folder)) == 2
    assert not os.path.exists(root / index_lib.CACHE_FOLDER)


def test_pickle_carries_no_index_and_workers_reload_it(ds: Any) -> None:
    root, data = ds
    src = gr.RLDSDataSource(root, keys=["action"], progress=False)
    clone = pickle.loads(pickle.dumps(src))
    assert clone._index is None
    np.testing.assert_array_equal(clone[11]["action"], data["action"][11])
    assert len(pickle.dumps(src)) < 8192


def test_batch_memory_is_bounded_by_the_batch_not_the_dataset(tmp_path: Any) -> None:
    small = gr.RLDSDataSource(write_and(tmp_path / "s", 1), progress=False)
    big = gr.RLDSDataSource(write_and(tmp_path / "b", 40), progress=False)
    assert len(big) > 30 * len(small)
    peaks = []
    for src in (small, big):
        src.read_batch(np.arange(8))  # open the handle first
        tracemalloc.start()
        src.read_batch(np.arange(8)[::-1] * 2)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    # 8 steps of two 8x8 RGB images and a few floats: a few KiB, whatever the dataset's size.
    assert peaks[1] < 256 * 1024, peaks
    assert peaks[1] < 2 * peaks[0] + 16 * 1024, peaks


def write_and(root: Any, scale: int) -> str:
    write_rlds(root, lengths=LENGTHS * scale, shards=3)
    return str(root)


# -- the read path needs no TensorFlow ---------------------------------------------------


def test_tensorflow_is_never_imported(ds: Any) -> None:
    root, _ = ds
    code = (
        "import sys, numpy as np, grain_replay as gr\n"
        f"src = gr.open_source({root!r}, keys=['observation', 'action', 'episode_metadata'])\n"
        "src.read_batch(np.arange(len(src)))\n"
        "gr.SequenceDataSource(src, offsets={'action': [0, 1]}).read_batch([0])\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('tensorflow', 'tensorflow_datasets', 'tf_keras')]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- unhappy paths ---------------------------------------------------------------------------


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_bad_data_crc_names_the_file_and_record_offset(ds: Any) -> None:
    root, _ = ds
    shard = _shard(root, 0)  # two episodes
    with open(shard, "rb") as f:
        (first,) = struct.unpack("<Q", f.read(8))
    second = 12 + first + 4
    _flip(shard, second + 12 + 40)  # inside the second record's data
    with pytest.raises(InvalidStoreError) as e:
        gr.RLDSDataSource(root, progress=False)
    msg = str(e.value)
    assert shard in msg and f"byte offset {second}" in msg and "CRC32C" in msg and "Fix" in msg


def test_bad_length_crc_and_truncated_record_are_named(ds: Any) -> None:
    root, _ = ds
    shard = _shard(root, 0)
    _flip(shard, 2)
    with pytest.raises(
        InvalidStoreError, match=r"bad CRC32C of the record length at byte offset 0"
    ):
        gr.RLDSDataSource(root, progress=False)
    _flip(shard, 2)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(InvalidStoreError, match=r"truncated record at byte offset \d+") as e:
        gr.RLDSDataSource(root, progress=False)
    assert shard in str(e.value)


def test_check_crc_false_skips_the_checks(ds: Any) -> None:
    root, data = ds
    shard = _shard(root, 0)
    size = os.path.getsize(shard)
    _flip(shard, size - 1)  # the last record's data CRC itself
    src = gr.RLDSDataSource(root, keys=["action"], check_crc=False, progress=False)
    np.testing.assert_array_equal(src.read_batch([0])["action"], data["action"][:1])


def test_unsupported_feature_type_is_named(ds: Any) -> None:
    root, _ = ds
    path = os.path.join(root, "features.json")
    with open(path) as f:
        doc = json.load(f)
    steps = doc["featuresDict"]["features"]["steps"]["sequence"]["feature"]
    steps["featuresDict"]["features"]["boxes"] = {
        "pythonClassName": "tensorflow_datasets.core.features.bounding_boxes.BBoxFeature",
        "tensor": {"shape": {"dimensions": ["4"]}, "dtype": "float32"},
    }
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(InvalidStoreError, match=r"'boxes' is a 'bounding_boxes.BBoxFeature'"):
        gr.RLDSDataSource(root, progress=False)


def test_dynamic_shapes_and_non_rlds_features_are_refused(ds: Any) -> None:
    root, _ = ds
    path = os.path.join(root, "features.json")
    with open(path) as f:
        doc = json.load(f)
    feats = doc["featuresDict"]["features"]["steps"]["sequence"]["feature"]["featuresDict"]
    feats["features"]["action"]["tensor"]["shape"] = {"dimensions": ["-1"]}
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(InvalidStoreError, match=r"'action' \(.*Tensor\) has a dynamic shape"):
        gr.RLDSDataSource(root, progress=False)
    with open(path, "w") as f:
        json.dump({"featuresDict": {"features": {"image": {}}}}, f)
    with pytest.raises(InvalidStoreError, match="no 'steps' Dataset"):
        gr.RLDSDataSource(root, progress=False)


def test_image_that_does_not_decode_names_file_episode_step_and_feature(tmp_path: Any) -> None:
    write_rlds(tmp_path, lengths=(3, 4), shards=1)
    shard = _shard(tmp_path, 0, 1)
    # Replace step 2 of episode 1's JPEG with garbage of the same length, CRCs rewritten.
    with open(shard, "rb") as f:
        raw = f.read()
    (n0,) = struct.unpack_from("<Q", raw, 0)
    start = 12 + n0 + 4
    (n1,) = struct.unpack_from("<Q", raw, start)
    rec = bytearray(raw[start + 12 : start + 12 + n1])
    feats = parse_example(bytes(rec), {"steps/observation/image"})["steps/observation/image"]
    assert feats.offsets is not None and feats.lengths is not None
    o, n = int(feats.offsets[2]), int(feats.lengths[2])
    rec[o : o + n] = b"\x00" * n
    head = struct.pack("<Q", n1)
    new = head + struct.pack("<I", masked_crc(head)) + rec + struct.pack("<I", masked_crc(rec))
    with open(shard, "wb") as f:
        f.write(raw[:start] + new)
    src = gr.RLDSDataSource(tmp_path, keys=["observation/image"], progress=False)
    src.read_batch([0, 4])  # other steps decode
    with pytest.raises(InvalidStoreError) as e:
        src.read_batch([5])
    msg = str(e.value)
    assert shard in msg and "episode 1" in msg and "step 2" in msg
    assert "'observation/image'" in msg and "does not decode" in msg


def test_missing_dataset_files_and_shards_are_named(ds: Any, tmp_path: Any) -> None:
    root, _ = ds
    with pytest.raises(StoreNotFoundError, match="No RLDS dataset"):
        gr.RLDSDataSource(tmp_path / "nothing", progress=False)
    os.unlink(_shard(root, 2))
    with pytest.raises(StoreNotFoundError, match=r"shard 2 of 3 of split 'train'"):
        gr.RLDSDataSource(root, progress=False)
    os.unlink(os.path.join(root, "features.json"))
    with pytest.raises(StoreNotFoundError, match=r"features\.json is missing"):
        gr.RLDSDataSource(root, progress=False)


@pytest.mark.parametrize("name", ["features.json", "dataset_info.json"])
def test_missing_or_invalid_dataset_json_is_named_with_the_fix(ds: Any, name: str) -> None:
    root, _ = ds
    where = os.path.join(root, name)
    with open(where, "w") as f:
        f.write("{not json")
    with pytest.raises(InvalidStoreError, match="is not valid JSON") as bad:
        gr.RLDSDataSource(root, progress=False)
    assert where in str(bad.value)
    os.unlink(where)
    with pytest.raises(StoreNotFoundError, match="is missing") as missing:
        gr.RLDSDataSource(root, progress=False)
    msg = str(missing.value)
    assert where in msg and "not a TFDS-built dataset directory" in msg and "Fix:" in msg


def test_shard_that_changed_after_indexing_is_refused(ds: Any) -> None:
    root, _ = ds
    src = gr.RLDSDataSource(root, keys=["action"], progress=False)
    with open(_shard(root, 0), "ab") as f:
        f.write(b"x")
    with pytest.raises(InvalidStoreError, match="changed under the source"):
        src.read_batch([0])


def test_record_that_does_not_match_features_json_is_named(tmp_path: Any) -> None:
    write_rlds(tmp_path, lengths=(3,), shards=1)
    path = os.path.join(tmp_path, "features.json")
    with open(path) as f:
        doc = json.load(f)
    feats = doc["featuresDict"]["features"]["steps"]["sequence"]["feature"]["featuresDict"]
    feats["features"]["action"]["tensor"]["shape"] = {"dimensions": ["6"]}
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(InvalidStoreError, match=r"'steps/action' holds 21 float values"):
        gr.RLDSDataSource(tmp_path, progress=False)


# -- wire format units -------------------------------------------------------------------------


def test_varints_decode_like_protobuf() -> None:
    from rlds_fixture import _varint

    values = [0, 1, 127, 128, 300, 2**31, 2**63 - 1, -1, -(2**63)]
    data = b"".join(_varint(v) for v in values)
    np.testing.assert_array_equal(decode_varints(data), np.array(values, np.int64))


def test_bytes_feature_offsets_point_at_the_values() -> None:
    from rlds_fixture import example

    rec = example({"a": feature_bytes([b"xy", b"", b"hello"])})
    got = parse_example(rec)["a"]
    assert got.offsets is not None and got.lengths is not None
    assert [rec[o : o + n] for o, n in zip(got.offsets, got.lengths)] == [b"xy", b"", b"hello"]


def test_cli_info_verify_convert_stats(ds: Any, tmp_path: Any) -> None:
    root, data = ds
    from grain_replay.cli import main

    assert main(["info", root, "--json"]) == 0
    assert main(["verify", root, "--quiet"]) == 0
    assert main(["stats", root, "--keys", "action", "--quiet"]) == 0
    dst = str(tmp_path / "copy.h5")
    assert main(["convert", root, dst, "--quiet"]) == 0
    out = gr.open_source(dst)
    flat = out.read_flat(np.arange(len(out)))
    np.testing.assert_array_equal(flat["observation/image"], data["observation/image"])
    np.testing.assert_array_equal(flat["action"], data["action"])
    text = [bytes(r).rstrip(b"\0") for r in flat["language_instruction"]]
    assert text == list(data["language_instruction"])
    # The converted store's flags still give the episodes.
    assert gr.build_episode_index(out, cache=False) == gr.build_episode_index(
        gr.RLDSDataSource(root, progress=False)
    )
    shutil.rmtree(tmp_path / "copy.h5", ignore_errors=True)


def test_jpeg_decoders_agree_and_png_is_exact() -> None:
    from rlds_fixture import _encode_image

    from grain_replay.datasets.rlds.images import decode_image

    simplejpeg = pytest.importorskip("simplejpeg")
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (16, 24, 3), dtype=np.uint8)
    img[:8] = 90
    jpeg = _encode_image(img, "jpeg")
    u8 = np.dtype(np.uint8)
    fast = decode_image(jpeg, (16, 24, 3), u8, simplejpeg)
    slow = decode_image(jpeg, (16, 24, 3), u8, None)  # Pillow
    diff = np.abs(fast.astype(int) - slow.astype(int))
    assert 0 < diff.max() <= 16 and diff.mean() < 2  # fast IDCT (TF's) vs accurate (Pillow's)
    png = _encode_image(img, "png")
    np.testing.assert_array_equal(decode_image(png, (16, 24, 3), u8, simplejpeg), img)
    with pytest.raises(ValueError, match="reshape"):
        decode_image(jpeg, (16, 16, 3), u8, simplejpeg)  # another shape than declared


def test_array_record_shards_read_like_tfrecord_ones(tmp_path: Any) -> None:
    ar = pytest.importorskip("array_record.python.array_record_module")
    from grain_replay.datasets.rlds.tfrecord import iter_records

    data = write_rlds(tmp_path, lengths=LENGTHS, shards=2)
    info_path = os.path.join(tmp_path, "dataset_info.json")
    for i in range(2):  # the same episodes as TFDS's file_format="array_record" lays them out
        src_path = _shard(tmp_path, i, 2)
        dst = src_path.replace(".tfrecord-", ".array_record-")
        writer = ar.ArrayRecordWriter(dst, "group_size:1")
        for _, rec in iter_records(src_path):
            writer.write(rec)
        writer.close()
        os.unlink(src_path)
    with open(info_path) as f:
        info = json.load(f)
    info["fileFormat"] = "array_record"
    with open(info_path, "w") as f:
        json.dump(info, f)
    src = gr.open_source(tmp_path, keys=[*STEP_KEYS, *META], record_cache_bytes=10_000)
    assert isinstance(src, gr.RLDSDataSource)
    idx = np.random.default_rng(0).integers(0, len(src), 60)
    assert_flat_equal(src.read_flat(idx), {k: data[k][idx] for k in src.keys})
    assert gr.build_episode_index(src).lengths.tolist() == list(LENGTHS)


def test_replay_writer_refuses_to_append_to_an_rlds_dataset(ds: Any) -> None:
    root, _ = ds
    with pytest.raises(InvalidStoreError, match="rlds dataset, which grain_replay reads"):
        gr.ReplayWriter(root)


def test_wire_parser_skips_unknown_fields_and_refuses_garbage() -> None:
    from rlds_fixture import _len_field, _varint, example, feature_floats

    from grain_replay.datasets.rlds.example import WireError

    unknown = _varint(5 << 3 | 0) + _varint(300)  # an unknown varint field inside a BytesList
    feat = _len_field(1, unknown + _len_field(1, b"ab") + unknown + _len_field(1, b"c"))
    rec = example({"t": feat, "f": feature_floats(np.arange(3, dtype=np.float32))})
    got = parse_example(rec)
    t, f = got["t"], got["f"]
    assert t.offsets is not None and t.lengths is not None
    assert [rec[o : o + n] for o, n in zip(t.offsets, t.lengths)] == [b"ab", b"c"]
    assert (f.kind, f.count, f.stride) == ("float", 3, 4)
    assert np.frombuffer(rec[f.offset : f.offset + 12], "<f4").tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(WireError):
        parse_example(rec[:-3])  # cut inside a field


def test_urls_are_refused_with_the_fix() -> None:
    with pytest.raises(InvalidArgumentError, match=r"local file system.*copy the dataset"):
        gr.RLDSDataSource("gs://bucket/bridge/1.0.0")
