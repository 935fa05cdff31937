"""The grain options a loader uses when the caller passes none: one place for both loaders.

``make_data_loader`` (epochs) and the mixture/replay loader of ``grain_replay.sampling``
shard and read the same way by default.
"""

from __future__ import annotations

from typing import Any

import grain

__all__ = ["default_read_options", "default_shard_options"]


def default_read_options(worker_count: int) -> grain.ReadOptions:
    """``grain.ReadOptions`` with no read-ahead threads, in the consuming process and in workers."""
    del worker_count  # the same in the consuming process and in each worker
    # Measured on 2 cores: read-ahead threads cost more in handoffs and GIL
    # contention than they hide for page-cached reads; workers already read ahead
    # worker_buffer_size batches each, and the consuming process reads inside next(),
    # which sharded_device_put calls on its own thread.
    return grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def default_shard_options() -> Any:
    """One shard per JAX process, dropping the remainder so every process takes equal steps."""
    return grain.sharding.ShardByJaxProcess(drop_remainder=True)
