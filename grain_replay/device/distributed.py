"""Leaving a multi-process JAX job: every local device's collectives finished, then shutdown."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["shutdown_distributed"]


def _count_devices() -> jax.Array:
    """A sum over every device of every process, replicated on every device.

    Built from one single-device array per local device, so it needs no assumption
    about how the processes' devices are ordered in ``jax.devices()``.
    """
    mesh = Mesh(np.array(jax.devices()), ("all",))
    ones = jax.make_array_from_single_device_arrays(
        (jax.device_count(),),
        NamedSharding(mesh, PartitionSpec("all")),
        [jax.device_put(np.ones(1, np.int32), d) for d in jax.local_devices()],
    )
    return jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(ones)


def shutdown_distributed() -> None:
    """Ends this process's part of a multi-process JAX job so that no process stalls at exit.

    Call it once at the end of the job, in every process, after the last batch (leave
    ``sharded_device_put``'s ``with`` block first, so that no batch is still being
    put), instead of a bare ``jax.distributed.shutdown()``.

    Why: ``jax.experimental.multihost_utils.sync_global_devices`` (and
    ``process_allgather``, ``broadcast_one_to_all``) return once the first local
    device has its result; the collectives of the other local devices may still be
    running, on CPU even still connecting their gloo pairs. A process that then
    shuts down and exits leaves its peer's collective waiting for it: the peer's
    interpreter exit destroys jax's CPU client, which joins that thread, and hangs
    until gloo's timeout (about 150 s), or, if the peer exited first, this process
    does. See ``docs/multihost.md`` ("Leaving the job").

    What it does: one more collective, a sum over every device of every process,
    waited for on every local device (jax's CPU client runs a process's collectives
    one at a time, so every earlier one has finished too), then ``jax.distributed.shutdown()``,
    which waits for every process to arrive. After it, no process has a collective
    in flight, and each exits at once. In a single process (or when
    ``jax.distributed`` was never initialized) there are no peers: it only shuts
    ``jax.distributed`` down if it runs.

    Examples:
        >>> with gr.sharded_device_put(loader) as batches:  # doctest: +SKIP
        ...     for batch in batches:
        ...         state = train_step(state, batch)
        >>> gr.shutdown_distributed()  # doctest: +SKIP
    """
    if not jax.distributed.is_initialized():
        return
    if jax.process_count() > 1:
        _count_devices().block_until_ready()  # every local shard, not only the first
    jax.distributed.shutdown()
