"""HDF5 files at fsspec URLs: h5py over a retrying file object, and clear errors."""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.remote import Remote, RetryingFile, RetryOptions, effective_storage_options
from grain_replay.store.optional import import_h5py

__all__ = ["inspect_remote", "open_remote", "reraise_file_errors"]

T = TypeVar("T")
# What a Remote names in its messages.
_KIND = "HDF5 file"


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


def _open_h5(fileobj: RetryingFile, remote: Remote) -> Any:
    """``h5py.File`` over an fsspec file object; a failed read surfaces as itself."""
    fileobj.last_error = None
    try:
        return _track_remote_file(import_h5py().File(fileobj, "r"))
    except Exception as e:
        if fileobj.last_error is not None:
            raise fileobj.last_error from e
        raise InvalidStoreError(
            f"{remote.shown}: h5py cannot open the file ({type(e).__name__}: {e}). It may not "
            "be an HDF5 file, or be truncated. Fix: check the URL, or re-create the file."
        ) from e


def open_remote(
    url: str, storage_options: Mapping[str, Any], retry: RetryOptions
) -> tuple[RetryingFile, Any]:
    """``(file object, h5py.File)`` of the HDF5 file at ``url``, every read retried.

    One per process: h5py reads through the file object under its global lock.
    """
    remote = Remote(url, storage_options, retry, kind=_KIND)
    fileobj = RetryingFile(url, effective_storage_options(url, storage_options), remote)
    try:
        return fileobj, _open_h5(fileobj, remote)
    except BaseException:
        fileobj.close()
        raise


def inspect_remote(
    url: str,
    storage_options: Mapping[str, Any],
    retry: RetryOptions,
    layout_of: Callable[[Any], T],
) -> T:
    """``layout_of(h5py_file)`` for the HDF5 file at ``url``, with errors naming the URL.

    Raises:
      StoreNotFoundError: saying whether the bucket or the key is missing.
      GrainReplayError: a remote failure (credentials, access, network), as itself.
    """
    remote = Remote(url, storage_options, retry, kind=_KIND)
    opts = effective_storage_options(url, storage_options)
    try:
        fileobj = RetryingFile(url, opts, remote)
    except StoreNotFoundError as e:
        cause = e.__cause__ or e
        raise remote.not_found(opts, cause) from cause
    try:
        with _open_h5(fileobj, remote) as f:
            fileobj.last_error = None
            try:
                return layout_of(f)
            except (OSError, ValueError) as e:
                if isinstance(e, InvalidStoreError):
                    raise
                if fileobj.last_error is not None:
                    raise fileobj.last_error from e
                raise
    finally:
        fileobj.close()
