"""The RLDS index build's framing and wire parsing: in place over a map of the shard, CRCs
checked through the crc32c C library (or google_crc32c's copy-taking API), same results."""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np
import pytest
from rlds_fixture import (
    _len_field,
    _varint,
    example,
    feature_bytes,
    feature_floats,
    feature_ints,
    tfrecord,
    write_rlds,
)

import grain_replay as gr
from grain_replay.datasets.rlds import example as example_lib
from grain_replay.datasets.rlds import index as index_lib
from grain_replay.datasets.rlds import tfrecord as tfrecord_lib
from grain_replay.errors import InvalidStoreError


def _records(data: list[bytes], tmp_path: Any) -> str:
    path = str(tmp_path / "x.tfrecord-00000-of-00001")
    with open(path, "wb") as f:
        f.write(tfrecord(data))
    return path


@pytest.mark.parametrize("path_taken", ["hardware", "in_place", "copy"])
def test_frame_records_match_iter_records_with_every_crc_path(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, path_taken: str
) -> None:
    if path_taken == "hardware":  # the crc32c package (the fast extra)
        if tfrecord_lib._CRC_HW is None:
            pytest.skip("the crc32c package (the fast extra) is not installed, or not in hardware")
    else:
        monkeypatch.setattr(tfrecord_lib, "_CRC_HW", None)
    if path_taken == "copy":  # google_crc32c's value() on a copy, where the C library is not found
        monkeypatch.setattr(tfrecord_lib, "_CRC_AT", None)
    elif path_taken == "in_place" and tfrecord_lib._CRC_AT is None:
        pytest.skip("google_crc32c's C library is not reachable through ctypes here")
    data = [b"", b"a" * 300, os.urandom(70_000), b"xyz"]
    path = _records(data, tmp_path)
    mapping, address = tfrecord_lib.map_shard(path)
    framed = list(tfrecord_lib.frame_records(path, mapping, address))
    assert [(a, n) for a, n in framed] == [(a, len(d)) for a, d in tfrecord_lib.iter_records(path)]
    assert mapping is not None and [mapping[a : a + n] for a, n in framed] == data
    # A flipped byte in the third record's data: its CRC, named by the record's offset.
    third = framed[2][0] - tfrecord_lib.HEADER
    with open(path, "r+b") as f:
        f.seek(framed[2][0] + 5)
        byte = f.read(1)
        f.seek(framed[2][0] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    mapping, address = tfrecord_lib.map_shard(path)
    with pytest.raises(
        InvalidStoreError, match=f"bad CRC32C of the record data at byte offset {third}"
    ):
        list(tfrecord_lib.frame_records(path, mapping, address))
    assert len(list(tfrecord_lib.frame_records(path, mapping, address, check_crc=False))) == 4


def test_empty_and_truncated_shards(tmp_path: Any) -> None:
    empty = str(tmp_path / "empty")
    open(empty, "wb").close()
    assert list(tfrecord_lib.frame_records(empty, *tfrecord_lib.map_shard(empty))) == []
    path = _records([b"abc", b"defgh"], tmp_path)
    size = os.path.getsize(path)
    for cut, what in ((size - 2, "declares 5 bytes"), (3 + 16 + 5, "wanted 12 bytes")):
        with open(path, "r+b") as f:
            f.truncate(cut)
        with pytest.raises(
            InvalidStoreError, match=f"truncated record at byte offset 19: .*{what}"
        ):
            list(tfrecord_lib.frame_records(path, *tfrecord_lib.map_shard(path)))


def _layouts() -> dict[str, bytes]:
    """Examples laid out as TFDS writes them and in the other ways protobuf allows."""
    imgs = [os.urandom(n) for n in (5, 200, 20_000, 3_000_000)]
    usual = example(
        {
            "steps/image": feature_bytes(imgs),
            "steps/action": feature_floats(np.arange(6.0)),
            "steps/flag": feature_ints(np.array([0, 1, 1])),
            "steps/id": feature_ints(np.array([-3, 1 << 40, 127, 128])),
            "empty": _len_field(2, b""),  # an empty FloatList
            "nothing": b"",  # a Feature with no list
        }
    )
    unpacked = example(
        {
            "steps/action": feature_floats(np.arange(6.0), packed=False),
            "steps/flag": feature_ints(np.array([0, 1, 1]), packed=False),
        }
    )
    # The map entry's value before its key, and a Feature whose list kind repeats
    # (the last occurrence wins, as protobuf merges a oneof).
    entry = _len_field(2, feature_ints(np.array([7]))) + _len_field(1, b"steps/flag")
    swapped = _len_field(1, _len_field(1, entry))
    twice = feature_floats(np.arange(2.0)) + feature_floats(np.arange(3.0))
    repeated = example({"steps/action": twice})
    long_name = example({"n" * 200: feature_floats(np.arange(3.0))})
    return {
        "usual": usual,
        "unpacked": unpacked,
        "swapped": swapped,
        "repeated": repeated,
        "long_name": long_name,
    }


@pytest.mark.parametrize("layout", list(_layouts()))
def test_parse_in_place_equals_parse_of_the_record(tmp_path: Any, layout: str) -> None:
    record = _layouts()[layout]
    path = _records([b"\x00" * 7, record], tmp_path)  # the record at an offset in the file
    mapping, address = tfrecord_lib.map_shard(path)
    (_, _), (lo, n) = tfrecord_lib.frame_records(path, mapping, address)
    in_place = example_lib.parse_example(mapping, None, lo, lo + n)
    alone = example_lib.parse_example(record)
    assert in_place.keys() == alone.keys() and alone
    for name, v in alone.items():
        w = in_place[name]
        assert (w.kind, w.count, w.stride) == (v.kind, v.count, v.stride), name
        if v.kind == "float":
            assert w.offset - lo == v.offset or v.count == 0
            got = np.frombuffer(record, "<f4", v.count, v.offset) if v.stride == 4 else None
            if got is not None:
                assert got.tolist() == list(range(v.count))
        elif v.kind == "int64":
            assert v.values is not None and w.values is not None
            assert w.values.tolist() == v.values.tolist()
        elif v.kind == "bytes":
            assert v.offsets is not None and w.offsets is not None and v.lengths is not None
            assert (w.offsets - lo).tolist() == v.offsets.tolist()
            assert [record[o : o + ln] for o, ln in zip(v.offsets, v.lengths)] == [
                mapping[o : o + ln] for o, ln in zip(w.offsets, v.lengths)
            ]
    if layout == "usual":
        assert alone["steps/id"].values.tolist() == [-3, 1 << 40, 127, 128]  # type: ignore[union-attr]
        assert alone["steps/image"].lengths.tolist() == [5, 200, 20_000, 3_000_000]  # type: ignore[union-attr]
        assert (alone["empty"].kind, alone["empty"].count) == ("float", 0)
    if layout == "repeated":
        assert alone["steps/action"].count == 3
    wanted = example_lib.parse_example(mapping, {"steps/flag", "nope"}, lo, lo + n)
    assert set(wanted) <= {"steps/flag"}


def test_malformed_records_raise_wire_errors() -> None:
    good = example({"steps/image": feature_bytes([b"abcd", b"efgh"])})
    with pytest.raises(example_lib.WireError):
        example_lib.parse_example(good[:-3])  # a value runs past its message
    bad_float = example({"f": _len_field(2, _len_field(1, b"12345"))})
    with pytest.raises(example_lib.WireError, match="whole number of floats"):
        example_lib.parse_example(bad_float)
    huge = example({"b": _len_field(1, b"\x0a" + b"\xff" * 11)})
    with pytest.raises(example_lib.WireError):
        example_lib.parse_example(huge)
    assert _varint(300) == b"\xac\x02" and struct.calcsize("<QI") == 12


def test_index_in_threads_equals_the_index_in_one(tmp_path: Any) -> None:
    write_rlds(tmp_path, lengths=(5, 3, 7, 4, 6, 2, 9), shards=4)
    src = gr.RLDSDataSource(str(tmp_path), progress=False)
    one = index_lib.build_index(
        str(tmp_path), src.shards, src.features, use_cache=False, progress=False, threads=1
    )
    four = index_lib.build_index(
        str(tmp_path), src.shards, src.features, use_cache=False, progress=False, threads=4
    )
    assert one.arrays.keys() == four.arrays.keys()
    for k in one.arrays:
        assert one.arrays[k].dtype == four.arrays[k].dtype, k
        np.testing.assert_array_equal(one.arrays[k], four.arrays[k], err_msg=k)
    assert one.num_steps == 36
