"""Loaders asked to lay batches out as a packed transfer's buffer (pipeline/lanes.py).

The batches (values, dtypes, shapes, tree) and the checkpoint bytes are those of a loader
that was not asked; only where the leaves lie in memory changes.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np
import pytest
from conformance import assert_tree_equal, make_tree
from loader_ops import Frames, Scalar, Shapes

import grain_replay as gr
from grain_replay import tree as tree_lib
from grain_replay.pipeline.lanes import (
    ROW_BYTES,
    LaneBuffer,
    LaneField,
    lane_fields,
    lane_views,
    owner_of,
    padded,
)

NO_SHARDING = grain.sharding.NoSharding()


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tree = make_tree(100)
    tree["id"] = np.arange(100, dtype=np.int64)
    tree["frame"] = (np.arange(100)[:, None, None] + np.arange(4800).reshape(1, 40, 120)).astype(
        np.uint8
    )  # 4,800-byte elements: rows of their own, padded to 5,120 bytes
    p = str(tmp_path_factory.mktemp("lanes") / "s.npy")
    gr.write(p, tree, format="npy")
    return p


def _loader(src: Any, **kwargs: Any) -> grain.DataLoader:
    kwargs.setdefault("shard_options", NO_SHARDING)
    kwargs.setdefault("num_epochs", 2)
    return gr.make_data_loader(src, batch_size=8, seed=5, **kwargs)


def _laid(batch: Any) -> bool:
    """Every leaf is a view of one LaneBuffer that records it."""
    leaves = list(tree_lib.flatten(batch)[0].values())
    owners = {id(owner_of(a)) for a in leaves}
    owner = owner_of(leaves[0])
    return (
        owner is not None
        and len(owners) == 1
        and all(id(a) in (owner.lane_fields or {}) for a in leaves)
    )


def test_lane_fields_start_each_leaf_on_a_row_and_give_large_elements_rows_of_their_own() -> None:
    fields, rows = lane_fields(
        [
            (np.float32, (256, 64)),  # 65,536 bytes: 128 rows
            (np.bool_, (256,)),  # 256 bytes: 1 row
            (np.uint8, (4, 84, 84, 4)),  # 28,224-byte elements: 56 rows each
            (np.int32, (3, 1024)),  # 4,096-byte elements: 8 rows each, unpadded
            (np.float32, (0, 5000)),  # no rows
        ]
    )
    assert fields == [
        LaneField(0, 128, 0),
        LaneField(128, 1, 0),
        LaneField(129, 224, 56),
        LaneField(353, 24, 8),
        LaneField(377, 0, 0),
    ]
    assert rows == 377
    assert lane_fields([])[1] == 1  # a buffer has a row at least
    assert padded([(np.uint8, (4, 84, 84, 4))])
    assert not padded([(np.int32, (3, 1024)), (np.float32, (256, 64))])


def test_lane_views_write_each_leaf_where_its_field_says_and_the_buffer_records_them() -> None:
    leaves = {"a": (np.dtype(np.int16), (3, 5)), "frames": (np.dtype(np.uint8), (2, 4100))}
    (fa, ff), rows = lane_fields(list(leaves.values()))
    buf = np.zeros(rows * ROW_BYTES, np.uint8).view(LaneBuffer)
    views = lane_views(buf, leaves)
    views["a"][...] = np.arange(15, dtype=np.int16).reshape(3, 5)
    views["frames"][...] = np.arange(8200).reshape(2, 4100) % 251
    raw = np.asarray(buf)
    assert raw[:30].view(np.int16).tolist() == list(range(15))
    stride = ff.per_element * ROW_BYTES
    for i in range(2):
        start = ff.row * ROW_BYTES + i * stride
        assert (raw[start : start + 4100] == (np.arange(4100) + 4100 * i) % 251).all()
    assert type(views["a"]) is np.ndarray and views["frames"].strides[0] == stride
    assert owner_of(views["a"]) is buf and owner_of(views["frames"]) is buf
    assert buf.lane_rows == rows
    assert buf.lane_fields == {id(views["a"]): fa, id(views["frames"]): ff}
    assert owner_of(views["a"].copy()) is None  # a copy is nobody's view
    plain = np.zeros(rows * ROW_BYTES, np.uint8)  # not a LaneBuffer: nothing recorded
    assert owner_of(lane_views(plain, leaves)["a"]) is None


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_laid_out_in_lanes_equal_the_batches_as_read(path: str, workers: int) -> None:
    src = gr.open_source(path)
    want_it = iter(_loader(src, worker_count=workers))
    want = [next(want_it) for _ in range(9)]
    it = iter(_loader(src, worker_count=workers))
    it.lay_out_lanes()
    got = [next(it) for _ in range(9)]
    for g, w in zip(got, want, strict=True):
        assert_tree_equal(g, w)
        for a, b in zip(tree_lib.flatten(g)[0].values(), tree_lib.flatten(w)[0].values()):
            assert a.dtype == b.dtype and a.shape == b.shape
    assert it.get_state() == want_it.get_state()
    if workers:  # the workers lay out every batch, padded rows too
        assert all(_laid(b) for b in got)
        assert got[1]["frame"].strides[0] == 10 * ROW_BYTES  # 4,800 bytes on 10 rows
    else:  # in process, a leaf whose rows are padded keeps batches as read
        assert not any(_laid(b) for b in got)
    it.close()
    want_it.close()


def test_in_process_lays_out_every_batch_after_the_first_when_no_rows_are_padded(
    tmp_path: Any,
) -> None:
    tree = make_tree(64)
    p = str(tmp_path / "s.npy")
    gr.write(p, tree, format="npy")
    src = gr.open_source(p)
    it = iter(_loader(src))
    it.lay_out_lanes()
    got = [next(it) for _ in range(8)]
    want = list(_loader(src))[:8]
    for g, w in zip(got, want, strict=True):
        assert_tree_equal(g, w)
    assert [_laid(b) for b in got] == [False] + [True] * 7
    # a short last batch (drop_remainder=False) is read as it is
    short = iter(gr.make_data_loader(src, batch_size=60, shuffle=False, drop_remainder=False))
    short.lay_out_lanes()
    batches = list(short)
    assert [len(b["reward"]) for b in batches] == [60, 4]
    assert not _laid(batches[1])
    assert_tree_equal(batches[1], src.read_batch(np.arange(60, 64)))


def test_in_process_with_operations_hands_batches_out_as_mapped(path: str) -> None:
    src = gr.open_source(path)
    it = iter(_loader(src, operations=[Frames()]))
    it.lay_out_lanes()
    got = [next(it) for _ in range(3)]
    assert not any(_laid(b) for b in got)
    assert_tree_equal(got[2], list(_loader(src, operations=[Frames()]))[2])


def test_workers_lay_out_batches_once_asked_mid_stream_and_mapped_ones_too(path: str) -> None:
    src = gr.open_source(path)
    ops = [Frames()]
    # The reference in process: the workers' stream equals it (test_worker_loader.py), and
    # it spawns no second set of workers (seconds on a 2-core machine).
    want = list(_loader(src, worker_count=0, operations=ops))
    it = iter(_loader(src, worker_count=2, operations=ops))
    got = [next(it), next(it)]
    it.lay_out_lanes()  # the running workers are told; what they wrote before stays
    got += list(it)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_tree_equal(g, w)
    # each worker holds at most two batches written before it was told
    assert not _laid(got[0]) and all(_laid(b) for b in got[8:])


@pytest.mark.parametrize("op", [Scalar(), Shapes()], ids=["0-d", "pickled"])
def test_workers_keep_batches_with_leaves_lanes_cannot_hold_as_they_were(
    path: str, op: Any
) -> None:
    """A 0-d leaf (no rows) keeps a batch in the plain layout; pickled leaves still travel."""
    src = gr.open_source(path)
    want = list(_loader(src, worker_count=0, operations=[op], num_epochs=1))  # as above
    it = iter(_loader(src, worker_count=2, operations=[op], num_epochs=1))
    it.lay_out_lanes()
    got = list(it)
    assert len(got) == len(want) == 12
    for g, w in zip(got, want, strict=True):
        assert_tree_equal(g, w)
        assert not _laid(g)
