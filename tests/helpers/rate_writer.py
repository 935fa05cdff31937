"""Writer and learner processes of the rate-limit tests (started with multiprocessing spawn).

Neither imports jax at the top; the learner imports grain (through the loader).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

HELPERS = os.path.dirname(os.path.abspath(__file__))
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)

from parts_child import make_rows  # noqa: E402


def run_writer(
    path: str,
    writer_id: str,
    block: int,
    blocks: int,
    delay: float,
    report: str,
    capacity: int = 100_000,
    timeout: float | None = None,
    rate_limit: dict[str, Any] | None = None,
) -> None:
    """Appends ``blocks`` blocks of ``block`` rows, flushing each, sleeping ``delay`` between.
    ``rate_limit``: the keyword arguments of the ``gr.RateLimit`` it declares.

    Writes ``report`` (JSON) at the end: rows committed, seconds spent in flush(), and
    the seconds it waited for learners (``rate_limit_wait_s``), the error's class and
    message if a flush raised.
    """
    import grain_replay as gr

    out: dict[str, Any] = {"committed": 0, "flush_s": 0.0, "error": None}
    with gr.ReplayWriter(
        path,
        "npy",
        capacity=capacity,
        writer_id=writer_id,
        segment_rows=4096,
        rate_limit_timeout=timeout,
        rate_limit=None if rate_limit is None else gr.RateLimit(**rate_limit),
    ) as w:
        try:
            for b in range(blocks):
                w.append(make_rows(writer_id, b * block, block))
                t = time.perf_counter()
                w.flush()
                out["flush_s"] += time.perf_counter() - t
                if delay:
                    time.sleep(delay)
        except gr.GrainReplayError as e:
            out["error"] = [type(e).__name__, str(e)]
            out["pending"] = len(w) - w.committed
        out["committed"] = w.committed
        out["wait_s"] = w.rate_limit_wait_s
        _write(report, out)


def run_learner(path: str, batches: int, options: dict[str, Any], ready: str) -> None:
    """Hands out ``batches`` batches of 8 rows under ``UniformReplay(**options)``, writes
    ``ready``, then sleeps until killed (its progress file stays)."""
    import grain_replay as gr

    it = iter(
        gr.make_data_loader(
            gr.open_source(path),
            batch_size=8,
            num_epochs=None,
            sampling=gr.UniformReplay(**options),
        )
    )
    for _ in range(batches):
        next(it)
    time.sleep(0.1)  # the coalesced publish of the last hand-out
    _write(ready, {"pid": os.getpid()})
    while True:
        time.sleep(1)


def _write(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)
