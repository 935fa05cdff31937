"""Two JAX processes (gloo over localhost): a mixture and prioritized replay, each its own share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from procs import run_workers

import grain_replay as gr

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "multihost_sampling_worker.py"


def _run_job(args: list[str], out_dir: Path) -> list[dict[str, Any]]:
    return run_workers(WORKER, 2, out_dir, *args)


# In-process draws (workers=0) under -m slow: the 2-process job's own part (each process
# draws its share of the mixture and of the prioritized store) is the same with loader
# workers, and tests/sampling/ covers drawing in process.
@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_two_processes_mix_and_prioritize_their_own_shares(tmp_path: Path, workers: int) -> None:
    gr.write_npy(tmp_path / "a", {"id": np.arange(48, dtype=np.int64)})
    gr.write_npy(tmp_path / "b", {"id": 1000 + np.arange(48, dtype=np.int64)})
    args = [f"--a={tmp_path / 'a'}", f"--b={tmp_path / 'b'}", f"--workers={workers}"]
    results = _run_job(args, tmp_path)

    # Mixture: 6 steps x 4 rows of each source x 2 processes = 48 = one epoch of each,
    # shared without overlap.
    mixed = [np.array(r["mixture"]) for r in results]
    for lo, hi in ((0, 48), (1000, 1048)):
        parts = [set(m[(m >= lo) & (m < hi)].tolist()) for m in mixed]
        assert not parts[0] & parts[1]
        assert parts[0] | parts[1] == set(range(lo, hi))
        assert all(((m >= lo) & (m < hi)).sum(axis=1).tolist() == [4] * 6 for m in mixed)

    # Prioritized: process p draws only rows i with i % 2 == p, and its updates (given
    # as globally sharded jax arrays) shape its later draws (row priority i % 4 + 1).
    for p, r in enumerate(results):
        drawn = np.array(r["drawn"])
        assert (drawn % 2 == p).all(), drawn
        late = drawn[4:].ravel()
        # weights are (p_min / p_i) ** beta (beta 1), p_min over this process's share: in
        # the last batch, rows updated early (in the first two batches, so before any lag
        # and read-ahead ran out) all have weight * priority == p_min
        w, rows = np.array(r["w"][-1]), drawn[-1]
        assert ((w > 0) & (w <= 1)).all()
        early = np.isin(rows, drawn[:2])
        assert early.any()
        products = w[early] * (rows[early] % 4 + 1)
        np.testing.assert_allclose(products, products[0], rtol=1e-5)
        counts = np.bincount(late % 4, minlength=4)
        assert counts[p + 2] > counts[p], counts  # priority p+3 over p+1
