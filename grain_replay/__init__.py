"""grain_replay: replay and offline-RL data from HDF5, .npy and Zarr into grain and JAX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grain_replay.errors import (
    ArgumentTypeError,
    BackgroundWriteError,
    BatchShardingError,
    CheckpointMismatchError,
    EvictedRowError,
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
    RateLimitTimeoutError,
    RecordIndexError,
    ReferenceRefusedError,
    ReplayCheckpointError,
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
from grain_replay.pipeline.flags import ensure_absl_flags_parsed

if TYPE_CHECKING:  # the names below load on first use (see __getattr__)
    from grain_replay.datasets import (
        D4RLDataSource,
        LeRobotDataSource,
        MinariDataSource,
        RLDSDataSource,
        TorchRLDataSource,
        VaultDataSource,
    )
    from grain_replay.device.distributed import shutdown_distributed
    from grain_replay.device.put import sharded_device_put
    from grain_replay.device.replay import DeviceReplay
    from grain_replay.loading import make_data_loader, replay_dataset
    from grain_replay.opening import open_source
    from grain_replay.pipeline.batches import LoaderOptions
    from grain_replay.remote import RetryOptions
    from grain_replay.rl import (
        EpisodeIndex,
        NStepDataSource,
        SequenceDataSource,
        TransitionDataSource,
        WindowDataSource,
        build_episode_index,
    )
    from grain_replay.sampling import PrioritizedReplay, Sampled, UniformReplay
    from grain_replay.sources import (
        HDF5DataSource,
        NpyDataSource,
        NpzDataSource,
        ObjectPartsDataSource,
        PartsDataSource,
        ReplaySource,
        ZarrDataSource,
    )
    from grain_replay.stats import compute_stats
    from grain_replay.store.layout import LeafSpec
    from grain_replay.store.rate_limit import RateLimit
    from grain_replay.store.watermark import Watermark, read_watermark
    from grain_replay.writers import (
        ReplayWriter,
        truncate_to_watermark,
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
    "NpzDataSource",
    "ObjectPartsDataSource",
    "PartsDataSource",
    "TorchRLDataSource",
    "VaultDataSource",
    "ZarrDataSource",
    "RLDSDataSource",
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
    "EvictedRowError",
    "BackgroundWriteError",
    "RateLimitTimeoutError",
    # pipeline (imported lazily: grain and jax are slow to import)
    "make_data_loader",
    "replay_dataset",
    "LoaderOptions",
    "sharded_device_put",
    "shutdown_distributed",
    "DeviceReplay",
    # sampling: mixtures and replay (grain_replay.sampling)
    "UniformReplay",
    "PrioritizedReplay",
    "Sampled",
    "RateLimit",
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
    "ReplayCheckpointError",
    "Watermark",
    "read_watermark",
    "truncate_to_watermark",
]

# Public name -> the module that defines it, imported on first use: a spawned
# loader worker imports this package and only the modules its reads need.
_LAZY = {
    "LeafSpec": "grain_replay.store.layout",
    **{
        name: "grain_replay.sources"
        for name in (
            "HDF5DataSource",
            "NpyDataSource",
            "NpzDataSource",
            "ObjectPartsDataSource",
            "PartsDataSource",
            "ZarrDataSource",
            "ReplaySource",
        )
    },
    **{
        name: "grain_replay.datasets"
        for name in (
            "D4RLDataSource",
            "LeRobotDataSource",
            "MinariDataSource",
            "RLDSDataSource",
            "TorchRLDataSource",
            "VaultDataSource",
        )
    },
    "open_source": "grain_replay.opening",
    **{
        name: "grain_replay.writers"
        for name in (
            "ReplayWriter",
            "truncate_to_watermark",
            "write",
            "write_hdf5",
            "write_npy",
            "write_zarr",
        )
    },
    "make_data_loader": "grain_replay.loading",
    "replay_dataset": "grain_replay.loading",
    "LoaderOptions": "grain_replay.pipeline.batches",
    "RetryOptions": "grain_replay.remote",
    "sharded_device_put": "grain_replay.device.put",
    "DeviceReplay": "grain_replay.device.replay",
    "shutdown_distributed": "grain_replay.device.distributed",
    "UniformReplay": "grain_replay.sampling",
    "PrioritizedReplay": "grain_replay.sampling",
    "Sampled": "grain_replay.sampling",
    "RateLimit": "grain_replay.store.rate_limit",
    "compute_stats": "grain_replay.stats",
    "Watermark": "grain_replay.store.watermark",
    "read_watermark": "grain_replay.store.watermark",
    **{
        name: "grain_replay.rl"
        for name in (
            "EpisodeIndex",
            "build_episode_index",
            "WindowDataSource",
            "NStepDataSource",
            "TransitionDataSource",
            "SequenceDataSource",
        )
    },
}


def __getattr__(name: str) -> Any:
    import importlib.util

    module = _LAZY.get(name)
    if module is None:
        # gr.tree, gr.sources, ...: a subpackage or module reached as an attribute.
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'grain_replay' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


ensure_absl_flags_parsed()
