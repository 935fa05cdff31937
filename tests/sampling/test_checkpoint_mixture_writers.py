"""A replay mixture's checkpoint records each source's watermark; a store made again is told apart.

The common online case mixes an offline dataset with a bounded many-writer store.
Its iterator's state holds one watermark per source (``watermarks``): the offline
store's committed length, the online store's writers and its ``store_id``.
``gr.read_watermark`` returns the online store's (or the one named by ``store=``),
a restore checks each source as a single store's restore does, and the restored
mixture draws what the uninterrupted one drew. A many-writer store deleted and made
again at the same path, with the same writer ids and as many rows, has another
``store_id``: a restore over it and ``resume_from=`` its old watermark are refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from tests.helpers.orbax_items import restore_item as _restore
from tests.helpers.orbax_items import save_item as _save
from tests.sampling.test_checkpoint_writers import CAP, WRITERS, _append, _rows

B = 8
_LOOK = 3  # refresh_every: the restored mixture's first look is at step 6


def _stores(tmp_path: Path, fmt: str = "npy") -> tuple[str, str]:
    if fmt == "zarr":
        pytest.importorskip("zarr")
    offline = str(tmp_path / "offline")
    gr.write_npy(offline, _rows(9, 0, 200))  # ids 9000.. : never a writer's
    online = str(tmp_path / "online")
    _append(online, fmt, 40)  # below capacity: 40 rows each, none evicted yet
    return offline, online


def _loader(offline: str, online: str, workers: int = 0) -> Any:
    return gr.make_data_loader(
        {"offline": gr.open_source(offline), "online": gr.open_source(online)},
        weights={"offline": 0.25, "online": 0.75},
        batch_size=B,
        seed=3,
        sampling=gr.UniformReplay(refresh_every=_LOOK),
        worker_count=workers,
        worker_buffer_size=1,
    )


def _ids(batch: Any) -> np.ndarray:
    return np.asarray(batch["id"]).copy()


def test_a_mixtures_state_holds_each_sources_watermark(tmp_path: Path) -> None:
    offline, online = _stores(tmp_path)
    it = iter(_loader(offline, online))
    for _ in range(2):
        next(it)
    state = it.get_state()
    saved = json.loads(state)
    assert "watermark" not in saved and set(saved["watermarks"]) == {"offline", "online"}
    offline_id = gr.open_source(offline).store_id
    assert saved["watermarks"]["offline"] == {"store": offline, "rows": 200, "store_id": offline_id}

    mark = gr.read_watermark(state)  # the mixture's one many-writer store
    assert mark.store == online and mark.writers == {"actor-0": 40, "actor-1": 40}
    assert mark.store_id is not None and mark.store_id == gr.open_source(online).store_id
    assert gr.read_watermark(state, store=offline) == gr.Watermark(
        offline, rows=200, store_id=offline_id
    )
    assert gr.read_watermark(it, store=Path(online)) == mark
    with pytest.raises(gr.CheckpointMismatchError, match=r"none is .*elsewhere.*store= one"):
        gr.read_watermark(state, store=tmp_path / "elsewhere")


def test_a_mixture_over_two_many_writer_stores_asks_which_watermark(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _append(a, "npy", 20)
    _append(b, "npy", 20)
    loader = gr.make_data_loader(
        {"a": gr.open_source(a), "b": gr.open_source(b)},
        weights={"a": 0.5, "b": 0.5},
        batch_size=B,
        sampling=gr.UniformReplay(),
    )
    it = iter(loader)
    next(it)
    with pytest.raises(gr.CheckpointMismatchError, match=r"say whose watermark.*store="):
        gr.read_watermark(it.get_state())
    assert gr.read_watermark(it.get_state(), store=b).store == b


@pytest.mark.parametrize(("fmt", "workers"), [("npy", 0), ("npy", 2), ("hdf5", 0), ("zarr", 0)])
def test_a_restored_mixture_draws_what_the_uninterrupted_one_drew(
    tmp_path: Path, fmt: str, workers: int
) -> None:
    offline, online = _stores(tmp_path, fmt)
    with iter(_loader(offline, online, workers)) as it:
        for _ in range(4):
            next(it)
        state = it.get_state()
        # Rows committed and evicted after the checkpoint: 72 each, the oldest 8 gone.
        # The positions the restored mixture maps through are the checkpoint's.
        _append(online, fmt, 32)
        want = [_ids(next(it)) for _ in range(2)]  # before its next look (step 6)
    mark = gr.read_watermark(state)
    with iter(_loader(offline, online, workers)) as fresh:
        fresh.set_state(state)
        got = [_ids(next(fresh)) for _ in range(2)]
    for w, g in zip(want, got):
        live = (w >= 9000) | (w % 1000 >= 8)  # an evicted row may stand in for another
        np.testing.assert_array_equal(g[live], w[live])
        online_rows = g[g < 9000]
        assert ((online_rows % 1000) < mark.rows_for(WRITERS[0])).all()


def test_a_mixture_restore_through_orbax_checks_the_online_stores_writers(
    tmp_path: Path,
) -> None:
    offline, online = _stores(tmp_path)
    ckpt = tmp_path / "ckpt"
    with gr.sharded_device_put(_loader(offline, online)) as it:
        for _ in range(3):
            next(it)
        _save(it, ckpt, 3)
    assert gr.read_watermark(ckpt / "3" / "data").writers == {"actor-0": 40, "actor-1": 40}

    shutil.rmtree(Path(online) / "writers" / "actor-1")
    with gr.sharded_device_put(_loader(offline, online)) as fresh:
        with pytest.raises(gr.ReplayCheckpointError, match=r"writer 'actor-1' committed 40.*gone"):
            _restore(fresh, ckpt, 3)


def test_a_mixture_restore_checks_the_offline_stores_rows(tmp_path: Path) -> None:
    offline, online = _stores(tmp_path)
    it = iter(_loader(offline, online))
    next(it)
    state = it.get_state()
    shutil.rmtree(offline)
    gr.write_npy(offline, _rows(9, 0, 100))  # fewer rows than the checkpoint drew from
    fresh = iter(_loader(offline, online))
    # Written again, it is another store (another id): refused as such.
    with pytest.raises(gr.ReplayCheckpointError, match="deleted and made again"):
        fresh.set_state(state)
    # Its rows are checked too (here: the checkpoint made to name the new store).
    named = json.loads(state)
    named["watermarks"]["offline"]["store_id"] = gr.open_source(offline).store_id
    with pytest.raises(gr.ReplayCheckpointError, match=r"first 200 rows.*holds 100"):
        fresh.set_state(json.dumps(named).encode())


def _made_again(online: str) -> None:
    """The store deleted and made again at its path: same writer ids, more rows each."""
    shutil.rmtree(online)
    _append(online, "npy", 50)


def test_a_store_made_again_with_the_same_writer_ids_is_refused_on_restore(
    tmp_path: Path,
) -> None:
    offline, online = _stores(tmp_path)
    replay = gr.make_data_loader(gr.open_source(online), batch_size=B, sampling=gr.UniformReplay())
    one, mixed = iter(replay), iter(_loader(offline, online))
    next(one)
    next(mixed)
    states = [one.get_state(), mixed.get_state()]
    _made_again(online)
    fresh_one = iter(
        gr.make_data_loader(gr.open_source(online), batch_size=B, sampling=gr.UniformReplay())
    )
    fresh_mixed = iter(_loader(offline, online))
    for fresh, state in zip((fresh_one, fresh_mixed), states):
        with pytest.raises(gr.ReplayCheckpointError, match="deleted and made again"):
            fresh.set_state(state)
    # A state saved before stores had ids (no store_id) restores as before.
    old = json.loads(states[0])
    del old["watermark"]["store_id"]
    fresh_one.set_state(json.dumps(old).encode())


def test_resume_from_the_watermark_of_a_store_made_again_is_refused(tmp_path: Path) -> None:
    _, online = _stores(tmp_path)
    mark = gr.read_watermark(_state_of(online))
    _made_again(online)
    with pytest.raises(gr.InvalidArgumentError, match=r"actor-0.*deleted and made again"):
        gr.ReplayWriter(online, capacity=CAP, writer_id="actor-0", resume_from=mark)
    with pytest.raises(gr.InvalidArgumentError, match="deleted and made again"):
        gr.truncate_to_watermark(online, mark)
    # Nothing was cut: the new store's rows are all there.
    assert gr.open_source(online).committed_rows() == {"actor-0": 50, "actor-1": 50}
    # The same store (not made again) resumes from its own watermark.
    again = gr.read_watermark(_state_of(online))
    assert again.store_id == gr.open_source(online).store_id
    with gr.ReplayWriter(online, capacity=CAP, writer_id="actor-0", resume_from=again) as w:
        assert w.committed == 50


def _state_of(online: str) -> bytes:
    loader = gr.make_data_loader(gr.open_source(online), batch_size=B, sampling=gr.UniformReplay())
    it = iter(loader)
    next(it)
    return it.get_state()


def test_watermark_json_round_trips_the_store_id_and_merges_it() -> None:
    a = gr.Watermark("/s", writers={"w": 3}, store_id="abc")
    assert gr.Watermark.from_json(a.to_json()) == a
    assert gr.Watermark.from_json({"store": "/s", "writers": {"w": 3}}).store_id is None
    merged = a.merge(gr.Watermark("/s", writers={"w": 5, "v": 1}))
    assert merged == gr.Watermark("/s", writers={"w": 5, "v": 1}, store_id="abc")
    with pytest.raises(gr.CheckpointMismatchError, match="different stores"):
        a.merge(gr.Watermark("/s", writers={"w": 5}, store_id="xyz"))
    with pytest.raises(gr.CheckpointMismatchError, match="store_id 5"):
        gr.Watermark.from_json({"store": "/s", "writers": {}, "store_id": 5})
