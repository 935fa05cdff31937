"""What object storage holds of a many-writer store: what docs/replay_store.md claims.

Plain writers need a POSIX file system in every format, and many-writer ones on
object storage write npy pieces only (tests/remote/test_s3_parts.py): the rest is
refused, naming the fix, and nothing is written anywhere (not a local ``s3:``
folder). A POSIX many-writer store's rows are served from object storage read-only,
as one Zarr store copied out of it (``grain-replay convert``) and uploaded; the
writer-parts folder itself is not a store readers open over an URL. A real moto S3
server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from parts_child import check_rows, make_rows
from s3_server import S3Server, moto_unavailable_reason, serve_bucket

import grain_replay as gr
from grain_replay.cli import main as cli_main

_reason = moto_unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

BUCKET = "replay-writers"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    pytest.importorskip("zarr")
    yield from serve_bucket(BUCKET)


def _many_writer_store(path: str) -> dict[str, np.ndarray]:
    """Two writers of a bounded Zarr store on the local file system; its live rows."""
    for writer in ("actor-0", "actor-1"):
        with gr.ReplayWriter(path, "zarr", capacity=40, writer_id=writer, segment_rows=16) as w:
            for start in range(0, 60, 10):
                w.append(make_rows(writer, start, 10))
                w.flush()
    src = gr.open_source(path)
    rows = src.read_batch(np.arange(len(src)))
    src.close()
    return rows


@pytest.mark.parametrize(
    ("fmt", "writer_id"),
    [("npy", None), ("hdf5", None), ("zarr", None), ("hdf5", "actor-0"), ("zarr", "actor-0")],
)
def test_writers_refuse_object_storage_and_write_nothing(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, writer_id: str | None
) -> None:
    """Plain writers refuse URLs in every format; many-writer ones take npy pieces only
    (tests/remote/test_s3_parts.py), and refuse HDF5 and Zarr naming the one that works."""
    monkeypatch.chdir(tmp_path)
    url = f"s3://{BUCKET}/store.{ {'npy': 'npy', 'hdf5': 'h5', 'zarr': 'zarr'}[fmt] }"
    kw = {} if writer_id is None else {"writer_id": writer_id, "capacity": 100}
    fix = r"POSIX file system.*Fix:.*writer_id=.*convert" if writer_id is None else "format='npy'"
    with pytest.raises(gr.InvalidArgumentError, match=fix) as e:
        gr.ReplayWriter(url, fmt, storage_options=s3.storage_options(), **kw)  # type: ignore[arg-type]
    assert url in str(e.value)
    if writer_id is not None:
        assert repr(writer_id) in str(e.value)
    assert os.listdir(tmp_path) == []  # no local "s3:" folder
    assert s3.client().list_objects_v2(Bucket=BUCKET, Prefix="store.").get("KeyCount", 0) == 0


def test_object_storage_serves_a_many_writer_store_copied_into_one_zarr(
    s3: S3Server, tmp_path: Path
) -> None:
    path = str(tmp_path / "replay")
    live = _many_writer_store(path)
    assert len(live["seq"]) == 80  # the newest 40 of each writer
    copy = str(tmp_path / "replay-copy.zarr")
    assert cli_main(["convert", path, copy]) == 0
    url = s3.upload(copy, BUCKET, "copy/replay-copy.zarr")
    remote = gr.open_source(url, storage_options=s3.storage_options())
    assert isinstance(remote, gr.ZarrDataSource) and len(remote) == 80
    got = remote.read_batch(np.arange(80))
    check_rows(got)
    for key in live:
        np.testing.assert_array_equal(got[key], live[key])
    remote.close()


def test_a_writer_parts_folder_is_not_opened_over_an_url(s3: S3Server, tmp_path: Path) -> None:
    path = str(tmp_path / "replay.zarr")
    _many_writer_store(path)
    url = s3.upload(path, BUCKET, "parts/replay.zarr")
    with pytest.raises(gr.GrainReplayError):
        gr.open_source(url, storage_options=s3.storage_options())


@pytest.mark.parametrize("fmt", ["hdf5", "npy", "zarr"])
def test_one_shot_writers_refuse_urls_and_write_nothing_locally(tmp_path, monkeypatch, fmt):
    """gr.write("s3://...") once made a local folder named "s3:"."""
    monkeypatch.chdir(tmp_path)
    tree = {"obs": np.zeros((4, 2), np.float32)}
    with pytest.raises(gr.InvalidArgumentError, match=r"s3://bucket/run\.store.*local.*Fix"):
        gr.write("s3://bucket/run.store", tree, format=fmt)
    assert os.listdir(tmp_path) == []
