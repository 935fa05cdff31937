"""What a user passed to ``gr.make_data_loader`` or ``gr.replay_dataset``, as both loaders take it.

The facade (``grain_replay.loading``) gathers its keyword arguments once; the epoch
loader (``pipeline/loader.py``) and the mixture/replay loader (``grain_replay.sampling``)
each read the fields they use and check them their own way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grain

__all__ = ["LoaderArguments"]


@dataclasses.dataclass(frozen=True)
class LoaderArguments:
    """The keyword arguments of ``gr.make_data_loader``, unchecked (each loader checks its own).

    ``gr.replay_dataset`` leaves ``worker_count``, ``operations`` and
    ``worker_buffer_size`` at their defaults.
    """

    batch_size: int
    shuffle: bool = True
    seed: int = 0
    num_epochs: int | None = 1
    drop_remainder: bool = True
    worker_count: int = 0
    shard_options: Any = None
    operations: Sequence[Any] = ()
    read_options: grain.ReadOptions | None = None
    worker_buffer_size: int = 2
    weights: Any = None
    sampling: Any = "epochs"
    keys: Sequence[str] | None = None
    source_leaf: str | None = None
