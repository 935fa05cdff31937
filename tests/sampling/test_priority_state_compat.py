"""States saved before the slot-map refactor restore and draw exactly what they drew then.

``data/priority_states_v3.json`` holds, for a plain and a bounded two-writer store,
the iterator state (version 3, priorities of version 1 and 2) that the code before
``PrioritySampler`` took a slot map saved after 6 batches with updates, and the 4
batches it drew next (same updates). The stores are rebuilt here, row for row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr

DATA = Path(__file__).parent / "data" / "priority_states_v3.json"


def _rows(start: int, n: int) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n, dtype=np.int64)
    return {"id": i, "obs": (i[:, None] * np.arange(1, 4)).astype(np.float32)}


def _store(root: Path, name: str) -> str:
    path = str(root / name)
    if name == "plain":
        gr.write_npy(path, _rows(0, 300))
        return path
    for k in range(2):  # ordinals 0 and 1, in this order; 64 live rows each
        with gr.ReplayWriter(
            path, "npy", capacity=64, writer_id=f"actor-{k}", segment_rows=16
        ) as w:
            w.append(_rows(1000 * k, 150))
    return path


@pytest.mark.parametrize("name", ["plain", "bounded"])
def test_a_state_saved_before_restores_the_same_draws(tmp_path: Path, name: str) -> None:
    saved = json.loads(DATA.read_text())[name]
    path = _store(tmp_path, name)
    state = saved["state"].replace(json.dumps(saved["path"])[1:-1], json.dumps(path)[1:-1])
    sampling = gr.PrioritizedReplay(alpha=0.7, beta=0.5, refresh_every=4)
    loader = gr.make_data_loader(gr.open_source(path), batch_size=16, seed=3, sampling=sampling)
    with iter(loader) as it:
        it.set_state(state.encode())
        for s, want in enumerate(saved["after"], start=6):
            batch = next(it)
            np.testing.assert_array_equal(np.asarray(batch.index), want)
            it.update_priorities(batch.index, 1.0 + (np.asarray(batch.index) % 7) * (s + 1))
    version = json.loads(state)["priorities"]["version"]
    assert version["data"] == ("AQAAAAAAAAA=" if name == "plain" else "AgAAAAAAAAA=")
