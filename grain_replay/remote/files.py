"""Remote file objects whose reads retry (RetryingFile)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from grain_replay.errors import GrainReplayError
from grain_replay.remote.retry import Remote
from grain_replay.store.optional import import_fsspec

__all__ = ["FILE_BLOCK_SIZE", "FILE_CACHE_BLOCKS", "RetryingFile"]

T = TypeVar("T")

# h5py reads metadata in small pieces and chunks in whole pieces: a cache of
# fixed blocks serves the former with few GETs without fetching 50 MiB ahead
# (s3fs's default readahead block) on every random chunk read.
FILE_BLOCK_SIZE = 256 * 2**10
FILE_CACHE_BLOCKS = 64


class RetryingFile:
    """A read-only fsspec file object whose reads retry transient failures.

    Libraries reading through it (h5py) may turn an exception raised inside a
    read into their own ``OSError``; :attr:`last_error` keeps the
    GrainReplayError so callers can re-raise it.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any], remote: Remote):
        fs, path = import_fsspec().url_to_fs(url, **storage_options)
        kwargs: dict[str, Any] = {}
        if "default_block_size" not in storage_options and "block_size" not in storage_options:
            kwargs["block_size"] = FILE_BLOCK_SIZE
        if "default_cache_type" not in storage_options and "cache_type" not in storage_options:
            kwargs["cache_type"] = "blockcache"
            kwargs["cache_options"] = {"maxblocks": FILE_CACHE_BLOCKS}
        self._remote = remote
        # Per thread: a library calls read() in the thread that called into it, and
        # another thread's failure must not be reported as this thread's.
        self._errors = threading.local()
        self._f = remote.call(lambda: fs.open(path, "rb", **kwargs), "the file")
        self._pos = 0

    @property
    def last_error(self) -> GrainReplayError | None:
        """The failure of this thread's last read, if it failed."""
        return getattr(self._errors, "error", None)

    @last_error.setter
    def last_error(self, error: GrainReplayError | None) -> None:
        self._errors.error = error

    def _retrying(self, fn: Callable[[], T], what: str) -> T:
        pos = self._pos

        def attempt() -> T:
            self._f.seek(pos)
            return fn()

        try:
            return self._remote.call(attempt, what)
        except GrainReplayError as e:
            self.last_error = e
            raise

    def read(self, size: int = -1) -> bytes:
        data = self._retrying(lambda: self._f.read(size), f"{size} bytes at offset {self._pos}")
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = self._retrying(lambda: self._f.readinto(view), f"{len(view)} bytes at {self._pos}")
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self._f.seek(offset, whence)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    @property
    def size(self) -> int:
        return int(self._f.size)

    def close(self) -> None:
        self._f.close()

    @property
    def closed(self) -> bool:
        return bool(self._f.closed)
