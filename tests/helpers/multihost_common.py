"""What every JAX process of the multi-process tests does alike: join the job, read its rows
of a global array, write its result (the worker scripts beside this module import it)."""

from __future__ import annotations

import json
import os
from typing import Any


def join_job(
    port: int, process_id: int, num_processes: int, *, timeout: int = 120, local_devices: int = 4
) -> Any:
    """Joins the JAX job coordinated at ``127.0.0.1:port`` over gloo; returns ``jax``.

    Call it before anything imports jax: XLA_FLAGS (``local_devices`` CPU devices
    unless the environment says otherwise) must be set by then.
    """
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={local_devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout,
    )
    return jax


def local_rows(array: Any) -> Any:
    """This process's rows of a globally sharded ``jax.Array``, in order, as numpy."""
    import numpy as np

    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def write_result(out: str, result: dict[str, Any]) -> None:
    """Writes ``result`` as JSON to ``out`` atomically (the test reads it once the job ends)."""
    tmp = out + ".partial"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out)
