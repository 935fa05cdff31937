"""The reader of object-storage pieces and its packed cache, over an in-memory bucket.

Every batch is compared with the rows written; the bucket counts requests, so that a warm
batch is seen to make none and a cold one one per piece (or one per leaf per run of rows
when a piece is larger than the cache). The same reader runs against a real S3 server in
tests/remote/test_s3_parts.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.parts.object_snapshot import ObjectPart, ObjectSnapshot
from grain_replay.sources.parts.piece_cache import PieceArena
from grain_replay.sources.parts.piece_reader import PieceReader
from grain_replay.store import parts as parts_lib
from grain_replay.store.layout import LeafSpec
from grain_replay.store.object_manifest import ObjectManifest, Piece

LEAVES = {
    "obs": LeafSpec(np.dtype("<f4"), (3,)),
    "action": LeafSpec(np.dtype("<i8"), ()),
    "done": LeafSpec(np.dtype("?"), ()),
}
ROW_BYTES = 3 * 4 + 8 + 1
ROW_COST = ROW_BYTES + 3 * 4  # a held row and its three int32 index entries


class Bucket:
    """Objects in a dict; ``cat_ranges`` as ObjectStore's (a missing object: its error in
    place), counting requests."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.requests = 0
        self.lock = threading.Lock()

    def writer_key(self, writer_id: str, *parts: str) -> str:
        return "/".join(["store", "writers", writer_id, *parts])

    def cat_ranges(
        self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]
    ) -> list[bytes | BaseException]:
        with self.lock:
            self.requests += len(keys)
        out: list[bytes | BaseException] = []
        for key, start, end in zip(keys, starts, ends, strict=True):
            data = self.objects.get(key)
            out.append(FileNotFoundError(key) if data is None else data[start:end])
        return out


def _rows(ordinal: int, seq: np.ndarray) -> dict[str, np.ndarray]:
    """Row ``seq`` of writer ``ordinal``: a function of both, so any misplaced row shows."""
    seq = np.asarray(seq, dtype=np.int64)
    value = (ordinal * 1_000_000 + seq).astype(np.float32)
    return {
        "obs": np.stack([value, value + 0.5, -value], axis=1),
        "action": ordinal * 1_000_000 + seq,
        "done": (seq + ordinal) % 3 == 0,
    }


def _expected(ids: np.ndarray) -> dict[str, np.ndarray]:
    ordinal, seq = parts_lib.split_ids(np.asarray(ids, dtype=np.int64))
    out = {k: np.empty((len(ids), *v.shape), v.dtype) for k, v in LEAVES.items()}
    for o in np.unique(ordinal).tolist():
        at = ordinal == o
        for k, v in _rows(o, seq[at]).items():
            out[k][at] = v
    return out


def _store(bucket: Bucket, writers: Sequence[Sequence[int]], live_start: int = 0) -> ObjectSnapshot:
    """Writer ``i`` (ordinal ``i``) with pieces of ``writers[i]`` rows from ``live_start``."""
    parts = []
    for ordinal, sizes in enumerate(writers):
        pieces, first = [], live_start
        for rows in sizes:
            piece = Piece(first, rows, 1, 0)
            leaves = _rows(ordinal, np.arange(first, first + rows))
            key = f"{bucket.writer_key(f'w{ordinal}', 'pieces')}/{piece.name}"
            bucket.objects[key] = b"".join(leaves[k].astype(v.dtype).tobytes()
                                           for k, v in LEAVES.items())  # fmt: skip
            pieces.append(piece)
            first += rows
        m = ObjectManifest(f"w{ordinal}", ordinal, None, first, tuple(pieces), 1, 1)
        parts.append(ObjectPart.of(m, None))
    return ObjectSnapshot.of(parts)


def _read(
    reader: PieceReader,
    bucket: Bucket,
    snap: ObjectSnapshot,
    ids: np.ndarray,
    keys: list[str] | None = None,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    names = list(LEAVES) if keys is None else keys
    out = {k: np.empty((len(ids), *LEAVES[k].shape), LEAVES[k].dtype) for k in names}
    ok = reader.read(bucket, snap, np.asarray(ids, dtype=np.int64), out)
    return out, ok


def _check(got: dict[str, np.ndarray], ids: np.ndarray) -> None:
    want = _expected(ids)
    for k, v in got.items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)


def _all_ids(snap: ObjectSnapshot) -> np.ndarray:
    return np.concatenate(
        [np.arange(i, i + n) for i, n in zip(snap.piece_ids, snap.piece_rows, strict=True)]
    )


# -- the reader ------------------------------------------------------------------------


def test_a_batch_reads_its_rows_in_order_and_a_warm_one_makes_no_request() -> None:
    bucket = Bucket()
    snap = _store(bucket, [[7, 10, 3], [5, 11], [9]], live_start=40)
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 1 << 20)
    every = _all_ids(snap)
    ids = np.random.default_rng(0).choice(every, size=200)  # duplicates, any order
    got, ok = _read(reader, bucket, snap, ids)
    assert ok.all()
    _check(got, ids)
    touched = len(np.unique(snap.pieces_of(ids)[0]))
    assert bucket.requests == touched  # one GET of each whole piece
    assert reader.nbytes == reader.arena.held_rows * ROW_COST  # type: ignore[union-attr]
    for keys in (None, ["done"], ["obs", "action"]):
        got, ok = _read(reader, bucket, snap, ids[::-1], keys)
        assert ok.all() and set(got) == set(keys or LEAVES)
        _check(got, ids[::-1])
    assert bucket.requests == touched  # warm: memory only


def test_a_cache_smaller_than_one_piece_reads_ranges_and_holds_nothing() -> None:
    bucket = Bucket()
    snap = _store(bucket, [[10, 10]])
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 10 * ROW_COST - 1)
    ids = np.array([3, 4, 5, 15, 3])
    for _ in range(2):
        bucket.requests = 0
        got, ok = _read(reader, bucket, snap, ids)
        assert ok.all()
        _check(got, ids)
        assert bucket.requests == 2 * len(LEAVES)  # a run of rows per leaf per piece
        assert reader.nbytes == 0


def test_a_batch_reads_small_pieces_whole_and_large_ones_by_ranges_at_once() -> None:
    bucket = Bucket()
    snap = _store(bucket, [[10, 3, 4]])  # room for 5 rows: the 3 and 4-row pieces, in turn
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 5 * ROW_COST)
    ids = np.array([11, 2, 15, 9, 12, 2])
    for gets in (1 + 1 + len(LEAVES), len(LEAVES) + 1):  # the 4-row piece evicts the 3's
        bucket.requests = 0
        got, ok = _read(reader, bucket, snap, ids)
        assert ok.all() and bucket.requests == gets
        _check(got, ids)
        assert reader.nbytes <= 5 * ROW_COST


def test_no_cache_reads_every_batch_with_ranges() -> None:
    bucket = Bucket()
    snap = _store(bucket, [[4, 6], [8]])
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 0)
    ids = _all_ids(snap)[::-1]
    got, ok = _read(reader, bucket, snap, ids, ["action"])
    assert ok.all() and reader.arena is None and reader.nbytes == 0
    _check(got, ids)
    assert bucket.requests == 3


def test_pieces_evicted_mid_batch_still_give_their_rows() -> None:
    """Room for two pieces: a batch that hits one and fetches two more drops the hit one
    (after its rows were copied) and then the first fetched; every row is right."""
    bucket = Bucket()
    snap = _store(bucket, [[10, 10, 10, 10]])
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 20 * ROW_COST)
    arena = reader.arena
    assert arena is not None
    _check(_read(reader, bucket, snap, np.array([1, 12]))[0], np.array([1, 12]))
    ids = np.array([25, 3, 38, 4, 27])  # piece 0 held; pieces 2 and 3 fetched
    bucket.requests = 0
    got, ok = _read(reader, bucket, snap, ids)
    assert ok.all() and bucket.requests == 2
    _check(got, ids)
    assert {key for key, _, _ in arena.entries()} == {snap.piece_names[2], snap.piece_names[3]}
    assert reader.nbytes == 20 * ROW_COST
    bucket.requests = 0
    _check(_read(reader, bucket, snap, ids[[0, 2]])[0], ids[[0, 2]])
    assert bucket.requests == 0


def test_a_piece_deleted_from_the_bucket_is_not_read_and_not_held() -> None:
    bucket = Bucket()
    snap = _store(bucket, [[10, 10], [5]])
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 1 << 20)
    gone_writer, gone_name = snap.piece_names[int(snap.pieces_of(np.array([12]))[0][0])]
    del bucket.objects[f"{bucket.writer_key(gone_writer, 'pieces')}/{gone_name}"]
    w1 = parts_lib.make_ids(1, 2)
    ids = np.array([0, 12, w1, 19, 5])
    for _ in range(2):
        got, ok = _read(reader, bucket, snap, ids)
        np.testing.assert_array_equal(ok, [True, False, True, False, True])
        keep = ids[ok]
        _check({k: v[ok] for k, v in got.items()}, keep)
    assert len(reader.arena) == 2  # type: ignore[arg-type]


def test_rows_in_no_piece_of_the_snapshot_are_not_read() -> None:
    bucket = Bucket()
    snap = _store(bucket, [[10], [10]], live_start=5)
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 1 << 20)
    outside = [4, 15, parts_lib.make_ids(1, 4), parts_lib.make_ids(1, 15),
               parts_lib.make_ids(2, 5), -1, 6]  # fmt: skip
    got, ok = _read(reader, bucket, snap, np.array(outside))
    np.testing.assert_array_equal(ok, [False] * 6 + [True])
    _check({k: v[-1:] for k, v in got.items()}, np.array([6]))
    assert bucket.requests == 1
    empty = ObjectSnapshot.of([])
    assert not _read(reader, bucket, empty, np.array([0, 3]))[1].any()


def test_a_piece_of_another_size_than_its_manifest_says_is_refused() -> None:
    bucket = Bucket()
    snap = _store(bucket, [[10]])
    writer, name = snap.piece_names[0]
    key = f"{bucket.writer_key(writer, 'pieces')}/{name}"
    bucket.objects[key] = bucket.objects[key][:-1]
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 1 << 20)
    with pytest.raises(InvalidStoreError, match=r"s3://b/s: piece .*holds 209 .*promises 210.*Fix"):
        _read(reader, bucket, snap, np.array([0]))


def test_a_new_snapshot_finds_the_pieces_held_for_the_one_before() -> None:
    bucket = Bucket()
    old = _store(bucket, [[10, 10, 10]])
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 1 << 20)
    _read(reader, bucket, old, _all_ids(old))
    new = _store(bucket, [[10, 10, 10, 10]])  # one piece more; the others the same
    reader.keep_only(new)
    assert len(reader.arena) == 3  # type: ignore[arg-type]
    bucket.requests = 0
    ids = np.array([35, 0, 29, 31])
    _check(_read(reader, bucket, new, ids)[0], ids)
    assert bucket.requests == 1
    reader.keep_only(_store(Bucket(), [[5]], live_start=100))  # none of those pieces
    assert len(reader.arena) == 0 and reader.nbytes == 0  # type: ignore[arg-type]


def test_threads_reading_through_a_small_cache_get_their_own_rows() -> None:
    bucket = Bucket()
    snap = _store(bucket, [[8] * 6, [5] * 4])
    reader = PieceReader("s3://b/s", LEAVES, LEAVES, 20 * ROW_COST)  # two pieces or so
    every = _all_ids(snap)
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(30):
                ids = rng.choice(every, size=12)
                got, ok = _read(reader, bucket, snap, ids)
                assert ok.all()
                _check(got, ids)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert 0 < reader.nbytes <= 20 * ROW_COST


# -- the arena --------------------------------------------------------------------------


def _piece(first: int, rows: int) -> dict[str, np.ndarray]:
    return _rows(0, np.arange(first, first + rows))


def _take(arena: PieceArena, held: tuple[int, int], local: Sequence[int]) -> dict[str, np.ndarray]:
    out = {k: np.empty((len(local), *v.shape), v.dtype) for k, v in LEAVES.items()}
    n = len(local)
    hit = arena.copy_rows(np.full(n, held[0]), np.full(n, held[1]), np.asarray(local), out)
    assert hit.all()
    return out


def test_the_arena_drops_the_least_recently_used_and_counts_what_it_holds() -> None:
    arena = PieceArena(30 * ROW_COST, LEAVES)
    assert arena.max_rows == 30
    a, b, c = (arena.put(name, _piece(f, 10), 10) for name, f in (("a", 0), ("b", 10), ("c", 20)))
    assert a and b and c
    _take(arena, a, [0])  # a is now newer than b
    d = arena.put("d", _piece(30, 10), 10)
    assert d and arena.find("b") is None and arena.find("a") == a
    assert arena.nbytes == 30 * ROW_COST == arena.max_bytes and arena.held_rows == 30
    got = _take(arena, d, [9, 0])
    np.testing.assert_array_equal(got["action"], [39, 30])
    # b's slot went to d: b's old (slot, token) reads nothing
    out = {k: np.empty((1, *v.shape), v.dtype) for k, v in LEAVES.items()}
    assert not arena.copy_rows(np.array([b[0]]), np.array([b[1]]), np.array([0]), out).any()
    assert arena.put("big", _piece(0, 31), 31) is None and arena.find("big") is None


def test_the_arena_grows_to_what_a_batch_needs_and_never_past_its_bound() -> None:
    arena = PieceArena(100 * ROW_COST + ROW_COST // 2, LEAVES)
    arena.reserve(25)
    assert arena.nbytes == 25 * ROW_COST
    for k in range(12):  # 120 rows through room for 100
        arena.put(k, _piece(10 * k, 10), 10)
        assert arena.nbytes <= arena.max_bytes
    assert arena.nbytes == 100 * ROW_COST and len(arena) == 10
    arena.keep_only({11})
    assert len(arena) == 1 and arena.nbytes == 100 * ROW_COST  # the rows stay for reuse
    arena.keep_only(set())
    assert arena.nbytes == 0 and arena.held_rows == 0


def test_pieces_of_many_sizes_keep_their_rows_through_churn() -> None:
    """Pieces of 1-17 rows put and dropped at random: rows reused across pieces and the
    directory compacted, every piece held still reads its own rows."""
    arena = PieceArena(64 * ROW_COST, LEAVES)
    rng = np.random.default_rng(3)
    pieces: dict[int, tuple[int, int, int, int]] = {}  # key -> slot, token, first, rows
    first = 0
    for k in range(300):
        rows = int(rng.integers(1, 18))
        got = arena.put(k, _piece(first, rows), rows)
        assert got is not None
        pieces[k] = (*got, first, rows)
        first += rows
        if k % 7 == 0:
            arena.keep_only({j for j in pieces if rng.random() < 0.7})
        pieces = {j: v for j, v in pieces.items() if arena.find(j) is not None}
        assert arena.nbytes <= arena.max_bytes
        assert arena.held_rows == sum(v[3] for v in pieces.values()) <= 64
        for j, (slot, token, start, n) in pieces.items():
            assert arena.find(j) == (slot, token)
            got_rows = _take(arena, (slot, token), [n - 1, 0])["action"]
            np.testing.assert_array_equal(got_rows, [start + n - 1, start])


def test_an_arena_made_after_another_never_reads_its_slots() -> None:
    first = PieceArena(40 * ROW_COST, LEAVES)
    held = first.put("a", _piece(0, 10), 10)
    assert held is not None
    second = PieceArena(40 * ROW_COST, LEAVES)  # as in a forked child: a fresh one
    assert second.put("b", _piece(100, 10), 10) is not None
    out = {k: np.empty((1, *v.shape), v.dtype) for k, v in LEAVES.items()}
    for slot in (held[0], -1, 5):
        hit = second.copy_rows(np.array([slot]), np.array([held[1]]), np.array([0]), out)
        assert not hit.any()


def test_an_empty_or_rowless_arena_holds_nothing() -> None:
    assert PieceArena(ROW_COST - 1, LEAVES).max_rows == 0
    none = PieceArena(1 << 20, {"empty": LeafSpec(np.dtype("f4"), (0,))})
    assert not none.fits(1) and none.put("x", {"empty": np.zeros((1, 0), "f4")}, 1) is None
    out = {k: np.empty((2, *v.shape), v.dtype) for k, v in LEAVES.items()}
    arena = PieceArena(1 << 20, LEAVES)
    assert not arena.copy_rows(np.array([0, 1]), np.array([0, 1]), np.array([0, 0]), out).any()
