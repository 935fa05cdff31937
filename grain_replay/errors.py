"""Errors raised on purpose by grain_replay; each also subclasses the matching builtin."""

from __future__ import annotations

__all__ = [
    "GrainReplayError",
    "StoreNotFoundError",
    "StoreExistsError",
    "InvalidTreeError",
    "InvalidStoreError",
    "UnfinishedWriteError",
    "RecordIndexError",
    "BatchShardingError",
    "ResidentBudgetError",
    "ResidentUnsupportedError",
    "MissingDependencyError",
    "StoreAccessError",
    "StoreUnreachableError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UnknownLeafError",
    "CheckpointMismatchError",
    "ReferenceRefusedError",
    "WriterBusyError",
    "WorkerDiedError",
    "InvalidShardingError",
    "InvalidPrefetchError",
    "UnsupportedStateError",
    "FrameTimestampError",
    "InvalidSamplingError",
    "ReplayCheckpointError",
    "LeafMismatchError",
    "InvalidPriorityError",
    "PriorityIndexError",
    "EvictedRowError",
    "BackgroundWriteError",
    "RateLimitTimeoutError",
]


class GrainReplayError(Exception):
    """Base class of every error grain_replay raises on purpose."""


class StoreNotFoundError(GrainReplayError, FileNotFoundError):
    """The store (file, directory or leaf) does not exist."""


class StoreExistsError(GrainReplayError, FileExistsError):
    """The destination exists and ``overwrite=True`` was not given."""


class InvalidTreeError(GrainReplayError, TypeError):
    """The tree given to a writer is not a pytree of numeric arrays."""


class InvalidStoreError(GrainReplayError, ValueError):
    """The store on disk is malformed, inconsistent or unsupported."""


class UnfinishedWriteError(InvalidStoreError, FileNotFoundError):
    """The store was left by a write that never committed its metadata.

    Raised when a local path holds no store but a write of it left its ``.partial``
    beside it (``<path>.<pid>.<random>.partial``): ``gr.write`` and the writers
    make a store under that name and rename it into place only once complete,
    metadata last, so this is a write that crashed (or one still running). The
    message names the ``.partial`` and the fix: re-run the write, or delete it.
    A store of another library, without grain_replay metadata, still opens as a
    foreign store. Also a ``FileNotFoundError``, as :class:`StoreNotFoundError`
    (what was raised here before), since no committed store is at the path.
    """


class RecordIndexError(GrainReplayError, IndexError):
    """A record index is outside ``[-N, N)``."""


class BatchShardingError(GrainReplayError, ValueError):
    """A batch does not split evenly over the devices it is sharded across."""


class ResidentBudgetError(GrainReplayError, ValueError):
    """A store does not fit in the device-memory budget of device-resident replay.

    The store counts as the devices hold it: its leaves' 32-bit words in 128-lane lines,
    padded to a TPU's ``(8, 128)`` tiles, plus the batches gathered ahead.
    """


class ResidentUnsupportedError(GrainReplayError, TypeError):
    """Device-resident replay cannot reproduce what was asked (an iterator, host operations)."""


class WorkerDiedError(GrainReplayError, RuntimeError):
    """A loader worker process exited while the consumer waited for its batch."""


class MissingDependencyError(GrainReplayError, ImportError):
    """An optional dependency is not installed."""


class StoreAccessError(InvalidStoreError, PermissionError):
    """A remote store refused the credentials given, or none were found."""


class StoreUnreachableError(InvalidStoreError, ConnectionError):
    """A remote store's endpoint cannot be reached, or kept failing after retries."""


class FrameTimestampError(InvalidStoreError):
    """No video frame lies within ``tolerance_s`` of a frame's timestamp (LeRobot datasets)."""


class InvalidArgumentError(GrainReplayError, ValueError):
    """An argument's value is outside what the call accepts (an empty offset list, a bad mode)."""


class ArgumentTypeError(GrainReplayError, TypeError):
    """An argument has the wrong type (a float where offsets in steps are integers)."""


class UnknownLeafError(InvalidArgumentError, KeyError):
    """An argument (``keys=``, ``obs_key=``, ...) names a leaf the store does not have."""

    __str__ = Exception.__str__  # the message as written, not KeyError's repr of it


class CheckpointMismatchError(GrainReplayError, ValueError):
    """A loader state was saved by another stream, or cannot be resumed by this loader."""


class ReferenceRefusedError(InvalidStoreError):
    """A leaf refers outside its file (HDF5 external link, virtual dataset, external storage)
    and ``allow_external`` is False; never worth a retry."""


class WriterBusyError(GrainReplayError, BlockingIOError):
    """Another ReplayWriter holds the store, HDF5 refuses a second handle in this process, or
    a writer in another process holds an HDF5 file that HDF5 lets no reader open."""


class InvalidShardingError(GrainReplayError, TypeError):
    """The ``sharding`` argument is not a Mesh, a Sharding or a pytree of Shardings."""


class InvalidPrefetchError(GrainReplayError, ValueError):
    """``prefetch`` is not a non-negative integer."""


class UnsupportedStateError(GrainReplayError, TypeError):
    """The wrapped iterator has no ``get_state``/``set_state`` to checkpoint."""


class InvalidSamplingError(GrainReplayError, ValueError):
    """A sampling option (mixture weights, replay settings) is not valid."""


class ReplayCheckpointError(CheckpointMismatchError, InvalidSamplingError):
    """A replay iterator's checkpoint does not fit this iterator: another store, other
    sampling settings, or a store that lost rows the checkpoint drew from."""


class LeafMismatchError(GrainReplayError, ValueError):
    """The sources of a mixture do not hold the same leaves."""


class InvalidPriorityError(GrainReplayError, ValueError):
    """A priority update is negative, NaN, infinite or of the wrong length."""


class PriorityIndexError(GrainReplayError, IndexError):
    """A priority update names a row this iterator never handed out."""


class EvictedRowError(GrainReplayError, LookupError):
    """A row of a bounded store asked for by id was evicted before this reader opened it."""


class BackgroundWriteError(GrainReplayError, RuntimeError):
    """A queued append (device arrays) failed in the writer's background thread.

    Raised by the writer's next ``append``/``flush``/``close``; ``leaf`` names the
    leaf, and the original error is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, leaf: str = ""):
        super().__init__(message)
        self.leaf = leaf


class RateLimitTimeoutError(GrainReplayError, TimeoutError):
    """A rate-limited learner or writer waited past its timeout for the other side
    (``samples_per_insert``: see docs/rate_limits.md)."""
