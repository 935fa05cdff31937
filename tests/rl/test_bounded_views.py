"""Episode and sequence views over bounded, many-writer stores: only live rows, no crossing."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import grain_replay as gr


def _steps(writer: int, start: int, n: int, episode: int = 10) -> dict[str, np.ndarray]:
    seq = np.arange(start, start + n, dtype=np.int64)
    return {
        "seq": seq,
        "writer": np.full(n, writer, dtype=np.int64),
        "done": (seq % episode) == episode - 1,
    }


def test_episodes_start_at_the_oldest_live_row_and_never_cross_writers(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    ws = [gr.ReplayWriter(path, capacity=45, writer_id=f"w{i}", segment_rows=8) for i in range(2)]
    for i, w in enumerate(ws):
        w.append(_steps(i, 0, 104))  # live: 59..103; the episode 50..59 lost its head
        w.flush()
    src = gr.open_source(path)
    index = gr.build_episode_index(src)
    starts, lengths = np.asarray(index.starts), np.asarray(index.lengths)
    batch = src.read_batch(np.arange(len(src)))
    for s, n in zip(starts, lengths):
        rows = slice(s, s + n)
        assert len(np.unique(batch["writer"][rows])) == 1  # one writer per episode
        seq = batch["seq"][rows]
        np.testing.assert_array_equal(seq, np.arange(seq[0], seq[0] + n))  # contiguous
    first = batch["seq"][starts]
    assert sorted(first.tolist()) == [59, 59, 60, 60, 70, 70, 80, 80, 90, 90, 100, 100]
    view = gr.SequenceDataSource(src, {"seq": [-3, 0, 2], "writer": [-3, 0, 2]}, pad="edge")
    got = view.read_batch(np.arange(len(view)))
    for k in ("seq", "writer"):
        assert got[k].shape == (len(view), 3)
    assert (got["writer"] == got["writer"][:, :1]).all()  # no window crosses writers
    assert got["seq"].min() >= 59  # no window reaches an evicted row
    for i, w in enumerate(ws):
        w.append(_steps(i, 104, 30))
        w.flush()
    assert view.refresh() > 0
    got = view.read_batch(np.arange(len(view)))
    assert got["seq"].min() >= 134 - 45 and (got["writer"] == got["writer"][:, :1]).all()
    for w in ws:
        w.close()
