"""grain_replay: replay and offline-RL data from HDF5, .npy and Zarr into grain and JAX."""

from __future__ import annotations

from typing import Any

from grain_replay._flags import ensure_absl_flags_parsed
from grain_replay.errors import (
    ArgumentTypeError,
    BatchShardingError,
    CheckpointMismatchError,
    FrameTimestampError,
    GrainReplayError,
    InvalidArgumentError,
    InvalidPrefetchError,
    InvalidPriorityError,
    InvalidSamplingError,
    InvalidShardingError,
    InvalidStoreError,
    InvalidTreeError,
    LeafMismatchError,
    MissingDependencyError,
    PriorityIndexError,
    RecordIndexError,
    ReferenceRefusedError,
    ResidentBudgetError,
    ResidentUnsupportedError,
    StoreAccessError,
    StoreExistsError,
    StoreNotFoundError,
    StoreUnreachableError,
    UnfinishedWriteError,
    UnknownLeafError,
    UnsupportedStateError,
    WorkerDiedError,
    WriterBusyError,
)
from grain_replay.layout import LeafSpec
from grain_replay.sources import (
    HDF5DataSource,
    NpyDataSource,
    ReplaySource,
    ZarrDataSource,
    open_source,
)
from grain_replay.writers import (
    ReplayWriter,
    write,
    write_hdf5,
    write_npy,
    write_zarr,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # sources
    "HDF5DataSource",
    "NpyDataSource",
    "ZarrDataSource",
    "ReplaySource",
    "open_source",
    "LeafSpec",
    # writers
    "write",
    "write_hdf5",
    "write_npy",
    "write_zarr",
    "ReplayWriter",
    "WriterBusyError",
    # pipeline (imported lazily: grain and jax are slow to import)
    "make_data_loader",
    "replay_dataset",
    "LoaderOptions",
    "sharded_device_put",
    "shutdown_distributed",
    # sampling: mixtures and replay (grain_replay.sampling)
    "UniformReplay",
    "PrioritizedReplay",
    "Sampled",
    # RL views (grain_replay.rl)
    "EpisodeIndex",
    "build_episode_index",
    "WindowDataSource",
    "NStepDataSource",
    "TransitionDataSource",
    "MinariDataSource",
    "D4RLDataSource",
    "LeRobotDataSource",
    "SequenceDataSource",
    # statistics (grain_replay.stats)
    "compute_stats",
    # errors
    "GrainReplayError",
    "StoreNotFoundError",
    "StoreExistsError",
    "InvalidTreeError",
    "InvalidStoreError",
    "UnfinishedWriteError",
    "RecordIndexError",
    "BatchShardingError",
    "FrameTimestampError",
    "ResidentBudgetError",
    "ResidentUnsupportedError",
    "WorkerDiedError",
    "MissingDependencyError",
    "StoreAccessError",
    "StoreUnreachableError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UnknownLeafError",
    "CheckpointMismatchError",
    "ReferenceRefusedError",
    "InvalidShardingError",
    "InvalidPrefetchError",
    "UnsupportedStateError",
    "RetryOptions",
    "InvalidSamplingError",
    "LeafMismatchError",
    "InvalidPriorityError",
    "PriorityIndexError",
]

_LAZY = {
    "make_data_loader": "grain_replay.pipeline.loader",
    "replay_dataset": "grain_replay.pipeline.loader",
    "LoaderOptions": "grain_replay.pipeline.loader",
    "RetryOptions": "grain_replay.remote",
    "sharded_device_put": "grain_replay.pipeline.device_put",
    "shutdown_distributed": "grain_replay.pipeline.distributed",
    "UniformReplay": "grain_replay.sampling",
    "PrioritizedReplay": "grain_replay.sampling",
    "Sampled": "grain_replay.sampling",
    "compute_stats": "grain_replay.stats",
    **{
        name: "grain_replay.rl"
        for name in (
            "EpisodeIndex",
            "build_episode_index",
            "WindowDataSource",
            "NStepDataSource",
            "TransitionDataSource",
            "MinariDataSource",
            "D4RLDataSource",
            "LeRobotDataSource",
            "SequenceDataSource",
        )
    },
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grain_replay' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


ensure_absl_flags_parsed()
