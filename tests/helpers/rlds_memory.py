"""RSS of an RLDS reader over a dataset many times its memory bound (test and benchmark).

No cgroup limits the page cache here: the reader reads shards and its frame file with
``pread`` (nothing mapped), so its resident memory is its own (index, batches, decoder
buffers), which is what is sampled, after each batch, of this process and of grain's
worker processes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import psutil

import grain_replay as gr


def dataset_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if ".tfrecord-" in n
    )


def _rss(procs: list[psutil.Process]) -> list[float]:
    out = []
    for p in procs:
        try:
            out.append(p.memory_info().rss / 2**20)
        except psutil.Error:
            out.append(0.0)
    return out


def measure_rss(
    path: str,
    *,
    batch_size: int = 64,
    epochs: int = 1,
    workers: int = 0,
    warmup: int = 3,
    frame_cache_bytes: int = 0,
    keys: list[str] | None = None,
) -> dict[str, Any]:
    """Reads every step of the RLDS dataset ``path`` ``epochs`` times in random batches.

    Returns MiB: ``start`` (this process after the source and its index were made),
    ``warm`` (the largest process after ``warmup`` batches: decoders and pipeline
    buffers in place), ``peak`` and ``end`` (the largest process), ``growth`` (peak -
    warm), per process ``peaks``, and ``steps`` read.
    """
    me = psutil.Process()
    # Processes this process had already (a resource tracker; in a test run, what earlier
    # tests started and left exiting): not the reader's, left out of every number.
    before = {c.pid for c in me.children(recursive=True)}

    def processes() -> list[psutil.Process]:
        return [me, *(c for c in me.children(recursive=True) if c.pid not in before)]

    src = gr.RLDSDataSource(path, keys=keys, progress=False, frame_cache_bytes=frame_cache_bytes)
    start = me.memory_info().rss / 2**20
    loader = gr.make_data_loader(
        src, batch_size=batch_size, num_epochs=epochs, worker_count=workers, seed=0
    )
    warm = peak = 0.0
    peaks: list[float] = []
    steps = 0
    for i, batch in enumerate(loader):
        steps += len(next(iter(_leaves(batch))))
        now = _rss(processes())
        peaks = [max(a, b) for a, b in zip(peaks, now)] + now[len(peaks) :]
        if i + 1 == warmup:
            warm = max(now)
        elif i + 1 > warmup:
            peak = max(peak, max(now))
    end = max(_rss(processes()))
    return {
        "start": start,
        "warm": warm,
        "peak": max(peak, warm),
        "end": end,
        "growth": max(peak, warm) - warm,
        "peaks": peaks,
        "steps": steps,
    }


def _leaves(tree: Any) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in _leaves(v)]
    return [np.asarray(tree)]
