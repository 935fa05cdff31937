"""A replay checkpoint names its store by identity (its store id), not by the path typed.

Saved over ``buffer`` (one Orbax item, through grain's checkpoint handler), it restores
over a symlink to it, a relative path, the folder moved, and a copy of it, drawing the
batches the uninterrupted run drew; ``gr.truncate_to_watermark`` follows the same rule.
A different store of the same shape is refused, naming both ids and both paths. A store
(or a checkpoint) from before stores had ids is matched by its real path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from tests.helpers.orbax_items import restore_item, save_item

pytest.importorskip("orbax.checkpoint")  # in the test extra

B = 8
KINDS = ["npy", "hdf5", "bounded"]


def _rows(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.int64)
    return {"id": ids, "obs": ids[:, None].astype(np.float32) * np.ones((1, 3), np.float32)}


def _make(path: str, kind: str, start: int = 0, rows: int = 60) -> str:
    """A store at ``path`` of ``rows`` rows: a growing plain store, or a bounded one."""
    if kind == "bounded":
        for wid in ("a", "b"):
            with gr.ReplayWriter(path, "npy", capacity=100, writer_id=wid, segment_rows=16) as w:
                w.append(_rows(start + (1000 if wid == "b" else 0), rows // 2))
    else:
        with gr.ReplayWriter(path, kind) as w:
            w.append(_rows(start, rows))
    return path


def _name(kind: str) -> str:
    return "buffer.h5" if kind == "hdf5" else "buffer"


def _iter(path: str) -> Any:
    loader = gr.make_data_loader(
        gr.open_source(path), batch_size=B, seed=5, sampling=gr.UniformReplay()
    )
    return iter(loader)


def _saved(path: str, ckpt: Path) -> list[np.ndarray]:
    """Three batches, a checkpoint, and the four batches drawn after it."""
    it = _iter(path)
    for _ in range(3):
        next(it)
    save_item(it, ckpt, 3)
    want = [np.asarray(next(it)["id"]).copy() for _ in range(4)]
    it.close()
    return want


def _copy(src: str, dst: str) -> None:
    if os.path.isdir(src):
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)


@pytest.mark.parametrize("how", ["symlink", "relative", "moved", "copy"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_restores_over_another_path_to_its_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, how: str
) -> None:
    path = _make(str(tmp_path / _name(kind)), kind)
    sid = gr.open_source(path).store_id
    assert isinstance(sid, str)
    want = _saved(path, tmp_path / "ckpt")
    if how == "symlink":
        there = str(tmp_path / "buf_link")
        os.symlink(path, there)
    elif how == "relative":
        monkeypatch.chdir(tmp_path)
        there = os.path.basename(path)
    elif how == "moved":
        there = str(tmp_path / "scratch" / "moved")
        os.makedirs(os.path.dirname(there))
        os.rename(path, there)
    else:
        there = str(tmp_path / "scratch-copy")
        _copy(path, there)
    assert gr.open_source(there).store_id == sid
    fresh = _iter(there)
    restore_item(fresh, tmp_path / "ckpt", 3)
    for ids in want:
        np.testing.assert_array_equal(np.asarray(next(fresh)["id"]), ids)
    fresh.close()


@pytest.mark.parametrize("kind", KINDS)
def test_another_store_of_the_same_shape_is_refused_naming_both_ids(
    tmp_path: Path, kind: str
) -> None:
    path = _make(str(tmp_path / _name(kind)), kind)
    other = _make(str(tmp_path / ("other.h5" if kind == "hdf5" else "other")), kind)
    _saved(path, tmp_path / "ckpt")
    ids = gr.open_source(path).store_id, gr.open_source(other).store_id
    assert None not in ids and ids[0] != ids[1]
    fresh = _iter(other)
    with pytest.raises(gr.ReplayCheckpointError, match="another store") as info:
        restore_item(fresh, tmp_path / "ckpt", 3)
    text = str(info.value)
    assert all(s in text for s in (*ids, path, other)), text
    fresh.close()
    mark = gr.read_watermark(tmp_path / "ckpt" / "3" / "data")
    with pytest.raises(gr.InvalidArgumentError, match="another store") as info:
        gr.truncate_to_watermark(other, mark)
    assert all(s in str(info.value) for s in ids)


@pytest.mark.parametrize("kind", KINDS)
def test_truncate_to_watermark_through_a_symlink_and_over_a_copy(tmp_path: Path, kind: str) -> None:
    path = _make(str(tmp_path / _name(kind)), kind)
    _saved(path, tmp_path / "ckpt")
    mark = gr.read_watermark(tmp_path / "ckpt" / "3" / "data")
    assert mark.store_id == gr.open_source(path).store_id
    _make(path, kind, start=500, rows=20)  # rows committed after the checkpoint
    copy = str(tmp_path / ("copy.h5" if kind == "hdf5" else "copy"))
    _copy(path, copy)
    link = str(tmp_path / "link")
    os.symlink(path, link)
    want = {None: 60} if kind != "bounded" else {"a": 30, "b": 30}
    assert gr.truncate_to_watermark(link, mark) == want
    assert len(gr.open_source(path)) == 60
    assert len(gr.open_source(copy)) == 80  # not cut through the link
    assert gr.truncate_to_watermark(copy, mark) == want
    assert len(gr.open_source(copy)) == 60


def test_the_id_stays_as_a_store_grows_and_is_reopened(tmp_path: Path) -> None:
    path = str(tmp_path / "replay.h5")
    with gr.ReplayWriter(path) as w:
        w.append(_rows(0, 4))
        w.flush()
        sid = gr.open_source(path).store_id
        for i in range(40):  # grows the file and its metadata attribute
            w.append(_rows(4 + 50 * i, 50))
            w.flush()
    with gr.ReplayWriter(path, resume_from=30) as w:
        w.append(_rows(0, 2))
    assert gr.open_source(path).store_id == sid
    # gr.write makes a store of its own: another id, each time.
    a = gr.write(str(tmp_path / "a"), _rows(0, 5))
    b = gr.write(str(tmp_path / "a"), _rows(0, 5), overwrite=True)
    assert a == b and gr.open_source(b).store_id not in (None, sid)


def _strip_id(path: str) -> None:
    """Makes the npy store at ``path`` look made before stores had ids."""
    meta = os.path.join(path, "grain_replay.json")
    with open(meta) as f:
        raw = json.load(f)
    del raw["store_id"]
    with open(meta, "w") as f:
        json.dump(raw, f)


def test_a_store_without_an_id_is_matched_by_its_real_path(tmp_path: Path) -> None:
    path = str(tmp_path / "old")
    gr.write(path, _rows(0, 60))
    _strip_id(path)
    assert gr.open_source(path).store_id is None
    want = _saved(path, tmp_path / "ckpt")
    link = str(tmp_path / "link")
    os.symlink(path, link)
    fresh = _iter(link)  # a symlink resolves to the saved real path
    restore_item(fresh, tmp_path / "ckpt", 3)
    for ids in want:
        np.testing.assert_array_equal(np.asarray(next(fresh)["id"]), ids)
    fresh.close()
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    fresh = _iter(copy)
    with pytest.raises(gr.ReplayCheckpointError, match="before stores had ids") as info:
        restore_item(fresh, tmp_path / "ckpt", 3)
    assert "a copy or a moved folder of it cannot be" in str(info.value)
    assert "reopen a gr.ReplayWriter on it" in str(info.value)
    fresh.close()
    # A writer reopening it gives it an id, from its next commit on.
    with gr.ReplayWriter(path) as w:
        w.append(_rows(60, 1))
    assert isinstance(gr.open_source(path).store_id, str)


def test_an_old_checkpoint_without_ids_restores_by_real_path(tmp_path: Path) -> None:
    path = _make(str(tmp_path / "buffer"), "npy")
    it = _iter(path)
    next(it)
    state = json.loads(it.get_state())
    want = np.asarray(next(it)["id"]).copy()
    it.close()
    del state["watermark"]["store_id"]  # as saved before stores had ids
    old = json.dumps(state).encode()
    link = str(tmp_path / "link")
    os.symlink(path, link)
    fresh = _iter(link)
    fresh.set_state(old)
    np.testing.assert_array_equal(np.asarray(next(fresh)["id"]), want)
    fresh.close()
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    fresh = _iter(copy)
    with pytest.raises(gr.ReplayCheckpointError, match="saved before stores had ids"):
        fresh.set_state(old)
    fresh.close()
