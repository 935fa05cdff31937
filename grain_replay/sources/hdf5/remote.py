"""HDF5 files at fsspec URLs: a retrying file object for h5py, and clear errors."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from grain_replay import remote as remote_lib
from grain_replay.errors import GrainReplayError, InvalidStoreError, StoreNotFoundError
from grain_replay.remote import Remote
from grain_replay.sources.base import Layout

if TYPE_CHECKING:
    from grain_replay.sources.hdf5.source import HDF5DataSource

__all__ = [
    "RetryingFile",
    "inspect_remote",
    "new_remote",
    "open_remote_file",
    "reraise_file_errors",
]

T = TypeVar("T")

# -- file objects (HDF5 over fsspec) ---------------------------------------------------

# h5py reads metadata in small pieces and chunks in whole pieces: a cache of
# fixed blocks serves the former with few GETs without fetching 50 MiB ahead
# (s3fs's default readahead block) on every random chunk read.
FILE_BLOCK_SIZE = 256 * 2**10
FILE_CACHE_BLOCKS = 64


class RetryingFile:
    """A read-only fsspec file object whose reads retry transient failures.

    h5py turns an exception raised inside a read into its own ``OSError``;
    :attr:`last_error` keeps the GrainReplayError so readers can re-raise it.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any], remote: Remote):
        import fsspec

        opts = dict(storage_options)
        fs, path = fsspec.url_to_fs(url, **opts)
        kwargs: dict[str, Any] = {}
        if "default_block_size" not in opts and "block_size" not in opts:
            kwargs["block_size"] = FILE_BLOCK_SIZE
        if "default_cache_type" not in opts and "cache_type" not in opts:
            kwargs["cache_type"] = "blockcache"
            kwargs["cache_options"] = {"maxblocks": FILE_CACHE_BLOCKS}
        self._remote = remote
        # Per thread: h5py calls read() in the thread that called into h5py, and
        # another thread's failure must not be reported as this thread's.
        self._errors = threading.local()
        self._f = remote.call(lambda: fs.open(path, "rb", **kwargs), "the file")
        self._pos = 0

    @property
    def last_error(self) -> GrainReplayError | None:
        """The failure of this thread's last read through h5py, if it failed."""
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


def reraise_file_errors(
    read_blocks: Callable[[Any], T], fileobj: RetryingFile
) -> Callable[[Any], T]:
    """Wraps an h5py chunk reader so that a remote read failure surfaces as itself."""

    def read(chunk_ids: Any) -> T:
        fileobj.last_error = None
        try:
            return read_blocks(chunk_ids)
        except Exception as e:
            if fileobj.last_error is not None:
                raise fileobj.last_error from e
            raise

    return read


def new_remote(source: HDF5DataSource) -> Remote:
    return remote_lib.Remote(source.path, source._storage_options, source._retry, kind="HDF5 file")


# h5py files opened over Python file objects, closed at interpreter exit: HDF5's
# own exit hook would otherwise close them after Python is finalized, and h5py's
# file-object driver then calls into a dead interpreter (a segfault at exit).
_REMOTE_FILES: weakref.WeakSet[Any] = weakref.WeakSet()
_REMOTE_FILES_LOCK = threading.Lock()
_EXIT_HOOK: list[bool] = []


def _close_remote_files() -> None:
    for f in list(_REMOTE_FILES):
        with contextlib.suppress(Exception):
            f.close()


def _track_remote_file(f: Any) -> Any:
    with _REMOTE_FILES_LOCK:
        if not _EXIT_HOOK:
            atexit.register(_close_remote_files)
            _EXIT_HOOK.append(True)
        _REMOTE_FILES.add(f)
    return f


def open_remote_file(h5py: Any, fileobj: Any, remote: Any) -> Any:
    """``h5py.File`` over an fsspec file object; a failed read surfaces as itself."""
    fileobj.last_error = None
    try:
        return _track_remote_file(h5py.File(fileobj, "r"))
    except Exception as e:
        if fileobj.last_error is not None:
            raise fileobj.last_error from e
        raise InvalidStoreError(
            f"{remote.shown}: h5py cannot open the file ({type(e).__name__}: {e}). It may not "
            "be an HDF5 file, or be truncated. Fix: check the URL, or re-create the file."
        ) from e


def inspect_remote(source: HDF5DataSource, h5py: Any) -> Layout:
    remote = new_remote(source)
    opts = remote_lib.effective_storage_options(source.path, source._storage_options)
    try:
        fileobj = RetryingFile(source.path, opts, remote)
    except StoreNotFoundError as e:
        cause = e.__cause__ or e
        raise remote.not_found(opts, cause) from cause
    try:
        with open_remote_file(h5py, fileobj, remote) as f:
            fileobj.last_error = None
            try:
                return source._layout_of(f)
            except (OSError, ValueError) as e:
                if isinstance(e, InvalidStoreError):
                    raise
                if fileobj.last_error is not None:
                    raise fileobj.last_error from e
                raise
    finally:
        fileobj.close()
