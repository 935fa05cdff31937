"""Small host appends gathered and written as one block a leaf (writers/row_stage.py), and
the quick check of a flat numpy tree like the last one."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.store import layout
from grain_replay.store.formats import GROWING_NPY_HEADER as NPY_HEADER
from grain_replay.store.layout import LeafSpec
from grain_replay.tree import flatten
from grain_replay.writers import row_stage
from grain_replay.writers.backends import BACKENDS, NpySegmentBackend
from grain_replay.writers.row_stage import HostSignature, RowStage
from tests.helpers.store_reads import read_all

ROWS = 16
FORMATS = {"npy": "s", "hdf5": "s.h5", "zarr": "s.zarr"}


def _block(i: int, rows: int = ROWS) -> dict[str, np.ndarray]:
    base = i * ROWS + np.arange(rows)
    return {
        "obs": (base[:, None] * np.ones(3)).astype(np.float32),
        "action": base.astype(np.int32),
        "done": base % 3 == 0,
    }


ROW_BYTES = sum(a[0].nbytes for a in _block(0).values())  # 17


def _expected(blocks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


def _assert_rows(path: str, blocks: list[dict[str, np.ndarray]]) -> None:
    got, want = read_all(path), _expected(blocks)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        np.testing.assert_array_equal(got[k], v, err_msg=k)


def _count_writes(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[int]:
    """The rows of every backend write of ``cls`` (one entry a call, all leaves)."""
    rows: list[int] = []
    real = cls.write

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        rows.append(len(next(iter(arrays.values()))))
        real(self, arrays, start)

    monkeypatch.setattr(cls, "write", write)
    return rows


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bounded", [False, True], ids=["plain", "bounded"])
def test_small_host_appends_written_once_a_stage_in_order(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fmt: str, bounded: bool
) -> None:
    monkeypatch.setattr(row_stage, "STAGE_BYTES", 8 * ROWS * ROW_BYTES)  # 8 appends
    cls = NpySegmentBackend if bounded and fmt == "npy" else BACKENDS[fmt]
    writes = _count_writes(monkeypatch, cls)
    path = str(tmp_path / FORMATS[fmt])
    kwargs: dict[str, Any] = {"capacity": 10_000, "writer_id": "a"} if bounded else {}
    blocks = [_block(i) for i in range(20)]
    with gr.ReplayWriter(path, format=fmt, **kwargs) as w:
        for b in blocks:
            w.append(b)
        # 20 appends: two full stages written, the third's 4 appends still gathered.
        assert writes == [8 * ROWS, 8 * ROWS]
        assert len(w) == 20 * ROWS and w.committed == 0
        assert w.flush() == 20 * ROWS
        assert writes == [8 * ROWS, 8 * ROWS, 4 * ROWS]
    _assert_rows(path, blocks)


def test_appends_larger_than_half_a_stage_written_after_the_stage_keep_order(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(row_stage, "STAGE_BYTES", 8 * ROWS * ROW_BYTES)  # 128 rows
    cls = BACKENDS["npy"]
    writes = _count_writes(monkeypatch, cls)
    path = str(tmp_path / "s")
    sizes = [3, 5, 100, 64, 1, 200, 7]  # 100 and 200 exceed half the stage (64 rows)
    blocks = [_block(i, rows) for i, rows in enumerate(sizes)]
    with gr.ReplayWriter(path) as w:
        for b in blocks:
            w.append(b)
    # Gathered 3 + 5, then 100 as it came; 64 + 1, then 200; 7 at the close.
    assert writes == [8, 100, 65, 200, 7]
    _assert_rows(path, blocks)


def test_gathered_rows_are_not_visible_before_the_flush_and_survive_a_reopen(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "s")
    blocks = [_block(i) for i in range(5)]
    with gr.ReplayWriter(path, capacity=10_000, writer_id="a") as w:
        w.append(blocks[0])
        w.flush()
        for b in blocks[1:]:
            w.append(b)
        src = gr.open_source(path)
        assert len(src) == ROWS, "rows not committed were visible"
        w.flush()
        src.refresh()
        assert len(src) == 5 * ROWS
    with gr.ReplayWriter(path, capacity=10_000, writer_id="a") as w:  # reopened
        w.append(_block(5))
    _assert_rows(path, [*blocks, _block(5)])


def test_failed_write_of_the_stage_raised_by_flush_and_its_rows_written_again(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = BACKENDS["npy"]
    real = cls.write
    armed = {"on": False}

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        if armed["on"]:
            armed["on"] = False
            raise OSError(28, "No space left on device")
        real(self, arrays, start)

    monkeypatch.setattr(cls, "write", write)
    path = str(tmp_path / "s")
    blocks = [_block(i) for i in range(4)]
    with gr.ReplayWriter(path) as w:
        for b in blocks:
            w.append(b)
        armed["on"] = True
        with pytest.raises(OSError, match="No space left"):
            w.flush()
        assert w.committed == 0 and len(w) == 4 * ROWS
        assert w.flush() == 4 * ROWS  # the gathered rows are still there: written now
    _assert_rows(path, blocks)


def test_failed_write_of_a_full_stage_fails_the_append_that_needed_room(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(row_stage, "STAGE_BYTES", 2 * ROWS * ROW_BYTES)  # 2 appends
    cls = BACKENDS["npy"]
    real = cls.write
    armed = {"on": False}

    def write(self: Any, arrays: dict[str, np.ndarray], start: int) -> None:
        if armed["on"]:
            armed["on"] = False
            raise OSError(5, "Input/output error")
        real(self, arrays, start)

    monkeypatch.setattr(cls, "write", write)
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path) as w:
        w.append(_block(0))
        w.append(_block(1))
        armed["on"] = True
        with pytest.raises(OSError, match="Input/output"):
            w.append(_block(2))  # its rows need room: the stage's write fails first
        assert len(w) == 2 * ROWS, "the failed append's rows were counted"
        w.append(_block(2))  # the stage is written now, then these rows are gathered
    _assert_rows(path, [_block(0), _block(1), _block(2)])


def test_stage_holds_at_most_its_bytes_in_buffers_allocated_once() -> None:
    leaves = {
        "obs": LeafSpec(np.dtype(np.float32), (3,)),
        "action": LeafSpec(np.dtype(np.int32), ()),
        "done": LeafSpec(np.dtype(bool), ()),
    }
    stage = RowStage(leaves, limit_bytes=1000)
    assert stage.capacity == 1000 // ROW_BYTES == 58
    assert stage.nbytes == 0, "buffers allocated before the first append"
    written: list[tuple[dict[str, np.ndarray], int]] = []

    def write(block: dict[str, np.ndarray], rows: int, *, by_leaf: bool) -> None:
        written.append(({k: v.copy() for k, v in block.items()}, rows))

    blocks = [_block(i, 10) for i in range(30)]
    held: set[int] = set()
    for b in blocks:
        assert stage.takes(10)
        stage.add(b, 10, write)
        assert stage.buffers is not None
        held.add(id(stage.buffers["obs"]))
        assert stage.nbytes == 58 * ROW_BYTES <= 1000
    stage.drain(write)
    assert len(held) == 1, "the stage allocated new buffers"
    assert [r for _, r in written] == [50] * 6, "five appends of 10 rows a write"
    got = {k: np.concatenate([w[k] for w, _ in written]) for k in blocks[0]}
    for k, v in _expected(blocks).items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert not stage.takes(30), "an append over half the stage was taken"
    stage.clear()
    assert stage.nbytes == 0 and stage.rows == 0


def test_tree_like_the_last_skips_the_full_check(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = layout.check_leaves

    def check_leaves(tree: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(tree, **kw)

    monkeypatch.setattr(layout, "check_leaves", check_leaves)
    path = str(tmp_path / "s")
    blocks = [_block(i, rows=1 + i % 5) for i in range(10)]  # any row count
    with gr.ReplayWriter(path, capacity=10_000, writer_id="a") as w:
        for b in blocks:
            w.append(b)
    assert len(calls) == 1
    _assert_rows(path, blocks)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: {**t, "action": t["action"].astype(np.int64)}, "'action' is int64"),
        (lambda t: {**t, "obs": t["obs"][:, :2]}, "'obs' is float32\\[2\\]"),
        (lambda t: {**t, "done": t["done"][:3]}, "'done' has 3 records but expected 16"),
        (lambda t: {**t, "extra": t["action"]}, "the store has"),
        (lambda t: {k: t[k] for k in ("action", "obs", "done")}, "the store has"),
        (lambda t: {**t, "obs": np.float32(1.0)}, "'obs' is a scalar"),
    ],
    ids=["dtype", "row-shape", "rows", "extra-leaf", "key-order", "scalar"],
)
def test_tree_unlike_the_last_takes_the_full_check_and_its_error(
    tmp_path: Any, change: Any, match: str
) -> None:
    path = str(tmp_path / "s")
    with gr.ReplayWriter(path) as w:
        w.append(_block(0))
        w.append(_block(1))  # remembered: the next unlike tree must not pass on it
        with pytest.raises(gr.InvalidTreeError, match=match):
            w.append(change(_block(2)))
        w.append(_block(2))
    _assert_rows(path, [_block(0), _block(1), _block(2)])


def test_host_signature_takes_only_trees_of_plain_numpy_arrays() -> None:
    tree = _block(0)
    sig = HostSignature.of(tree, dict(tree))
    assert sig is not None and sig.check(_block(1, rows=7)) == 7
    assert sig.check({**_block(1), "obs": np.ma.masked_array(tree["obs"])}) == 0
    assert sig.check([_block(1)]) == 0 and sig.check({}) == 0
    assert sig.check({**_block(1), "obs": _block(1)["obs"].tolist()}) == 0
    assert sig.check(_block(1, rows=0)) == 0, "zero rows are the full path's to handle"
    assert HostSignature.of({"a": [1.0, 2.0]}, {"a": np.array([1.0, 2.0])}) is None
    assert HostSignature.of(tree, {k: v.copy() for k, v in tree.items()}) is None


def _nested(i: int, rows: int = ROWS) -> dict[str, Any]:
    b = _block(i, rows)
    return {"obs": {"x": b["obs"]}, "rest": (b["action"], [b["done"]])}


def test_host_signature_takes_nested_trees_like_the_last() -> None:
    """A nested tree's leaves come back under their flattened names, in order."""
    tree = _nested(0)
    flat, _, _ = layout.check_leaves(tree, where="s")
    sig = HostSignature.of(tree, flat)
    assert sig is not None
    like = _nested(1, rows=5)
    taken = sig.take(like)
    assert taken is not None and taken[1] == 5
    assert list(taken[0]) == ["obs/x", "rest/0", "rest/1/0"]
    assert taken[0]["obs/x"] is like["obs"]["x"] and taken[0]["rest/1/0"] is like["rest"][1][0]
    assert sig.take({**like, "rest": list(like["rest"])}) is None
    assert sig.take({"rest": like["rest"], "obs": like["obs"]}) is None
    assert sig.take({**like, "obs": {"x": like["obs"]["x"].astype(np.float64)}}) is None


def test_nested_host_trees_like_the_last_skip_the_full_check(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = layout.check_leaves

    def check_leaves(tree: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(tree, **kw)

    monkeypatch.setattr(layout, "check_leaves", check_leaves)
    for kwargs, name in (({}, "plain"), ({"capacity": 10_000, "writer_id": "a"}, "parts")):
        calls.clear()
        path = str(tmp_path / name)
        with gr.ReplayWriter(path, **kwargs) as w:
            for i in range(6):
                w.append(_nested(i, rows=1 + i % 3))
            with pytest.raises(gr.InvalidTreeError, match="the store has"):
                w.append({**_nested(6), "rest": list(_nested(6)["rest"])})
            w.append(_nested(7))
        assert len(calls) == 2, "a like nested tree took the full check"
        got, _ = flatten(read_all(path))
        want = [_nested(i, rows=1 + i % 3) for i in range(6)] + [_nested(7)]
        for key, parts in (
            ("obs/x", [t["obs"]["x"] for t in want]),
            ("rest/0", [t["rest"][0] for t in want]),
            ("rest/1/0", [t["rest"][1][0] for t in want]),
        ):
            np.testing.assert_array_equal(got[key], np.concatenate(parts), err_msg=key)


def test_stage_bytes_of_a_writer_are_bounded_on_the_disk_too(tmp_path: Any) -> None:
    """Rows not yet flushed are at most a stage's bytes away from the leaf files: a
    writer streaming without flushes keeps writing them out (memory stays bounded)."""
    path = str(tmp_path / "s")
    stage_rows = row_stage.STAGE_BYTES // ROW_BYTES
    with gr.ReplayWriter(path) as w:
        for i in range(3 * stage_rows // ROWS):
            w.append(_block(i))
        on_disk = (os.path.getsize(os.path.join(path, "action.npy")) - NPY_HEADER) // 4
        assert len(w) - stage_rows <= on_disk <= len(w)
