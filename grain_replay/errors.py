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
    "WorkerDiedError",
    "MissingDependencyError",
    "StoreAccessError",
    "StoreUnreachableError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "UnknownLeafError",
]


class GrainReplayError(Exception):
    """Base class of every error grain_replay raises on purpose."""


class StoreNotFoundError(GrainReplayError, FileNotFoundError):
    """The store (file, directory or leaf) does not exist."""


class StoreExistsError(GrainReplayError, FileExistsError):
    """The destination exists and ``overwrite=True`` was not given."""


class InvalidTreeError(GrainReplayError, TypeError):
    """The tree given to a writer is not a pytree of numeric arrays."""


class InvalidArgumentError(GrainReplayError, ValueError):
    """An argument has a value the function does not accept (the store is fine)."""


class InvalidArgumentTypeError(GrainReplayError, TypeError):
    """An argument has a type the function does not accept (the store is fine)."""


class UnknownLeafError(InvalidArgumentError, KeyError):
    """An argument (``keys=``, ``obs_key=``, ...) names a leaf the store does not have."""

    __str__ = Exception.__str__  # the message as written, not KeyError's repr of it


class InvalidStoreError(GrainReplayError, ValueError):
    """The store on disk is malformed, inconsistent or unsupported."""


class UnfinishedWriteError(InvalidStoreError):
    """The store was left by a write that never committed its metadata."""


class RecordIndexError(GrainReplayError, IndexError):
    """A record index is outside ``[-N, N)``."""


class BatchShardingError(GrainReplayError, ValueError):
    """A batch does not split evenly over the devices it is sharded across."""


class WorkerDiedError(GrainReplayError, RuntimeError):
    """A loader worker process exited while the consumer waited for its batch."""


class MissingDependencyError(GrainReplayError, ImportError):
    """An optional dependency is not installed."""


class StoreAccessError(InvalidStoreError, PermissionError):
    """A remote store refused the credentials given, or none were found."""


class StoreUnreachableError(InvalidStoreError, ConnectionError):
    """A remote store's endpoint cannot be reached, or kept failing after retries."""
