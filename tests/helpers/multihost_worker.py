"""One JAX process of the two-process test in tests/device/test_multihost.py.

Run as a script: ``python multihost_worker.py --port P --process-id I --store S
--batch-size B --out OUT.json``, with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
in the environment. The process joins a 2-process JAX job over gloo, reads its
share of one epoch through ``make_data_loader`` (default ``ShardByJaxProcess``)
and ``sharded_device_put``, checks every global batch, and writes what it saw as
JSON. Any failed check exits non-zero with the reason on stderr.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Iterator
from typing import Any

from multihost_common import join_job, local_rows, write_result

NUM_PROCESSES = 2


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _tap(loader: Any, seen: collections.deque[Any]) -> Iterator[Any]:
    """Yields the loader's host batches, keeping each one for the consumer to compare."""
    for batch in loader:
        seen.append(batch)
        yield batch


def run(args: argparse.Namespace) -> dict[str, Any]:
    jax = join_job(args.port, args.process_id, NUM_PROCESSES)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    import grain_replay as gr

    _check(jax.process_count() == NUM_PROCESSES, f"process_count {jax.process_count()}")
    _check(jax.process_index() == args.process_id, f"process_index {jax.process_index()}")
    _check(jax.device_count() == 8, f"device_count {jax.device_count()}, want 8")
    _check(jax.local_device_count() == 4, f"local_device_count {jax.local_device_count()}")

    b = args.batch_size
    src = gr.open_source(args.store)
    loader = gr.make_data_loader(src, batch_size=b, num_epochs=1, seed=0)
    host_batches: collections.deque[Any] = collections.deque()
    total_sum = jax.jit(lambda x: jnp.sum(x))
    local_ids: list[list[int]] = []
    global_ids: list[list[int]] = []
    with gr.sharded_device_put(_tap(loader, host_batches)) as batches:
        for step, batch in enumerate(batches):
            host = host_batches.popleft()
            ids = batch["id"]
            _check(ids.shape == (NUM_PROCESSES * b,), f"step {step}: id shape {ids.shape}")
            _check(batch["obs"].shape == (NUM_PROCESSES * b, 3), f"obs shape {batch['obs'].shape}")
            _check(isinstance(ids.sharding, NamedSharding), f"sharding {ids.sharding!r}")
            _check(len(ids.sharding.device_set) == 8, f"sharded over {ids.sharding.device_set}")
            _check(not ids.is_fully_addressable, "global array should span both processes")
            mine = local_rows(ids)
            np.testing.assert_array_equal(mine, host["id"])

            # A collective: the jitted sum reduces over all 8 devices of both processes.
            got = float(total_sum(batch["reward"]).addressable_data(0))
            full_ids = np.asarray(multihost_utils.process_allgather(ids, tiled=True))
            full_reward = np.asarray(multihost_utils.process_allgather(batch["reward"], tiled=True))
            _check(full_ids.shape == (NUM_PROCESSES * b,), f"gathered {full_ids.shape}")
            _check(set(host["id"].tolist()) <= set(full_ids.tolist()), "host ids not in global")
            np.testing.assert_allclose(full_reward, full_ids.astype(np.float32) * 0.5)
            other = np.setdiff1d(full_ids, host["id"])
            want = float(host["reward"].sum(dtype=np.float64)) + float(other.sum()) * 0.5
            _check(abs(got - want) <= 1e-3 * max(1.0, abs(want)), f"sum {got} != {want}")
            local_ids.append(host["id"].tolist())
            global_ids.append(full_ids.tolist())
    multihost_utils.sync_global_devices("multihost_worker_done")
    result = {
        "process_index": jax.process_index(),
        "pid": os.getpid(),
        "num_batches": len(local_ids),
        "local_ids": local_ids,
        "global_ids": global_ids,
    }
    gr.shutdown_distributed()  # not a bare jax.distributed.shutdown(): see its docstring
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run(args)
    write_result(args.out, result)
    print(f"process {args.process_id}: {result['num_batches']} batches", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
