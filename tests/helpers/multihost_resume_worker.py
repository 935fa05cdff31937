"""One JAX process of the 2- and 4-process tests in tests/device/test_multihost_scale.py.

Run as a script: ``python multihost_resume_worker.py --port P --process-id I
--num-processes K --store S --batch-size B --num-epochs E --out OUT.json
[--save-at STEP --state-dir DIR] [--resume-dir DIR] [--resident [--window W]]``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` in the environment.

The process joins a K-process JAX job over gloo and reads the store through
``make_data_loader`` (default ``ShardByJaxProcess``) and ``sharded_device_put``
(default prefetch, so batches are in flight when the state is taken). It checks
every global batch's shape and sharding, consumes it in a jitted step (sums
over all devices of all processes) and records the global batch's record ids.
With ``--save-at k`` it writes the wrapper's ``get_state()`` after handing out
batch k to ``DIR/state.<process_index>``; with ``--resume-dir`` it restores that
state before the first batch (``state.<process_index mod saved count>`` when the
job was saved with another number of processes). Any failed check exits non-zero with the reason.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from multihost_common import join_job, local_rows, write_result

LOCAL_DEVICES = 2


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _state_file(directory: str, process_id: int) -> str:
    """``state.<process_id>``; after a change of process count, ``state.<id mod saved count>``.

    Any saved process's state resumes every process of the same global stream.
    """
    saved = sorted(
        (name for name in os.listdir(directory) if name.split(".")[-1].isdigit()),
        key=lambda name: int(name.split(".")[-1]),
    )
    _check(bool(saved), f"no state.<i> file in {directory}")
    return os.path.join(directory, saved[process_id % len(saved)])


def run(args: argparse.Namespace) -> dict[str, Any]:
    jax = join_job(args.port, args.process_id, args.num_processes, local_devices=LOCAL_DEVICES)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    import grain_replay as gr

    k = args.num_processes
    _check(jax.process_count() == k, f"process_count {jax.process_count()}, want {k}")
    _check(jax.process_index() == args.process_id, f"process_index {jax.process_index()}")
    _check(jax.local_device_count() == LOCAL_DEVICES, f"local {jax.local_device_count()}")
    _check(jax.device_count() == k * LOCAL_DEVICES, f"device_count {jax.device_count()}")

    b = args.batch_size
    src = gr.open_source(args.store)
    loader = gr.make_data_loader(src, batch_size=b, num_epochs=args.num_epochs, seed=3)
    consume = jax.jit(lambda ids, obs: (jnp.sum(ids), jnp.sum(obs[:, 0])))
    local_ids: list[list[int]] = []
    global_ids: list[list[int]] = []
    saved = False
    if args.window is not None:  # batches a resident dispatch gathers (default 64)
        from grain_replay.device import resident

        resident._MAX_WINDOW = args.window
    with gr.sharded_device_put(loader, resident=args.resident) as batches:
        if args.resume_dir:
            with open(_state_file(args.resume_dir, args.process_id), "rb") as f:
                batches.set_state(f.read())
        for step, batch in enumerate(batches):
            ids, obs = batch["id"], batch["obs"]
            _check(ids.shape == (k * b,), f"step {step}: id shape {ids.shape}, want {(k * b,)}")
            _check(obs.shape == (k * b, 3), f"step {step}: obs shape {obs.shape}")
            for leaf in (ids, obs):
                _check(isinstance(leaf.sharding, NamedSharding), f"sharding {leaf.sharding!r}")
                _check(leaf.sharding.spec[0] == "data", f"spec {leaf.sharding.spec}")
                _check(
                    len(leaf.sharding.device_set) == k * LOCAL_DEVICES,
                    f"sharded over {len(leaf.sharding.device_set)} devices",
                )
                _check(not leaf.is_fully_addressable, "a global array should span every process")
                shards = leaf.addressable_shards
                _check(len(shards) == LOCAL_DEVICES, f"{len(shards)} local shards")
                _check(
                    all(s.data.shape[0] == b // LOCAL_DEVICES for s in shards),
                    f"local shard rows {[s.data.shape for s in shards]}",
                )
            local = local_rows(ids)
            full = np.asarray(multihost_utils.process_allgather(ids, tiled=True))
            full_obs = np.asarray(multihost_utils.process_allgather(obs, tiled=True))
            _check(full.shape == (k * b,), f"gathered {full.shape}")
            # Rows of process p are the p-th slice of the global batch.
            p = args.process_id
            np.testing.assert_array_equal(full[p * b : (p + 1) * b], local)
            np.testing.assert_array_equal(full_obs[:, 0], full.astype(np.float32))
            id_sum, obs_sum = consume(ids, obs)
            _check(int(id_sum.addressable_data(0)) == int(full.sum()), "jitted id sum")
            want = float(full.astype(np.float64).sum())
            got = float(obs_sum.addressable_data(0))
            _check(abs(got - want) <= 1e-6 * max(1.0, want), f"jitted obs sum {got} != {want}")
            local_ids.append(local.tolist())
            global_ids.append(full.tolist())
            if args.save_at is not None and step + 1 == args.save_at:
                os.makedirs(args.state_dir, exist_ok=True)
                path = os.path.join(args.state_dir, f"state.{args.process_id}")
                with open(path + ".partial", "wb") as f:
                    f.write(batches.get_state())
                os.replace(path + ".partial", path)
                saved = True
    _check(args.save_at is None or saved, f"stream ended before step {args.save_at}")
    multihost_utils.sync_global_devices("multihost_resume_worker_done")
    result = {
        "process_index": jax.process_index(),
        "pid": os.getpid(),
        "local_ids": local_ids,
        "global_ids": global_ids,
    }
    gr.shutdown_distributed()  # not a bare jax.distributed.shutdown(): see its docstring
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--num-epochs", type=int, default=1)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--state-dir")
    parser.add_argument("--resume-dir")
    parser.add_argument("--resident", action="store_true", help="device-resident replay")
    parser.add_argument(
        "--window", type=int, help="batches one resident dispatch gathers (default: 64)"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run(args)
    write_result(args.out, result)
    print(f"process {args.process_id}: {len(result['global_ids'])} batches", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
