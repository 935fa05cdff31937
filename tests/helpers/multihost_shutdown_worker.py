"""One JAX process of tests/device/test_multihost_shutdown.py: a job that only synchronizes.

Run as ``python multihost_shutdown_worker.py --port P --process-id I --num-processes K
--out OUT.json`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``. The process
joins a K-process JAX job over gloo, calls ``sync_global_devices`` (its first and only
collective: the one whose other local devices were still connecting their gloo pairs
when a bare ``jax.distributed.shutdown()`` let a process exit), leaves with
``gr.shutdown_distributed()`` and writes what it saw as JSON. The job's time is the test.
"""

from __future__ import annotations

import argparse
import sys

from multihost_common import join_job, write_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    jax = join_job(args.port, args.process_id, args.num_processes, timeout=60)
    from jax.experimental import multihost_utils

    import grain_replay as gr

    result = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    multihost_utils.sync_global_devices("multihost_shutdown_worker")
    gr.shutdown_distributed()
    result["initialized_after"] = jax.distributed.is_initialized()
    gr.shutdown_distributed()  # a second call finds nothing to shut down
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
