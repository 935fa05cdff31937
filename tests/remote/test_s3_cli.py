"""grain-replay info | verify | stats | convert over a many-writer store on S3, with
``--storage-option KEY=VALUE`` (docs/cli.md#stores-on-object-storage). A real moto S3
server on 127.0.0.1."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from parts_child import make_rows
from s3_server import S3Server, moto_unavailable_reason, serve_bucket

import grain_replay as gr
from grain_replay.cli import main
from grain_replay.cli.remote import storage_options
from grain_replay.store.objects import ObjectStore

_reason = moto_unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

BUCKET = "replay-cli"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from serve_bucket(BUCKET)


def _flags(s3: S3Server) -> list[str]:
    """The test server's storage options as --storage-option flags."""
    out = []
    for key, value in s3.storage_options().items():
        if isinstance(value, dict):
            out += [f"--storage-option={key}.{k}={v}" for k, v in value.items()]
        else:
            out.append(f"--storage-option={key}={value}")
    return out


@pytest.fixture(scope="module")
def url(s3: S3Server) -> str:
    """Two writers: a (capacity 30, 50 rows committed in pieces of 10) and b (unbounded, 20)."""
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"
    for wid, capacity, n in (("a", 30, 50), ("b", None, 20)):
        with gr.ReplayWriter(
            url, writer_id=wid, capacity=capacity, storage_options=s3.storage_options()
        ) as w:
            for start in range(0, n, 10):
                w.append(make_rows(wid, start, 10))
                w.flush()
    return url


def test_storage_options_parse_json_values_and_dotted_keys() -> None:
    got = storage_options(
        "s3://b/x", ["anon=true", "client_kwargs.endpoint_url=http://h:1", "retries=3", "k=v=w"]
    )
    assert got == {
        "anon": True,
        "client_kwargs": {"endpoint_url": "http://h:1"},
        "retries": 3,
        "k": "v=w",
    }
    assert storage_options("s3://b/x", []) is None


@pytest.mark.parametrize(
    ("path", "given", "match"),
    [
        ("s3://b/x", ["anon"], r"'anon' is not KEY=VALUE.*Fix"),
        ("s3://b/x", ["=1"], r"not KEY=VALUE.*Fix"),
        ("s3://b/x", ["a=1", "a.b=2"], r"a was given a value already.*Fix"),
        ("local/store", ["anon=true"], r"local/store: --storage-option.*URL.*Fix: drop"),
    ],
)
def test_bad_storage_options_are_named_with_a_fix(path: str, given: list[str], match: str) -> None:
    with pytest.raises(gr.InvalidArgumentError, match=match):
        storage_options(path, given)


def test_info_lists_the_writers_of_an_s3_store(
    s3: S3Server, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", url, "--json", *_flags(s3)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == url and info["num_records"] == 50
    assert info["store_id"] == ObjectStore(url, s3.storage_options()).read_store_file()["store_id"]
    got = {w["writer_id"]: w for w in info["writers"]}
    assert [(got[w]["live"], got[w]["evicted"], got[w]["committed"]) for w in "ab"] == [
        (30, 20, 50),
        (20, 0, 20),
    ]
    assert got["a"]["segments"] == 3 and got["a"]["size_on_disk"] > 0
    assert got["a"]["holder"] is None  # closed: the lease is released
    assert "size_on_disk" not in info
    assert main(["info", url, *_flags(s3)]) == 0
    text = capsys.readouterr().out
    assert "a: 30 live, 20 evicted, 50 committed, capacity 30, 3 pieces" in text


def test_info_names_a_live_holder(s3: S3Server, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"
    with gr.ReplayWriter(url, writer_id="a", storage_options=s3.storage_options()) as w:
        w.append(make_rows("a", 0, 5))
        w.flush()
        assert main(["info", url, "--json", *_flags(s3)]) == 0
    (writer,) = json.loads(capsys.readouterr().out)["writers"]
    assert writer["holder"]["pid"] == __import__("os").getpid()


def test_verify_reads_an_s3_store_and_names_a_damaged_piece(
    s3: S3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"
    with gr.ReplayWriter(url, writer_id="a", storage_options=s3.storage_options()) as w:
        for start in (0, 10):
            w.append(make_rows("a", start, 10))
            w.flush()
    assert main(["verify", url, *_flags(s3)]) == 0
    assert "OK" in capsys.readouterr().out
    objects = ObjectStore(url, s3.storage_options())
    newest = objects.newest_manifest("a")
    assert newest is not None
    key = objects.piece_key("a", newest.pieces[1])
    objects.put(key, objects.get(key)[:-8])  # a piece cut short
    assert main(["verify", url, *_flags(s3)]) == 1
    err = capsys.readouterr().err
    assert f"CORRUPT {url}: writer 'a': piece {newest.pieces[1].name}" in err
    assert "need 480" in err
    objects.remove([key])
    assert main(["verify", url, *_flags(s3)]) == 1
    assert "is gone" in capsys.readouterr().err


def test_stats_and_convert_read_an_s3_store(
    s3: S3Server, url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", url, "--json", "--quiet", *_flags(s3)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["num_records"] == 50 and stats["leaves"]["seq"]["count"] == 50
    dst = str(tmp_path / "copy.zarr")
    pytest.importorskip("zarr")
    assert main(["convert", url, dst, "--quiet", *_flags(s3)]) == 0
    src = gr.open_source(url, storage_options=s3.storage_options())
    copy = gr.open_source(dst)
    want, got = (s.read_batch(np.arange(50)) for s in (src, copy))
    for k in ("seq", "tag", "vec"):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def test_the_cli_names_what_is_missing_for_an_url(
    s3: S3Server, url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A local path takes no --storage-option, a bad one is named; the
    destination of convert is written on the file system only."""
    cases: list[tuple[list[str], str]] = [
        (["info", str(tmp_path), "--storage-option", "anon=true"], "Fix: drop --storage-option"),
        (["verify", url, "--storage-option", "anon"], "not KEY=VALUE"),
        (["convert", url, f"s3://{BUCKET}/copy.zarr", *_flags(s3)], "file system only"),
    ]
    for argv, want in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("grain-replay: error: ") and want in err, err
    assert not s3.client().list_objects_v2(Bucket=BUCKET, Prefix="copy.zarr").get("KeyCount")
