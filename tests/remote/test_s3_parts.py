"""Many writers of one bounded store on S3 (docs/replay_store.md#on-object-storage).

A real moto S3 server on 127.0.0.1 (module-scoped). Conditional creates, commits of
two writers read as one union, eviction and the grace period, the lease (a second live
writer refused, a SIGKILLed or paused writer's id taken over, the paused one fenced),
replay over the bucket and the bad inputs.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from parts_child import check_rows, make_rows
from s3_server import HTTPProxy, S3Server, moto_unavailable_reason, serve_bucket

import grain_replay as gr
from grain_replay.store.object_manifest import ObjectManifest
from grain_replay.store.objects import ObjectStore

_reason = moto_unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

BUCKET = "replay-parts"
CHILD = os.path.join(os.path.dirname(__file__), "..", "helpers", "s3_parts_child.py")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from serve_bucket(BUCKET)


def _url() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"


def _writer(s3: S3Server, url: str, writer_id: str, **kw: Any) -> gr.ReplayWriter:
    kw.setdefault("capacity", 1000)
    return gr.ReplayWriter(url, writer_id=writer_id, storage_options=s3.storage_options(), **kw)


def _keys(s3: S3Server, prefix: str) -> list[str]:
    found = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in found.get("Contents", []))


def _wait(condition: Any, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.02)


def test_moto_honours_a_conditional_create(s3: S3Server) -> None:
    """What the protocol rests on: s3fs's "xb" (If-None-Match: *) fails on a second create."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3.storage_options())
    key = f"{BUCKET}/xb-{uuid.uuid4().hex}"
    with fs.open(key, "xb") as f:
        f.write(b"first")
    with pytest.raises(FileExistsError), fs.open(key, "xb") as f:
        f.write(b"second")
    with pytest.raises(FileExistsError):
        fs.pipe_file(key, b"third", mode="create")
    assert fs.cat_file(key) == b"first"


def test_a_tree_unlike_another_writers_is_refused_naming_both(s3: S3Server) -> None:
    url = _url()
    with _writer(s3, url, "a", capacity=10) as w:
        w.append(make_rows("a", 0, 3))
        w.flush()
    with _writer(s3, url, "b", capacity=10) as w:
        with pytest.raises(gr.InvalidTreeError, match=r"writer 'b'.*writer 'a'.*another store URL"):
            w.append({"seq": np.arange(3)})
        w.append(make_rows("b", 0, 2))
    assert len(gr.open_source(url, storage_options=s3.storage_options())) == 5


def test_two_writers_commit_and_a_reader_sees_the_union(s3: S3Server) -> None:
    url = _url()
    ws = [_writer(s3, url, f"actor-{i}", capacity=50) for i in range(2)]
    for start in range(0, 70, 10):
        for i, w in enumerate(ws):
            w.append(make_rows(f"actor-{i}", start, 10))
            assert w.flush() == start + 10
    assert [w.live for w in ws] == [50, 50]
    src = gr.open_source(url, storage_options=s3.storage_options(), keys=None)
    assert isinstance(src, gr.ObjectPartsDataSource) and len(src) == 100
    got = src.read_batch(np.arange(100))
    check_rows(got)
    np.testing.assert_array_equal(got["seq"], np.tile(np.arange(20, 70), 2))
    assert src.writer_ordinals == {"actor-0": 0, "actor-1": 1}
    ids = src.ids([0, 99])
    np.testing.assert_array_equal(src.read_ids(ids)["seq"], [20, 69])
    np.testing.assert_array_equal(src.positions(ids), [0, 99])
    # a commit after the snapshot is seen at refresh(); the snapshot reads as it was
    ws[0].append(make_rows("actor-0", 70, 5))
    ws[0].flush()
    assert len(src) == 100 and src.refresh() == 100  # capacity: 5 in, 5 out
    assert src.read_batch([49])["seq"][0] == 74
    for w in ws:
        w.close()
    with_writer = gr.open_source(url, storage_options=s3.storage_options(), keys=["seq", "_writer"])
    np.testing.assert_array_equal(with_writer.read_batch([0, 99])["_writer"], [0, 1])
    again = pickle.loads(pickle.dumps(with_writer))
    assert repr(again) == repr(with_writer)
    np.testing.assert_array_equal(again.read_batch(np.arange(100))["seq"], got_seq_after(url, s3))


def got_seq_after(url: str, s3: S3Server) -> np.ndarray:
    src = gr.open_source(url, storage_options=s3.storage_options(), keys=["seq"])
    return np.asarray(src.read_batch(np.arange(len(src)))["seq"])


def test_a_reader_one_refresh_behind_reads_evicted_rows_within_the_grace(s3: S3Server) -> None:
    url = _url()
    w = _writer(s3, url, "a", capacity=20, evict_grace_s=3600)
    for start in range(0, 40, 10):
        w.append(make_rows("a", start, 10))
        w.flush()
    src = gr.open_source(url, storage_options=s3.storage_options())
    ids = src.ids(np.arange(20))
    for start in range(40, 100, 10):  # evicts every row of the reader's snapshot
        w.append(make_rows("a", start, 10))
        w.flush()
    old = src.read_batch(np.arange(20))
    check_rows(old)
    np.testing.assert_array_equal(old["seq"], np.arange(20, 40))
    src.refresh()  # the previous snapshot's rows stay readable by id
    np.testing.assert_array_equal(src.read_ids(ids)["seq"], np.arange(20, 40))
    w.close()


def test_evicted_pieces_are_deleted_after_the_grace_period(s3: S3Server) -> None:
    url = _url()
    prefix = url.split("/", 3)[3] + "/writers/a/pieces/"
    w = _writer(s3, url, "a", capacity=20, evict_grace_s=0)
    w.append(make_rows("a", 0, 10))
    w.flush()
    first = _keys(s3, prefix)
    assert len(first) == 1
    src = gr.open_source(url, storage_options=s3.storage_options())
    n = 10

    def flushed_past_it() -> bool:
        nonlocal n
        w.append(make_rows("a", n, 10))
        n += 10
        w.flush()
        return first[0] not in _keys(s3, prefix)

    _wait(flushed_past_it, "the evicted first piece to be deleted")
    left = _keys(s3, prefix)
    assert len(left) <= 2 + 40  # the live pieces and those evicted within ~1 s
    with pytest.raises(gr.EvictedRowError, match=r"evict_grace_s.*Fix"):
        src.read_batch([0])
    got, ok = src.read_ids_checked(src.ids([0, 1]))
    assert not ok.any() and src.replaced == 2
    check_rows(got)  # stand-ins: live rows of the same writer, whole
    assert (got["seq"] >= n - 20).all()
    w.close()


def _spawn(s3: S3Server, url: str, writer_id: str, mode: str, lease_s: float = 1.0, **env: str):
    return subprocess.Popen(
        [sys.executable, CHILD, s3.endpoint_url, url, writer_id, "1000", str(lease_s), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **env},
    )


def _line(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    assert line, f"the child exited ({proc.wait()})"
    return line


def _tell(proc: subprocess.Popen[bytes], text: str) -> str:
    assert proc.stdin is not None
    proc.stdin.write((text + "\n").encode())
    proc.stdin.flush()
    return _line(proc)


def test_a_sigkilled_writers_id_is_refused_while_live_then_taken_over(s3: S3Server) -> None:
    url = _url()
    child = _spawn(s3, url, "actor-3", "stdin", lease_s=3.0)  # refused while renewed
    try:
        assert _line(child).startswith("open 0 ")
        assert _tell(child, "flush 12") == "committed 12"
        with pytest.raises(gr.WriterBusyError, match=rf"host '.+', pid {child.pid}.*Fix"):
            _writer(s3, url, "actor-3", lease_s=1)  # within 3 s + 1 s of a renewal
        child.send_signal(signal.SIGKILL)
        child.wait()
        taker: list[gr.ReplayWriter] = []

        def taken() -> bool:
            try:
                taker.append(_writer(s3, url, "actor-3", lease_s=1))
            except gr.WriterBusyError:
                return False
            return True

        _wait(taken, "the dead writer's lease to run out")
        w = taker[0]
        assert w.committed == 12  # it continues after the dead writer's commits
        w.append(make_rows("actor-3", 12, 3))
        w.flush()
        w.close()
        src = gr.open_source(url, storage_options=s3.storage_options())
        got = src.read_batch(np.arange(len(src)))
        check_rows(got)
        np.testing.assert_array_equal(got["seq"], np.arange(15))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_paused_writer_is_fenced_after_a_takeover_and_loses_nothing_committed(
    s3: S3Server,
) -> None:
    url = _url()
    zombie = _spawn(s3, url, "w", "stdin")
    try:
        assert _line(zombie).startswith("open 0")
        assert _tell(zombie, "flush 5") == "committed 5"
        zombie.send_signal(signal.SIGSTOP)  # paused past its lease: the id is free
        taker: list[gr.ReplayWriter] = []

        def taken() -> bool:
            try:
                taker.append(_writer(s3, url, "w", lease_s=1))
            except gr.WriterBusyError:
                return False
            return True

        _wait(taken, "the paused writer's lease to run out")
        w = taker[0]
        w.append(make_rows("w", 5, 4))
        assert w.flush() == 9
        zombie.send_signal(signal.SIGCONT)
        answer = _tell(zombie, "flush 7")
        assert answer.startswith("fenced ") and "took this writer's id over" in answer, answer
        assert f"pid {os.getpid()}" in answer
        w.append(make_rows("w", 9, 1))
        assert w.flush() == 10
        w.close()
        got = got_seq_after(url, s3)
        np.testing.assert_array_equal(got, np.arange(10))
    finally:
        if zombie.poll() is None:
            zombie.send_signal(signal.SIGCONT)
            zombie.kill()
            zombie.wait()


def test_a_race_for_one_manifest_version_has_one_winner(s3: S3Server) -> None:
    """Two writers (threads, each its own connection) create the same version at once:
    one commits, the other learns it lost; the winner's commit is the one read."""
    url = _url()
    for attempt in range(5):
        stores = [ObjectStore(url, s3.storage_options()) for _ in range(2)]
        made = [ObjectManifest("w", 0, None, 10 * (k + 1), (), attempt, k, None) for k in range(2)]
        won = _race([functools.partial(st.publish, m) for st, m in zip(stores, made, strict=True)])
        assert sorted(won) == [False, True], won
        winner = made[won.index(True)]
        assert stores[0].newest_manifest("w") == winner


def test_the_test_server_creates_conditionally_as_atomically_as_s3(s3: S3Server) -> None:
    """moto checks a key's absence and writes it with nothing between (its server a thread a
    request): racing creates could both win, which S3 never allows (tests/helpers/
    moto_atomic.py). The servers here take them one at a time: one winner a key."""
    import boto3
    import botocore.exceptions
    from moto.s3.responses import S3Response

    assert getattr(S3Response, "_atomic_conditional_creates", False)  # this process's server
    opts = s3.storage_options()
    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"],
        region_name="us-east-1",
    )
    bucket = f"atomic-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)

    def create(key: str) -> bool:
        try:
            client.put_object(Bucket=bucket, Key=key, Body=b"x" * 4096, IfNoneMatch="*")
            return True
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] != "PreconditionFailed":
                raise
            return False

    for i in range(20):
        won = _race([functools.partial(create, f"k{i}") for _ in range(6)])
        assert sum(won) == 1, won


def _race(calls: list[Any]) -> list[Any]:
    """The results of ``calls``, each run by its own thread, released at once."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(k: int) -> None:
        barrier.wait()
        results[k] = calls[k]()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_uniform_and_prioritized_replay_over_s3(s3: S3Server) -> None:
    url = _url()
    ws = [_writer(s3, url, f"actor-{i}", capacity=40) for i in range(2)]
    for start in range(0, 60, 20):
        for i, w in enumerate(ws):
            w.append(make_rows(f"actor-{i}", start, 20))
            w.flush()
    src = gr.open_source(url, storage_options=s3.storage_options())
    loader = gr.make_data_loader(src, batch_size=16, sampling=gr.UniformReplay(), seed=3)
    it = iter(loader)
    for _ in range(3):
        batch = next(it)
        check_rows(batch)
        assert (np.asarray(batch["seq"]) >= 20).all()
    loader = gr.make_data_loader(src, batch_size=16, sampling=gr.PrioritizedReplay(), seed=3)
    it = iter(loader)
    sampled = next(it)
    check_rows(sampled.data)
    ids = np.asarray(sampled.index)
    np.testing.assert_array_equal(src.read_ids(ids)["seq"], sampled.data["seq"])
    it.update_priorities(sampled.index, np.full(16, 5.0))
    check_rows(next(it).data)
    for w in ws:
        w.close()


def test_bad_inputs_on_object_storage_are_named_with_a_fix(s3: S3Server) -> None:
    url = _url()
    so = s3.storage_options()
    for bad in (0, -1.0, float("nan"), "30"):
        with pytest.raises(gr.InvalidArgumentError, match=r"lease_s must be.*Fix"):
            gr.ReplayWriter(url, writer_id="a", storage_options=so, lease_s=bad)
    with pytest.raises(gr.InvalidArgumentError, match=r"evict_grace_s must be.*Fix"):
        gr.ReplayWriter(url, writer_id="a", storage_options=so, evict_grace_s=-1)
    for fmt in ("hdf5", "zarr"):
        with pytest.raises(gr.InvalidArgumentError, match=r"format='npy'"):
            gr.ReplayWriter(url, fmt, writer_id="a", storage_options=so)
    with pytest.raises(gr.InvalidArgumentError, match=r"format='npy'"):
        gr.ReplayWriter(url + ".h5", writer_id="a", storage_options=so)
    with pytest.raises(gr.StoreNotFoundError, match=r"bucket 'no-such-bucket'.*Fix"):
        gr.ReplayWriter("s3://no-such-bucket/x", writer_id="a", storage_options=so)
    with pytest.raises(gr.InvalidArgumentError, match=r"gcsfs.*Fix: write to s3://"):
        gr.ReplayWriter("gs://bucket/x", writer_id="a")
    with pytest.raises(gr.InvalidArgumentError, match=r"segment_rows=.*Fix: drop segment_rows="):
        gr.ReplayWriter(url, writer_id="a", storage_options=so, segment_rows=10)
    with pytest.raises(gr.InvalidArgumentError, match=r"lease_s.*s3:// URL\) only.*Fix"):
        gr.ReplayWriter("local-dir", writer_id="a", lease_s=5)
    assert _keys(s3, url.split("/", 3)[3]) == []  # nothing written by a refused writer
    w = _writer(s3, url, "a", capacity=10)
    w.close()
    with pytest.raises(gr.InvalidArgumentError, match=r"capacity=10.*Fix: pass capacity=10"):
        _writer(s3, url, "a", capacity=20)


def _proxied(s3: S3Server, proxy: HTTPProxy) -> dict[str, Any]:
    opts = s3.storage_options()
    opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=proxy.endpoint_url)
    return opts


def _gets(proxy: HTTPProxy, read: Any) -> tuple[Any, dict[str, int]]:
    proxy.reset_counts()
    got = read()
    return got, dict(proxy.counts)


def _one_writer_of_three_pieces(s3: S3Server) -> str:
    url = _url()
    w = _writer(s3, url, "a")
    for start in range(0, 30, 10):
        w.append(make_rows("a", start, 10))
        w.flush()
    w.close()
    return url


# A piece held in the cache: its 10 rows of the leaves read (seq, tag, vec[4]: 48 B a row),
# each with its three int32 entries of the row index (PieceArena.row_cost).
ROW_INDEX_BYTES = 3 * 4


def _held(rows: int = 10, row_bytes: int = 8 + 8 + 4 * 8) -> int:
    return rows * (row_bytes + ROW_INDEX_BYTES)


PIECE_BYTES = _held()


def test_a_batch_is_one_ranged_get_per_leaf_per_run_of_a_piece(s3: S3Server) -> None:
    """cache_bytes=0, counted at the wire (a proxy before moto): rows 0-2 and 15-16 lie in
    two pieces of three leaves (seq, tag, vec): six GETs, adjacent rows in one range, no
    listing; the same rows again: six GETs again (nothing held)."""
    url = _one_writer_of_three_pieces(s3)
    with HTTPProxy(s3.port) as proxy:
        src = gr.open_source(url, storage_options=_proxied(s3, proxy), cache_bytes=0)
        for _ in range(2):
            got, counts = _gets(proxy, lambda: src.read_batch([16, 0, 1, 2, 15]))
            assert counts == {"GET": 6}
            check_rows(got)
            np.testing.assert_array_equal(got["seq"], [16, 0, 1, 2, 15])
        assert _gets(proxy, lambda: src.read_batch([25]))[1] == {"GET": 3}
        assert src.cached_bytes == 0


def test_a_warm_reader_reads_cached_pieces_from_memory(s3: S3Server) -> None:
    """Whole pieces, one GET each, then no GET at all: the values equal ranged reads (three
    writers, a keys subset with "_writer", by position and by id)."""
    url = _url()
    ws = [_writer(s3, url, f"actor-{i}", capacity=40) for i in range(3)]
    for start in range(0, 50, 10):
        for i, w in enumerate(ws):
            w.append(make_rows(f"actor-{i}", start, 10))
            w.flush()
    for w in ws:
        w.close()
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 120, size=64)
    with HTTPProxy(s3.port) as proxy:
        opts = _proxied(s3, proxy)
        for keys in (None, ["vec", "_writer"], ["seq", "tag", "vec"]):
            ranged = gr.open_source(url, storage_options=opts, keys=keys, cache_bytes=0)
            want = ranged.read_batch(idx)
            src = gr.open_source(url, storage_options=opts, keys=keys)
            pieces = len({(int(s // 10)) for s in idx})  # 10-row pieces, one part each 40
            got, counts = _gets(proxy, lambda src=src: src.read_batch(idx))
            assert counts == {"GET": pieces}, keys
            read = 4 * 8 if keys == ["vec", "_writer"] else 8 + 8 + 4 * 8  # only those held
            assert src.cached_bytes == pieces * _held(row_bytes=read)
            assert set(got) == set(want)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=k)
            again, counts = _gets(proxy, lambda src=src: src.read_batch(idx))
            assert counts == {}
            for k in want:
                np.testing.assert_array_equal(again[k], want[k], err_msg=k)
            by_id, counts = _gets(proxy, lambda src=src: src.read_ids(src.ids(idx[:8])))
            assert counts == {}
            for k in want:
                np.testing.assert_array_equal(by_id[k], want[k][:8], err_msg=k)
        check_rows(src.read_batch(np.arange(120)))


def test_the_piece_cache_drops_the_least_recently_used_beyond_its_bound(s3: S3Server) -> None:
    """Room for two pieces of three: the one read longest ago is fetched again; a piece
    larger than the cache is read with ranged GETs and never held."""
    url = _one_writer_of_three_pieces(s3)
    bound = 2 * PIECE_BYTES
    with HTTPProxy(s3.port) as proxy:
        src = gr.open_source(url, storage_options=_proxied(s3, proxy), cache_bytes=bound)

        def read(rows: list[int], gets: int) -> None:
            got, counts = _gets(proxy, lambda: src.read_batch(rows))
            assert counts == ({"GET": gets} if gets else {}), rows
            np.testing.assert_array_equal(got["seq"], rows)
            check_rows(got)
            assert src.cached_bytes <= bound

        read([1, 12], 2)  # pieces 0, 1
        read([3], 0)  # 0 is now the newest
        read([25], 1)  # piece 2 in, piece 1 out
        read([4, 29], 0)
        read([11], 1)  # piece 1 in, piece 0 out
        read([28, 19], 0)
        read([0], 1)
        assert src.cached_bytes == 2 * PIECE_BYTES
        small = gr.open_source(
            url, storage_options=_proxied(s3, proxy), cache_bytes=PIECE_BYTES - 1
        )
        for _ in range(2):
            got, counts = _gets(proxy, lambda: small.read_batch([16, 0, 1, 2, 15]))
            assert counts == {"GET": 6}
            np.testing.assert_array_equal(got["seq"], [16, 0, 1, 2, 15])
        assert small.cached_bytes == 0


def test_a_pickled_reader_starts_with_an_empty_piece_cache(s3: S3Server) -> None:
    url = _one_writer_of_three_pieces(s3)
    with HTTPProxy(s3.port) as proxy:
        src = gr.open_source(url, storage_options=_proxied(s3, proxy))
        src.read_batch([0, 15])
        assert src.cached_bytes == 2 * PIECE_BYTES
        copy = pickle.loads(pickle.dumps(src))
        assert copy.cached_bytes == 0
        got, counts = _gets(proxy, lambda: copy.read_batch([0, 15]))
        assert counts == {"GET": 2}
        np.testing.assert_array_equal(got["seq"], [0, 15])
        assert _gets(proxy, lambda: src.read_batch([0, 15]))[1] == {}


def test_threads_of_one_reader_share_its_piece_cache(s3: S3Server) -> None:
    url = _one_writer_of_three_pieces(s3)
    src = gr.open_source(url, storage_options=s3.storage_options(), cache_bytes=1000)
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                rows = rng.integers(0, 30, size=8)
                got = src.read_batch(rows)
                np.testing.assert_array_equal(got["seq"], rows)
                check_rows(got)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert 0 < src.cached_bytes <= 1000


def test_a_deleted_piece_is_evicted_and_a_refresh_drops_unnamed_pieces(s3: S3Server) -> None:
    url = _url()
    w = _writer(s3, url, "a", capacity=20, evict_grace_s=3600)
    for start in range(0, 20, 10):
        w.append(make_rows("a", start, 10))
        w.flush()
    src = gr.open_source(url, storage_options=s3.storage_options())
    src.read_batch([0])  # the first piece cached; the second deleted behind the reader
    second = src.segments()[1][3]
    s3.client().delete_object(Bucket=BUCKET, Key=second.removeprefix("s3://").split("/", 1)[1])
    np.testing.assert_array_equal(src.read_batch([5])["seq"], [5])
    with pytest.raises(gr.EvictedRowError, match=r"evict_grace_s.*Fix"):
        src.read_batch([5, 15])
    assert src.cached_bytes == PIECE_BYTES
    for start in range(20, 60, 10):  # two snapshots on, neither piece is named
        w.append(make_rows("a", start, 10))
        w.flush()
        if start in (30, 50):
            src.refresh()
    w.close()
    assert src.cached_bytes == 0
    np.testing.assert_array_equal(src.read_batch([0, 19])["seq"], [40, 59])


@pytest.mark.parametrize(
    ("bad", "error"),
    [(-1, gr.InvalidArgumentError), ("256MB", gr.ArgumentTypeError), (1.5, gr.ArgumentTypeError),
     (True, gr.ArgumentTypeError)],
)  # fmt: skip
def test_a_bad_cache_bytes_is_named_with_a_fix(s3: S3Server, bad: Any, error: type) -> None:
    url = _one_writer_of_three_pieces(s3)
    with pytest.raises(error, match=rf"cache_bytes.*{re.escape(repr(bad))}.*Fix: "):
        gr.open_source(url, storage_options=s3.storage_options(), cache_bytes=bad)


def test_a_rate_limit_holds_writers_and_learners_over_s3(s3: S3Server) -> None:
    """The limit declared in the bucket holds the writer before any learner; the learner
    publishes its progress into the bucket, and each side goes on as the other does."""
    url = _url()
    terms = {"min_size": 20, "samples_per_insert": 1.0, "tolerance": 16}
    w = _writer(s3, url, "a", rate_limit=gr.RateLimit(**terms), rate_limit_timeout=0.3)
    w.append(make_rows("a", 0, 30))
    assert w.flush() == 30  # 1.0 * (30 - 20) - 0 <= 16
    w.append(make_rows("a", 30, 10))
    with pytest.raises(gr.RateLimitTimeoutError, match=r"limit\.json.*no learner yet"):
        w.flush()  # 1.0 * (40 - 20) - 0 > 16: held by the declaration alone
    src = gr.open_source(url, storage_options=s3.storage_options())
    learner = gr.UniformReplay(rate_limit=gr.RateLimit(**terms, timeout=0.3))
    it = iter(gr.make_data_loader(src, batch_size=8, sampling=learner, seed=0))
    for _ in range(3):  # the ceiling: 1.0 * (30 - 20) + 16 = 26 rows
        check_rows(next(it))
    with pytest.raises(gr.RateLimitTimeoutError, match=r"handed out 24 rows"):
        next(it)
    prefix = url.split("/", 3)[3] + "/learners/"
    assert _keys(s3, prefix) == [prefix + "limit.json", prefix + "process-0-of-1.json"]

    def committed() -> bool:  # once the learner's 24 rows are published: -4 <= 16
        try:
            return w.flush() == 40
        except gr.RateLimitTimeoutError:
            return False

    _wait(committed, "the writer to commit after the learner sampled")
    check_rows(next(it))  # 1.0 * (40 - 20) + 16 = 36 >= 32
    it.close()
    w.close()
    with pytest.raises(gr.InvalidSamplingError, match=r"contradicts.*Fix"):
        _writer(s3, url, "b", rate_limit=gr.RateLimit(min_size=5, samples_per_insert=2.0))


def test_views_over_s3_start_at_the_oldest_live_row_and_never_cross_writers(
    s3: S3Server,
) -> None:
    """As tests/rl/test_bounded_views.py over a local store."""

    def steps(writer: int, start: int, n: int) -> dict[str, np.ndarray]:
        seq = np.arange(start, start + n, dtype=np.int64)
        return {"seq": seq, "writer": np.full(n, writer, np.int64), "done": seq % 10 == 9}

    url = _url()
    ws = [_writer(s3, url, f"w{i}", capacity=45) for i in range(2)]
    for i, w in enumerate(ws):
        for start in range(0, 104, 26):
            w.append(steps(i, start, 26))  # live: 59..103; the episode 50..59 lost its head
            w.flush()
    src = gr.open_source(url, storage_options=s3.storage_options())
    index = gr.build_episode_index(src)
    starts, lengths = np.asarray(index.starts), np.asarray(index.lengths)
    batch = src.read_batch(np.arange(len(src)))
    for s, n in zip(starts, lengths, strict=True):
        assert len(np.unique(batch["writer"][s : s + n])) == 1  # one writer per episode
        np.testing.assert_array_equal(batch["seq"][s : s + n], np.arange(n) + batch["seq"][s])
    assert (
        sorted(batch["seq"][starts].tolist())
        == [59, 59, 60, 60, 70, 70, 80, 80, 90, 90] + [100] * 2
    )
    view = gr.SequenceDataSource(src, {"seq": [-3, 0, 2], "writer": [-3, 0, 2]}, pad="edge")
    got = view.read_batch(np.arange(len(view)))
    assert (got["writer"] == got["writer"][:, :1]).all()  # no window crosses writers
    assert got["seq"].min() >= 59  # no window reaches an evicted row
    for w in ws:
        w.close()


@pytest.mark.slow  # spawned workers start slowly; a pickled source is read in the union test
def test_loader_workers_read_the_bucket_in_their_own_processes(s3: S3Server) -> None:
    url = _url()
    w = _writer(s3, url, "a", capacity=100)
    w.append(make_rows("a", 0, 64))
    w.close()
    src = gr.open_source(url, storage_options=s3.storage_options())
    loader = gr.make_data_loader(
        src, batch_size=8, sampling=gr.UniformReplay(), seed=0, worker_count=1
    )
    it = iter(loader)
    for _ in range(2):
        check_rows(next(it))
    it.close()


def test_a_piece_no_version_names_is_deleted_once_older_than_the_grace(s3: S3Server) -> None:
    """What a writer killed between its piece and its commit leaves: deleted by the
    id's next holder, never a committed piece."""
    url = _url()
    prefix = url.split("/", 3)[3] + "/writers/a/pieces/"
    w = _writer(s3, url, "a", evict_grace_s=0)
    w.append(make_rows("a", 0, 5))
    w.close()
    orphan = prefix + "000000000005-000000000099-000000000001.raw"
    s3.client().put_object(Bucket=BUCKET, Key=orphan, Body=b"never committed")
    w = _writer(s3, url, "a", evict_grace_s=0)
    n = 5

    def gone() -> bool:
        nonlocal n
        w.append(make_rows("a", n, 1))
        n += 1
        w.flush()
        return orphan not in _keys(s3, prefix)

    _wait(gone, "the orphan piece to be deleted")
    w.close()
    np.testing.assert_array_equal(got_seq_after(url, s3), np.arange(n))


def test_a_flush_retried_after_a_lost_answer_commits_each_row_once(
    s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest version was created but its answer lost (the flush raised): the next
    flush finds the version its own (its epoch) and commits the rest after it."""
    url = _url()
    w = _writer(s3, url, "a")
    w.append(make_rows("a", 0, 4))
    w.flush()
    w.append(make_rows("a", 4, 3))
    real = ObjectStore.create

    def create_then_fail(self: ObjectStore, key: str, data: bytes) -> bool:
        made = real(self, key, data)
        if "/manifests/" in key:
            monkeypatch.setattr(ObjectStore, "create", real)
            raise ConnectionError("the answer was lost")
        return made

    monkeypatch.setattr(ObjectStore, "create", create_then_fail)
    with pytest.raises(ConnectionError):
        w.flush()
    w.append(make_rows("a", 7, 2))
    assert w.flush() == 9
    w.close()
    got = gr.open_source(url, storage_options=s3.storage_options()).read_batch(np.arange(9))
    check_rows(got)
    np.testing.assert_array_equal(got["seq"], np.arange(9))


def test_two_writers_racing_for_one_free_id_one_takes_it(s3: S3Server) -> None:
    """Both see the id free (released) and create the same lease epoch: one holds the id,
    the other is refused naming it; the holder's commits follow the last one."""
    url = _url()
    w = _writer(s3, url, "a")
    w.append(make_rows("a", 0, 6))
    w.close()

    def take() -> Any:
        try:
            return _writer(s3, url, "a")
        except gr.WriterBusyError as e:
            return e

    got = _race([take, take])
    holders = [g for g in got if isinstance(g, gr.ReplayWriter)]
    refused = [g for g in got if isinstance(g, gr.WriterBusyError)]
    assert len(holders) == 1 and len(refused) == 1, got
    assert f"pid {os.getpid()}" in str(refused[0])
    holders[0].append(make_rows("a", 6, 2))
    assert holders[0].flush() == 8
    holders[0].close()
    np.testing.assert_array_equal(got_seq_after(url, s3), np.arange(8))


def test_a_prioritized_replay_checkpoint_over_s3_restores_the_draws(s3: S3Server) -> None:
    url = _url()
    w = _writer(s3, url, "a", capacity=100)
    w.append(make_rows("a", 0, 50))
    w.close()
    src = gr.open_source(url, storage_options=s3.storage_options())

    def loader() -> Any:
        return gr.make_data_loader(src, batch_size=8, sampling=gr.PrioritizedReplay(), seed=1)

    it = iter(loader())
    first = next(it)
    it.update_priorities(first.index, np.arange(8) + 1.0)
    state = it.get_state()
    assert gr.read_watermark(state).writers == {"a": 50}
    want = [np.asarray(next(it).index) for _ in range(3)]
    again = iter(loader())
    again.set_state(state)
    for ids in want:
        np.testing.assert_array_equal(np.asarray(next(again).index), ids)
    it.close()
    again.close()


def test_a_learner_started_first_waits_for_the_writers(s3: S3Server) -> None:
    url = _url()
    so = s3.storage_options()
    with pytest.raises(gr.StoreNotFoundError, match=r"Nothing at s3://.*Fix:.*wait="):
        gr.open_source(url, storage_options=so)
    opened: list[Any] = []
    learner = threading.Thread(
        target=lambda: opened.append(gr.open_source(url, storage_options=so, wait=60.0))
    )
    learner.start()  # polls: no store, then a store with no committed row, then rows
    w = _writer(s3, url, "a")
    w.append(make_rows("a", 0, 3))
    w.flush()
    learner.join(60)
    assert len(opened) == 1 and isinstance(opened[0], gr.ObjectPartsDataSource)
    assert len(opened[0]) == 3
    w.close()


def test_a_writer_left_open_commits_and_frees_its_id_at_exit(s3: S3Server) -> None:
    """A script that never closes its writer: the exit hook commits its rows and releases
    the lease (a close from __del__ at finalization would wait forever on fsspec's loop)."""
    url = _url()
    helpers = os.path.join(os.path.dirname(__file__), "..", "helpers")
    script = (
        f"import sys; sys.path.insert(0, {helpers!r})\n"
        "import grain_replay as gr\n"
        "from parts_child import make_rows\n"
        "from s3_server import s3_storage_options\n"
        f"w = gr.ReplayWriter({url!r}, capacity=100, writer_id='a', "
        f"storage_options=s3_storage_options({s3.endpoint_url!r}))\n"
        "w.append(make_rows('a', 0, 5))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    np.testing.assert_array_equal(got_seq_after(url, s3), np.arange(5))
    w = _writer(s3, url, "a", capacity=100)  # released: taken at once, no lease to wait out
    assert w.committed == 5
    w.close()
