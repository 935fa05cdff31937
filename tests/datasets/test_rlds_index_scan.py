"""The compiled scan of RLDS records (numba) against the Python parser, its reference and
fallback: the same features, the same indexes and the same errors, on every layout."""

from __future__ import annotations

import os
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
    write_rlds_columns,
)

import grain_replay as gr
from grain_replay.datasets.rlds import example as example_lib
from grain_replay.datasets.rlds import example_scan
from grain_replay.datasets.rlds import index as index_lib
from grain_replay.errors import InvalidStoreError
from grain_replay.sources.reading.kernel_load import BackgroundLoad

KERNELS = example_scan.loaded(wait=True)
needs_numba = pytest.mark.skipif(KERNELS is None, reason="numba is not installed")


def _scan(record: bytes, wanted: set[str] | None = None, pad: int = 0) -> Any:
    """The compiled scan's features of ``record`` (at ``pad`` bytes into its buffer) and the
    scanner, offsets made relative to the record."""
    buf = b"\xff" * pad + record + b"\x12\x0a"  # bytes around it that must not be read
    scanner = example_scan.ExampleScanner(KERNELS)
    names = None if wanted is None else {w.encode(): w for w in wanted}
    got = scanner.parse(np.frombuffer(buf, np.uint8), buf, names, pad, pad + len(record))
    return _relative(got, pad), scanner


def _relative(parsed: dict[str, Any], base: int) -> dict[str, tuple[Any, ...]]:
    out = {}
    for name, v in parsed.items():
        offsets = None if v.offsets is None else (v.offsets - base).tolist()
        values = None if v.values is None else (v.values.dtype.str, v.values.tolist())
        lengths = None if v.lengths is None else (v.lengths.dtype.str, v.lengths.tolist())
        offset = v.offset - base if v.kind == "float" and v.count else v.offset
        out[name] = (v.kind, v.count, offset, v.stride, offsets, lengths, values)
    return out


def _python(record: bytes, wanted: set[str] | None = None) -> dict[str, tuple[Any, ...]]:
    return _relative(example_lib.parse_example(record, wanted), 0)


def _outcome(fn: Any) -> Any:
    try:
        return ("ok", fn())
    except example_lib.WireError as e:
        return ("WireError", str(e))


def _layouts() -> dict[str, bytes]:
    """Examples as TFDS writes them and in the other ways protobuf allows."""
    imgs = [os.urandom(n) for n in (0, 5, 200, 20_000, 300_000)]
    ints = np.array([0, 1, -1, -3, 127, 128, 1 << 40, (1 << 63) - 1, -(1 << 63)])
    usual = {
        "steps/observation/image": feature_bytes(imgs),
        "steps/action": feature_floats(np.arange(6.0)),
        "steps/is_first": feature_ints(np.array([1, 0, 0])),
        "steps/id": feature_ints(ints),
        "steps/language_instruction": feature_bytes([b"pick", b""]),
        "empty_floats": _len_field(2, b""),
        "empty_ints": _len_field(3, b""),
        "empty_bytes": _len_field(1, b""),
        "packed_empty_ints": _len_field(3, _len_field(1, b"")),
        "nothing": b"",
        "\u00e9t\u00e9/\xff": feature_floats(np.arange(1.0)),
    }
    unpacked = {
        "steps/action": feature_floats(np.arange(6.0), packed=False),
        "steps/flag": feature_ints(ints, packed=False),
        "one": feature_floats(np.arange(1.0), packed=False),
    }
    # The map entry's value before its key; a key alone; a value alone.
    swapped = _len_field(2, feature_ints(np.array([7]))) + _len_field(1, b"steps/flag")
    key_only = _len_field(1, b"lonely")
    value_only = _len_field(2, feature_floats(np.arange(2.0)))
    odd_entries = _len_field(1, b"".join(_len_field(1, e) for e in (swapped, key_only, value_only)))
    # A list kind given twice (the last one wins, as protobuf merges a oneof), packed runs of
    # ints split over fields, an unknown field in a BytesList, an Example with two Features
    # fields and an unknown field, a name given twice.
    twice = feature_floats(np.arange(2.0)) + feature_floats(np.arange(3.0))
    split_ints = _len_field(3, _len_field(1, b"\x01\x02") + b"\x08\x05" + _len_field(1, b"\x7f"))
    extra = _len_field(1, _len_field(1, b"ab") + b"\x10\x05" + _len_field(1, b"c"))
    features = _len_field(1, _len_field(1, b"x") + _len_field(2, feature_floats(np.ones(2))))
    again = _len_field(1, _len_field(1, b"x") + _len_field(2, feature_ints(np.ones(3))))
    two_features = (
        _len_field(1, features) + b"\x10\x01" + _len_field(1, again) + _len_field(7, b"zz")
    )
    many = {f"f{i}": feature_ints(np.arange(i % 7)) for i in range(200)}
    many["big"] = feature_bytes([b"ab"] * 9000)  # past the scanner's first arrays
    return {
        "usual": example(usual),
        "unpacked": example(unpacked),
        "odd_entries": odd_entries,
        "repeated": example({"a": twice, "i": split_ints, "b": extra}),
        "two_features": two_features,
        "long_name": example({"n" * 300: feature_floats(np.arange(3.0))}),
        "many": example(many),
        "empty": b"",
        "empty_features": _len_field(1, b""),
    }


@needs_numba
@pytest.mark.parametrize("layout", list(_layouts()))
def test_compiled_scan_equals_the_python_parser(layout: str) -> None:
    record = _layouts()[layout]
    want = _python(record)
    for pad in (0, 13):
        got, scanner = _scan(record, pad=pad)
        assert got == want
        assert scanner.fallbacks == 0  # every layout above is the compiled scan's own
    names = set(list(want)[::2]) | {"nope"}
    assert _scan(record, names)[0] == _python(record, names)


def _malformed() -> dict[str, bytes]:
    good = example({"steps/image": feature_bytes([b"abcd", b"efgh"])})
    return {
        "truncated": good[:-3],
        "partial_float": example({"f": _len_field(2, _len_field(1, b"12345"))}),
        "long_varint": example({"b": _len_field(1, b"\x0a" + b"\xff" * 11)}),
        "ints_end_in_varint": example({"i": _len_field(3, _len_field(1, b"\x01\x81"))}),
        "eleven_byte_int": example({"i": _len_field(3, _len_field(1, b"\x81" * 10 + b"\x01"))}),
        "mixed_kinds": example({"m": feature_floats(np.ones(1)) + feature_ints(np.ones(1))}),
        "mixed_floats": example(
            {"m": _len_field(2, _len_field(1, b"\0" * 4) + b"\x0d" + b"\0" * 4)}
        ),
        "unknown_list": example({"u": _len_field(4, b"")}),
        "bytes_not_len": example({"b": _len_field(1, b"\x08\x01")}),
        "group_wire": _len_field(1, b"\x0b"),
        "tag_at_end": _len_field(1, _len_field(1, b"\x0a\x01f\x12")),
        "empty_entry": _len_field(1, _len_field(1, b"")),
        "int_wire_i32": example({"i": _len_field(3, b"\x0d\0\0\0\0")}),
    }


@needs_numba
@pytest.mark.parametrize("case", list(_malformed()))
def test_malformed_records_give_the_python_parsers_outcome(case: str) -> None:
    record = _malformed()[case]
    want = _outcome(lambda: _python(record))
    got = _outcome(lambda: _scan(record)[0])
    assert got == want
    if case != "empty_entry":  # an entry with neither key nor value: skipped, as protobuf does
        assert want[0] == "WireError", want


@needs_numba
def test_mutated_records_give_the_python_parsers_outcome() -> None:
    """Every truncation and many single-byte changes of a TFDS-like record: the same result
    or the same error from both."""
    rng = np.random.default_rng(0)
    record = example(
        {
            "steps/image": feature_bytes([bytes(rng.integers(0, 256, 300, np.uint8))] * 3),
            "steps/action": feature_floats(np.arange(4.0)),
            "steps/flag": feature_ints(np.array([0, 1, 300, -2])),
            "steps/up": feature_floats(np.arange(2.0), packed=False),
            "steps/text": feature_bytes([b"hi", b""]),
        }
    )
    cases = [record[:n] for n in range(len(record))]
    for _ in range(600):
        b = bytearray(record)
        b[rng.integers(len(b))] = rng.choice(
            [0x00, 0x0A, 0x12, 0x1A, 0x80, 0xFF, rng.integers(256)]
        )
        cases.append(bytes(b))
    kinds = set()
    for case in cases:
        want = _outcome(lambda c=case: _python(c))
        assert _outcome(lambda c=case: _scan(c, pad=5)[0]) == want, case
        kinds.add(want[0])
    assert kinds == {"ok", "WireError"}


def _index(root: Any, compiled_scan: bool) -> index_lib.Index:
    src = gr.RLDSDataSource(str(root), progress=False)
    return index_lib.build_index(
        str(root),
        src.shards,
        src.features,
        use_cache=False,
        progress=False,
        compiled_scan=compiled_scan,
    )


def _assert_same(a: index_lib.Index, b: index_lib.Index) -> None:
    assert a.arrays.keys() == b.arrays.keys() and a.shards == b.shards
    for k in a.arrays:
        assert a.arrays[k].dtype == b.arrays[k].dtype, k
        np.testing.assert_array_equal(a.arrays[k], b.arrays[k], err_msg=k)
    np.testing.assert_array_equal(a.ends, b.ends)
    np.testing.assert_array_equal(a.episode_shard, b.episode_shard)


@needs_numba
@pytest.mark.parametrize("kind", ["usual", "unpacked", "one_shard", "no_cameras", "columns"])
def test_compiled_index_equals_the_python_index(tmp_path: Any, kind: str) -> None:
    if kind == "columns":
        steps = {
            "a": np.arange(40, dtype=np.float32).reshape(20, 2),
            "b": np.arange(20, dtype=np.int32) - 7,
            "c": np.arange(20, dtype=np.uint8),
            "d": (np.arange(20, dtype=np.int64) - 10) * (1 << 40),
        }
        write_rlds_columns(tmp_path, steps, [3, 9, 0, 1, 7], shards=3)  # an empty episode too
    else:
        lengths = (4, 6, 2) if kind == "one_shard" else (5, 3, 7, 4)
        write_rlds(
            tmp_path,
            lengths=lengths,
            shards=1 if kind == "one_shard" else 3,
            cameras=0 if kind == "no_cameras" else 2,
            packed=kind != "unpacked",
        )
    python, compiled = _index(tmp_path, False), _index(tmp_path, True)
    _assert_same(python, compiled)
    assert python.num_steps > 0
    # The default build (the compiled scan, loaded above) gives the same index too.
    _assert_same(python, _index(tmp_path, None))  # type: ignore[arg-type]


@needs_numba
def test_every_record_of_a_fixture_is_the_compiled_scans_own(tmp_path: Any) -> None:
    from grain_replay.datasets.rlds import tfrecord as tfrecord_lib

    for packed in (True, False):
        root = tmp_path / str(packed)
        write_rlds(root, lengths=(2, 5), shards=1, packed=packed)
        (shard,) = gr.RLDSDataSource(str(root), progress=False).shards
        mapping, address = tfrecord_lib.map_shard(shard)
        scanner = example_scan.ExampleScanner(KERNELS)
        view = np.frombuffer(mapping, np.uint8)
        for lo, n in tfrecord_lib.frame_records(shard, mapping, address):
            got = _relative(scanner.parse(view, mapping, None, lo, lo + n), lo)
            assert got == _python(mapping[lo : lo + n])
        assert scanner.fallbacks == 0
        del view


@needs_numba
def test_a_clean_shard_is_scanned_at_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rlds(tmp_path, lengths=(3, 4, 2), shards=2, packed=False)
    python = _index(tmp_path, False)

    def by_record(*args: Any) -> None:
        raise AssertionError("indexed record by record")

    monkeypatch.setattr(index_lib, "_index_by_record", by_record)
    _assert_same(python, _index(tmp_path, True))


def _append(shard: str, records: list[bytes]) -> int:
    """Appends the records to the shard; returns the byte offset of the first."""
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(tfrecord(records))
    return offset


@pytest.mark.parametrize("compiled_scan", [False, True])
def test_shard_errors_are_the_python_parsers_in_record_order(
    tmp_path: Any, compiled_scan: bool
) -> None:
    write_rlds(tmp_path, lengths=(3, 4), shards=1)
    (shard,) = gr.RLDSDataSource(str(tmp_path), progress=False).shards
    good = open(shard, "rb").read()
    cases = {}
    # A record whose action has 5 values, not 7 a step: the check names the feature.
    short = example({"steps/action": feature_floats(np.ones(5))})
    cases["size"] = ([short], "'steps/action' holds 5 values, not a whole number of steps of 7")
    # Two steps of action, and nothing else: the first feature missing is named.
    alone = example({"steps/action": feature_floats(np.ones(14))})
    cases["missing"] = ([alone], "is missing from the record. Fix: leave it out with keys=")
    # A record with no step feature at all.
    cases["no_steps"] = ([example({"other": feature_ints(np.ones(2))})], "none of the step")
    # A malformed record, then one with a bad CRC: the first one's error.
    bad = example({"steps/action": _len_field(2, _len_field(1, b"12345"))})
    cases["first_error"] = ([bad, b"x" * 40], "not a whole number of floats")
    for name, (records, message) in cases.items():
        with open(shard, "wb") as f:
            f.write(good)
        offset = _append(shard, records)
        if name == "first_error":  # the second record's data CRC flipped
            with open(shard, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0xFF]))
        with pytest.raises(InvalidStoreError, match="Fix: ") as info:
            _index(tmp_path, compiled_scan)
        assert f"{shard}: the episode at byte offset {offset}" in str(info.value), name
        assert message in str(info.value), name
    # The bad CRC alone: named with its record's offset.
    with open(shard, "wb") as f:
        f.write(good)
    offset = _append(shard, [b"x" * 40])
    with open(shard, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\0")
    with pytest.raises(
        InvalidStoreError, match=f"bad CRC32C of the record data at byte offset {offset}"
    ):
        _index(tmp_path, compiled_scan)


@pytest.mark.parametrize("compiled_scan", [False, True])
def test_a_feature_of_another_kind_is_named(tmp_path: Any, compiled_scan: bool) -> None:
    write_rlds_columns(tmp_path, {"a": np.ones((6, 2), np.float32)}, [2, 4], shards=1)
    (shard,) = gr.RLDSDataSource(str(tmp_path), progress=False).shards
    flags = {f"steps/{k}": feature_ints(np.zeros(2)) for k in ("is_first", "is_last")}
    record = example(
        {
            "steps/a": feature_floats(np.ones(4)),
            **flags,
            "steps/is_terminal": feature_floats(np.ones(2)),
        }
    )
    offset = _append(shard, [record])
    with pytest.raises(InvalidStoreError) as info:
        _index(tmp_path, compiled_scan)
    assert (
        f"{shard}: the episode at byte offset {offset}: feature 'steps/is_terminal' holds 2 "
        "float values, but features.json declares 2 int64 values" in str(info.value)
    )


@pytest.mark.parametrize("compiled_scan", [False, True])
def test_malformed_record_in_a_shard_names_the_file_and_the_fix(
    tmp_path: Any, compiled_scan: bool
) -> None:
    write_rlds(tmp_path, lengths=(3, 4), shards=1)
    (shard,) = gr.RLDSDataSource(str(tmp_path), progress=False).shards
    bad = example({"steps/action": _len_field(2, _len_field(1, b"12345"))})
    with open(shard, "ab") as f:
        f.write(tfrecord([bad]))
    offset = os.path.getsize(shard) - len(tfrecord([bad]))
    with pytest.raises(InvalidStoreError) as info:
        _index(tmp_path, compiled_scan)
    message = str(info.value)
    assert shard in message and f"byte offset {offset}" in message
    assert "not a tf.train.Example (a packed FloatList is not a whole number of floats)" in message
    assert "Fix: the shard is corrupt" in message


def test_without_numba_the_python_parser_indexes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRAIN_REPLAY_NO_NUMBA", "1")
    assert example_scan.compiled.__wrapped__() is None  # type: ignore[attr-defined]
    loader = BackgroundLoad(example_scan.compiled.__wrapped__, lambda _: None, "no numba")
    assert loader.loaded(wait=True) is None  # as a process without numba has it
    monkeypatch.setattr(example_scan, "_LOADER", loader)
    assert example_scan.scanner(True) is None and example_scan.scanner(None) is None
    assert example_scan.scanner(False) is None
    write_rlds(tmp_path, lengths=(3, 2), shards=2)
    assert _index(tmp_path, True).num_steps == 5


def test_python_parser_reports_a_tag_without_its_length() -> None:
    # The value's tag is the record's last byte: a WireError, not an IndexError.
    with pytest.raises(example_lib.WireError, match="runs past the end"):
        example_lib.parse_example(_len_field(1, _len_field(1, b"\x0a\x01f\x12")))
    with pytest.raises(example_lib.WireError):
        example_lib.parse_example(b"\x0a\x02\x0a\x00"[:3])
    assert _varint(1 << 63) == b"\x80" * 9 + b"\x01"


@needs_numba
def test_array_record_shards_give_the_same_index_both_ways(tmp_path: Any) -> None:
    ar = pytest.importorskip("array_record.python.array_record_module")
    import json

    from grain_replay.datasets.rlds import tfrecord as tfrecord_lib

    write_rlds(tmp_path, lengths=(3, 5, 2), shards=2)
    for src_path in gr.RLDSDataSource(str(tmp_path), progress=False).shards:
        writer = ar.ArrayRecordWriter(
            src_path.replace(".tfrecord-", ".array_record-"), "group_size:1"
        )
        for _, rec in tfrecord_lib.iter_records(src_path):
            writer.write(rec)
        writer.close()
        os.unlink(src_path)
    info_path = os.path.join(tmp_path, "dataset_info.json")
    with open(info_path) as f:
        info = json.load(f)
    info["fileFormat"] = "array_record"
    with open(info_path, "w") as f:
        json.dump(info, f)
    src = gr.RLDSDataSource(str(tmp_path), progress=False)
    python, compiled = (
        index_lib.build_index(
            str(tmp_path), src.shards, src.features, use_cache=False, progress=False,
            fmt="array_record", compiled_scan=c,
        )
        for c in (False, True)
    )  # fmt: skip
    _assert_same(python, compiled)
    assert python.num_steps == 10
