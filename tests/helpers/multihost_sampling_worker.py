"""One JAX process of tests/device/test_multihost_sampling.py: a mixture and prioritized replay.

Run as ``python multihost_sampling_worker.py --port P --process-id I --a A --b B --out OUT``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``. The process joins a
2-process JAX job over gloo, reads a mixture of stores A and B and prioritized
batches of A through ``sharded_device_put``, gives priorities back as globally
sharded jax arrays, and writes what it saw as JSON.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from multihost_common import join_job, local_rows, write_result

NUM_PROCESSES = 2


def run(args: argparse.Namespace) -> dict[str, Any]:
    join_job(args.port, args.process_id, NUM_PROCESSES)
    from jax.experimental import multihost_utils

    import grain_replay as gr

    a, b = gr.NpyDataSource(args.a), gr.NpyDataSource(args.b)
    mixture: list[list[int]] = []
    loader = gr.make_data_loader(
        {"a": a, "b": b}, weights={"a": 0.5, "b": 0.5}, batch_size=8, source_leaf="src"
    )
    with gr.sharded_device_put(loader) as batches:
        for _ in range(6):
            batch = next(batches)
            assert batch["id"].shape == (16,), batch["id"].shape
            local = local_rows(batch["id"])
            mixture.append(local.tolist())

    drawn: list[list[int]] = []
    weights: list[list[float]] = []
    per = gr.PrioritizedReplay(alpha=1.0, beta=1.0)
    loader = gr.make_data_loader(a, batch_size=8, sampling=per, worker_count=args.workers)
    with gr.sharded_device_put(loader) as batches:
        for _ in range(8):
            batch = next(batches)
            assert not batch.index.is_fully_addressable
            local = local_rows(batch.index)
            drawn.append(local.tolist())
            w = local_rows(batch.weight)
            weights.append(w.tolist())
            # globally sharded arrays back: each process gives its own rows
            batches.update_priorities(batch.index, (batch.index % 4 + 1).astype("float32"))
    multihost_utils.sync_global_devices("multihost_sampling_done")
    gr.shutdown_distributed()  # not a bare jax.distributed.shutdown(): see its docstring
    return {"process_index": args.process_id, "mixture": mixture, "drawn": drawn, "w": weights}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run(args)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
