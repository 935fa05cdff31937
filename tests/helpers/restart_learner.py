"""Child process of the whole-run restart test: a learner that checkpoints, then dies.

    python restart_learner.py STORE CHECKPOINT WORKERS K M REFERENCE

Draws ``K`` batches of a uniform replay loader over STORE (:func:`make_batches`),
saves its iterator as the Orbax item ``data`` of step ``K`` under CHECKPOINT,
draws ``M`` more batches and saves their rows (``seq``, ``tag``) to REFERENCE
(``.npy``): what the uninterrupted run drew after the checkpoint. Then it goes
on drawing (and would see rows written meanwhile) until killed. Markers on
stdout: ``saved``, then ``reference``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

BATCH = 8
SEED = 7


def make_batches(store: str, workers: int) -> Any:
    """The learner's iterator: the same in the first run and in the restarted one."""
    import grain_replay as gr

    loader = gr.make_data_loader(
        gr.open_source(store, keys=["seq", "tag", "vec"]),
        batch_size=BATCH,
        seed=SEED,
        sampling=gr.UniformReplay(refresh_every=1),
        worker_count=workers,
    )
    return iter(loader)


def rows_of(batch: Any) -> np.ndarray:
    """``(seq, tag)`` of each row of a batch: which row it is, of which writer and run."""
    return np.stack([np.asarray(batch["seq"]), np.asarray(batch["tag"])], axis=1)


def checkpoint_manager(directory: str) -> Any:
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(directory), item_names=("data",))


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def main() -> None:
    store, ckpt, workers, k, m, reference = sys.argv[1:7]
    sys.path.insert(0, os.getcwd())
    import grain
    import orbax.checkpoint as ocp

    it = make_batches(store, int(workers))
    for _ in range(int(k)):
        next(it)
    with checkpoint_manager(ckpt) as mgr:
        mgr.save(int(k), args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mgr.wait_until_finished()
    _say("saved")
    drawn = [rows_of(next(it)) for _ in range(int(m))]
    np.save(reference, np.stack(drawn))
    _say("reference")
    while True:  # the run goes on until it is killed
        next(it)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
