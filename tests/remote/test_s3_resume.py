"""Restarting writers on S3 from a replay checkpoint: ``resume_from=`` and
``gr.truncate_to_watermark`` (docs/replay_store.md#on-object-storage). A real moto S3
server on 127.0.0.1."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from parts_child import check_rows, make_rows, tag_of
from s3_server import S3Server, moto_unavailable_reason, serve_bucket

import grain_replay as gr
from grain_replay.store.objects import ObjectStore

_reason = moto_unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

BUCKET = "replay-resume"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from serve_bucket(BUCKET)


def _url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"


def _writer(s3: S3Server, url: str, writer_id: str, **kw: Any) -> gr.ReplayWriter:
    kw.setdefault("capacity", 30)
    return gr.ReplayWriter(url, writer_id=writer_id, storage_options=s3.storage_options(), **kw)


def _fill(w: gr.ReplayWriter, writer_id: str, start: int, stop: int, run: int = 0) -> None:
    for at in range(start, stop, 10):
        w.append(make_rows(writer_id, at, min(10, stop - at), run))
        w.flush()


def _rows(s3: S3Server, url: str, writer_id: str) -> dict[str, np.ndarray]:
    """The live rows of ``writer_id``, oldest first, checked whole."""
    src = gr.open_source(url, storage_options=s3.storage_options(), keys=["seq", "tag", "vec"])
    try:
        got = src.read_batch(np.arange(len(src)))
    finally:
        src.close()
    check_rows(got)
    mine = (np.asarray(got["tag"]) & 0xFFFF) == tag_of(writer_id)
    return {k: np.asarray(v)[mine] for k, v in got.items()}


def _mark(s3: S3Server, url: str) -> gr.Watermark:
    """The watermark of a replay loader's checkpoint over the store now."""
    src = gr.open_source(url, storage_options=s3.storage_options())
    it = iter(gr.make_data_loader(src, batch_size=4, sampling=gr.UniformReplay(), seed=0))
    next(it)
    state = it.get_state()
    it.close()
    src.close()
    return gr.read_watermark(state)


def test_resume_from_a_checkpoint_drops_later_rows_and_restores_evicted_ones(
    s3: S3Server,
) -> None:
    """Rows evicted since the checkpoint come back from the pieces older versions name
    (within evict_grace_s); appends continue after the watermark."""
    url = _url()
    with _writer(s3, url, "a") as w:
        _fill(w, "a", 0, 30)
    mark = _mark(s3, url)
    assert mark.writers == {"a": 30}
    with _writer(s3, url, "a") as w:
        _fill(w, "a", 30, 75)  # evicts every row the checkpoint covers
    np.testing.assert_array_equal(_rows(s3, url, "a")["seq"], np.arange(45, 75))
    with _writer(s3, url, "a", resume_from=mark) as w:
        assert (w.committed, w.live) == (30, 30)
        w.append(make_rows("a", 30, 5, run=1))
        assert w.flush() == 35
    got = _rows(s3, url, "a")
    np.testing.assert_array_equal(got["seq"], np.arange(5, 35))
    np.testing.assert_array_equal(got["tag"] >> 16, [0] * 25 + [1] * 5)  # run 1 after the cut


@pytest.mark.parametrize("capacity", [None, 8])
def test_a_cut_inside_a_piece_copies_the_rows_kept_into_a_new_piece(
    s3: S3Server, capacity: int | None
) -> None:
    url = _url()
    with _writer(s3, url, "a", capacity=capacity) as w:
        w.append(make_rows("a", 0, 20))
        w.flush()
    with _writer(s3, url, "a", capacity=capacity, resume_from=13) as w:
        assert w.committed == 13
    got = _rows(s3, url, "a")  # check_rows: every leaf of the copy read at its offset
    np.testing.assert_array_equal(got["seq"], np.arange(5 if capacity else 0, 13))
    with _writer(s3, url, "a", capacity=capacity, resume_from=13) as w:
        assert w.committed == 13  # a resume at the committed count changes nothing
        _fill(w, "a", 13, 20, run=2)
    np.testing.assert_array_equal(_rows(s3, url, "a")["seq"][-7:], np.arange(13, 20))


def _delete_evicted_pieces(s3: S3Server, url: str, writer_id: str) -> None:
    """What the writers' collection does evict_grace_s after an eviction."""
    objects = ObjectStore(url, s3.storage_options())
    newest = objects.newest_manifest(writer_id)
    assert newest is not None
    named = {p.name for p in newest.pieces}
    objects.remove(
        [k for k, _ in objects.list_pieces(writer_id) if k.rsplit("/", 1)[-1] not in named]
    )


def test_bad_resumes_on_s3_are_refused_naming_the_fix_and_change_nothing(s3: S3Server) -> None:
    url = _url()
    with _writer(s3, url, "a") as w:
        _fill(w, "a", 0, 20)
    mark = _mark(s3, url)
    with _writer(s3, url, "a") as w:
        _fill(w, "a", 20, 60)
    other = _url()
    with _writer(s3, other, "a") as w:
        _fill(w, "a", 0, 10)
    cases: list[tuple[str, Any, type[Exception], str]] = [
        (other, mark, gr.InvalidArgumentError, r"another store.*Fix"),
        (url, gr.Watermark(url, rows=5), gr.InvalidArgumentError, r"plain store.*Fix"),
        (url, "20", gr.InvalidArgumentError, r"resume_from must be.*Fix"),
        (url, -1, gr.InvalidArgumentError, r">= 0 rows.*Fix"),
        (url, 61, gr.InvalidStoreError, r"covers 61 rows.*holds 60.*Fix"),
    ]
    for where, bad, error, match in cases:
        with pytest.raises(error, match=match) as e:
            _writer(s3, where, "a", resume_from=bad)
        assert where in str(e.value)
    _delete_evicted_pieces(s3, url, "a")  # the grace period passed
    with pytest.raises(gr.InvalidStoreError, match=r"row 0 is in no piece.*Fix") as e:
        _writer(s3, url, "a", resume_from=mark)
    assert "'a'" in str(e.value)
    np.testing.assert_array_equal(_rows(s3, url, "a")["seq"], np.arange(30, 60))  # unchanged
    nowhere = _url()
    with pytest.raises(gr.InvalidStoreError, match=r"no store at this URL.*Fix"):
        _writer(s3, nowhere, "a", resume_from=5)
    assert (
        not s3.client()
        .list_objects_v2(Bucket=BUCKET, Prefix=nowhere.split("/", 3)[3])
        .get("KeyCount")
    )


def test_truncate_to_watermark_cuts_every_writer_of_an_s3_store(s3: S3Server) -> None:
    url = _url()
    so = s3.storage_options()
    for wid, n in (("a", 20), ("b", 10)):
        with _writer(s3, url, wid) as w:
            _fill(w, wid, 0, n)
    mark = _mark(s3, url)
    assert mark.writers == {"a": 20, "b": 10}
    for wid in ("a", "b", "c"):  # c started after the checkpoint
        with _writer(s3, url, wid) as w:
            _fill(w, wid, 20 if wid == "a" else 10 if wid == "b" else 0, 50)
    assert gr.truncate_to_watermark(url, mark, storage_options=so) == {"a": 20, "b": 10, "c": 0}
    for wid, n in (("a", 20), ("b", 10), ("c", 0)):
        np.testing.assert_array_equal(_rows(s3, url, wid)["seq"], np.arange(n))


def test_truncate_on_s3_refuses_a_live_writer_or_a_lost_row_and_cuts_nothing(
    s3: S3Server,
) -> None:
    url = _url()
    so = s3.storage_options()
    for wid in ("a", "b"):
        with _writer(s3, url, wid) as w:
            _fill(w, wid, 0, 20)
    mark = _mark(s3, url)
    for wid in ("a", "b"):
        with _writer(s3, url, wid) as w:
            _fill(w, wid, 20, 60)
    live = _writer(s3, url, "b")
    try:
        with pytest.raises(gr.WriterBusyError, match=r"writer 'b'.*live writer.*Fix: stop"):
            gr.truncate_to_watermark(url, mark, storage_options=so)
    finally:
        live.close()
    _delete_evicted_pieces(s3, url, "b")
    with pytest.raises(gr.InvalidStoreError, match=r"writer 'b'.*no piece.*Fix"):
        gr.truncate_to_watermark(url, mark, storage_options=so)
    np.testing.assert_array_equal(_rows(s3, url, "a")["seq"], np.arange(30, 60))  # a not cut
    with pytest.raises(gr.StoreNotFoundError, match=r"no many-writer store.*Fix"):
        gr.truncate_to_watermark(_url(), mark, storage_options=so)
    with pytest.raises(gr.InvalidArgumentError, match=r"storage_options.*Fix: drop"):
        gr.truncate_to_watermark("local-dir", mark, storage_options=so)
