"""Remote (fsspec URL) access: tuned options, retries with backoff, clear errors, file objects.

Everything here takes explicit arguments (URL, storage options, retry policy,
concurrency) and returns files, bytes or errors; it never sees a source.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import random
import re
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from grain_replay.errors import (
    ArgumentTypeError,
    GrainReplayError,
    InvalidArgumentError,
    InvalidStoreError,
    StoreAccessError,
    StoreNotFoundError,
    StoreUnreachableError,
)
from grain_replay.formats import import_fsspec

__all__ = [
    "DEFAULT_CONCURRENCY",
    "Limiter",
    "RetryOptions",
    "Remote",
    "RetryingFile",
    "classify",
    "effective_storage_options",
    "is_transient",
    "redact_url",
    "retry_options",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Requests in flight per process for a batch read (all leaves together).
DEFAULT_CONCURRENCY = 64

_BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2")


@dataclasses.dataclass(frozen=True)
class RetryOptions:
    """How remote reads retry transient failures (5xx, connection reset, timeouts).

    The wait before retry ``k`` (0-based) is ``min(max_backoff_s, backoff_s * 2**k)``,
    scaled by a random factor in ``[0.5, 1]`` so that many workers do not retry
    in lockstep.

    Args:
      retries: retries after the first attempt; 0 fails at the first error.
      backoff_s: wait before the first retry, in seconds.
      max_backoff_s: bound of a single wait, in seconds.

    Example:
      >>> gr.ZarrDataSource(url, storage_options=opts, retries=RetryOptions(retries=5))
    """

    retries: int = 3
    backoff_s: float = 0.1
    max_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise InvalidArgumentError(f"retries must be an int >= 0, got {self.retries!r}")
        if not self.backoff_s >= 0:
            raise InvalidArgumentError(f"backoff_s must be >= 0, got {self.backoff_s!r}")
        if not self.max_backoff_s >= self.backoff_s:
            raise InvalidArgumentError(
                f"max_backoff_s must be >= backoff_s ({self.backoff_s}), got {self.max_backoff_s!r}"
            )

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0-based)."""
        return min(self.max_backoff_s, self.backoff_s * 2.0**retry) * random.uniform(0.5, 1.0)


def retry_options(value: int | RetryOptions | None) -> RetryOptions:
    """``RetryOptions`` from ``retries=`` (an int, options, or None for the defaults)."""
    if value is None:
        return RetryOptions()
    if isinstance(value, RetryOptions):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(
            f"retries must be an int or a RetryOptions, got {type(value).__name__}. "
            "Fix: pass e.g. retries=3."
        )
    return RetryOptions(retries=value)


# -- options ----------------------------------------------------------------------


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower()


@functools.cache
def _s3fs_takes(name: str) -> bool:
    try:
        import s3fs
    except ImportError:
        return False
    return name in inspect.signature(s3fs.S3FileSystem.__init__).parameters


def effective_storage_options(
    url: str, storage_options: Mapping[str, Any], *, concurrency: int = DEFAULT_CONCURRENCY
) -> dict[str, Any]:
    """The fsspec options grain_replay opens ``url`` with: the user's, plus defaults.

    Only keys the user did not set are added. For S3 (s3fs):

    * ``max_concurrency=1``: s3fs would otherwise send a HEAD before every
      whole-object GET (to split objects over 50 MiB), doubling the requests of
      a chunk read.
    * ``config_kwargs["retries"] = {"total_max_attempts": 1}``: botocore does
      not retry on its own; grain_replay's ``retries=`` policy does, so that the
      number of attempts is the one asked for and an unreachable endpoint fails
      at once instead of after botocore's backoff.
    * ``config_kwargs["max_pool_connections"]``: at least ``concurrency``
      connections, so a batch's chunk GETs are not queued behind botocore's
      default pool of 10.
    """
    opts = dict(storage_options)
    if protocol_of(url) in ("s3", "s3a"):
        if "max_concurrency" not in opts and _s3fs_takes("max_concurrency"):
            opts["max_concurrency"] = 1
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("max_pool_connections", concurrency)
        opts["config_kwargs"] = config
    return opts


def redact_url(url: str) -> str:
    """``url`` without a password or signed-query secrets (for reprs and messages)."""
    if "://" not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"***@{host}"
    query = parts.query
    if query:
        query = "&".join(
            f"{k}=***" if re.search(r"sig|token|key|secret|credential|password", k, re.I) else p
            for p in query.split("&")
            for k in [p.split("=", 1)[0]]
        )
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _endpoint(storage_options: Mapping[str, Any]) -> str | None:
    client = storage_options.get("client_kwargs") or {}
    return storage_options.get("endpoint_url") or client.get("endpoint_url")


# -- classifying errors -----------------------------------------------------------------


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out and len(out) < 16:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _names(e: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(e).__mro__}


def _http_status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)  # botocore ClientError
    if isinstance(response, Mapping):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status is not None:
            return int(status)
    status = getattr(e, "status", None)  # aiohttp ClientResponseError
    return status if isinstance(status, int) else None


_CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}
_UNREACHABLE_ERRORS = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ProxyConnectionError",
    "ClientConnectorError",
    "ConnectionRefusedError",
    "gaierror",
    "SSLError",
}
_TRANSIENT_ERRORS = {
    "ConnectionResetError",
    "ConnectionAbortedError",
    "BrokenPipeError",
    "ConnectionClosedError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "ClientOSError",
    "ReadTimeoutError",
    "ResponseStreamingError",
    "IncompleteRead",
    "IncompleteReadError",
    "FSTimeoutError",
    "TimeoutError",
    "ServerTimeoutError",
}
_TRANSIENT_CODES = {
    "ServiceUnavailable",
    "SlowDown",
    "InternalError",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "503",
    "500",
}
_ACCESS_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "403",
}


def _describe(exc: BaseException) -> str:
    """``Type: message``, plus the HTTP status and error code found in the cause chain."""
    text = f"{type(exc).__name__}: {exc}"
    for e in _chain(exc):
        response = getattr(e, "response", None)
        status = _http_status(e)
        code = (response.get("Error") or {}).get("Code") if isinstance(response, Mapping) else None
        if status is not None or code:
            extra = " ".join(str(x) for x in (status, code) if x and str(x) not in text)
            return f"{text} [HTTP {extra}]" if extra else text
    return text


def classify(exc: BaseException) -> str:
    """The kind of failure: credentials, access, unreachable, transient, not_found or other."""
    chain = _chain(exc)
    names = set().union(*(_names(e) for e in chain))
    codes = set()
    for e in chain:
        response = getattr(e, "response", None)
        if isinstance(response, Mapping):
            codes.add(str((response.get("Error") or {}).get("Code")))
    statuses = {s for s in map(_http_status, chain) if s is not None}
    if names & _CREDENTIAL_ERRORS:
        return "credentials"
    if codes & _ACCESS_CODES or 403 in statuses or "PermissionError" in names:
        return "access"
    if names & _UNREACHABLE_ERRORS:
        return "unreachable"
    if (
        names & _TRANSIENT_ERRORS
        or codes & _TRANSIENT_CODES
        or any(s >= 500 or s == 429 for s in statuses)
    ):
        return "transient"
    if "FileNotFoundError" in names:
        return "not_found"
    return "other"


def is_transient(exc: BaseException) -> bool:
    """True for failures worth retrying: 5xx/429, connection reset, read timeouts."""
    return not isinstance(exc, GrainReplayError) and classify(exc) == "transient"


# -- one remote store ---------------------------------------------------------------


class Remote:
    """Retries and error translation for one remote store, in one process.

    Holds no credentials: only the URL (redacted in messages), the endpoint and
    the names of the storage options given.
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any],
        retry: RetryOptions,
        *,
        kind: str = "store",
    ):
        self.url = url
        self.shown = redact_url(url)
        self.endpoint = _endpoint(storage_options)
        self.option_names = sorted(storage_options)
        self.retry = retry
        self.kind = kind
        self._lock = threading.Lock()
        self.retried = 0  # retries made, for tests and logs

    def _note_retry(self, e: BaseException, what: str, attempt: int, wait: float) -> None:
        with self._lock:
            self.retried += 1
        logger.warning(
            "%s: transient error reading %s (%s: %s); retry %d of %d in %.2fs",
            self.shown, what, type(e).__name__, e, attempt + 1, self.retry.retries, wait,
        )  # fmt: skip

    def _retry_wait(self, error: Exception, what: str, attempt: int) -> float:
        """Seconds to wait before retrying after ``error``; raises it, translated, if no retry."""
        if attempt < self.retry.retries and is_transient(error):
            wait = self.retry.delay(attempt)
            self._note_retry(error, what, attempt, wait)
            return wait
        raise self.error(error, what, attempts=attempt + 1) from error

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, retried on transient errors; other errors become GrainReplayErrors."""
        for attempt in range(self.retry.retries + 1):
            try:
                return fn()
            except GrainReplayError:
                raise
            except Exception as e:
                time.sleep(self._retry_wait(e, what, attempt))
        raise AssertionError("unreachable")

    async def call_async(self, make: Callable[[], Awaitable[T]], what: str) -> T:
        """Like :meth:`call` for a coroutine factory."""
        for attempt in range(self.retry.retries + 1):
            try:
                return await make()
            except GrainReplayError:
                raise
            except Exception as e:
                await asyncio.sleep(self._retry_wait(e, what, attempt))
        raise AssertionError("unreachable")

    def error(self, exc: BaseException, what: str, *, attempts: int = 1) -> GrainReplayError:
        """A GrainReplayError for ``exc`` naming the URL, what failed and the fix."""
        if isinstance(exc, GrainReplayError):
            return exc
        kind = classify(exc)
        cause = _describe(exc)
        where = f"{self.shown}: cannot read {what}"
        endpoint = (
            f"endpoint_url={self.endpoint!r}" if self.endpoint else "the default endpoint (AWS)"
        )
        if kind == "credentials":
            return StoreAccessError(
                f"{where}: no credentials were found ({cause}). Fix: pass storage_options="
                "{'key': ..., 'secret': ...} (and 'token' for temporary credentials), set "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an AWS profile, or "
                "storage_options={'anon': True} for a public bucket."
            )
        if kind == "access":
            return StoreAccessError(
                f"{where}: access denied ({cause}). Fix: check storage_options 'key' / "
                "'secret' / 'token' (given: "
                f"{self.option_names}), and that they may read this bucket at {endpoint}."
            )
        if kind == "unreachable":
            return StoreUnreachableError(
                f"{where}: cannot connect to {endpoint} ({cause}). Fix: check that the "
                "server is up and reachable, and storage_options={'client_kwargs': "
                "{'endpoint_url': ...}} (or 'endpoint_url')."
            )
        if kind == "transient":
            return StoreUnreachableError(
                f"{where}: the server kept failing after {attempts} attempt(s) ({cause}). "
                f"Fix: retry later, or allow more retries with retries= (now "
                f"{self.retry.retries}); timeouts are set with storage_options="
                "{'config_kwargs': {'read_timeout': ..., 'connect_timeout': ...}}."
            )
        if kind == "not_found":
            return StoreNotFoundError(f"{where}: not found ({cause}). Fix: check the URL.")
        return InvalidStoreError(f"{where} ({cause}).")

    def not_found(self, storage_options: Mapping[str, Any], exc: BaseException) -> GrainReplayError:
        """StoreNotFoundError saying whether the bucket or the key is missing."""
        bucket_missing = False
        protocol = protocol_of(self.url)
        bucket = self.url.split("://", 1)[1].split("/", 1)[0]
        if protocol in _BUCKET_PROTOCOLS and bucket:
            try:
                fs = import_fsspec().filesystem(protocol, **storage_options)
                bucket_missing = not fs.exists(bucket)
            except Exception:  # the diagnosis is best-effort
                bucket_missing = False
        at = f" at {self.endpoint}" if self.endpoint else ""
        if bucket_missing:
            return StoreNotFoundError(
                f"{self.shown}: bucket {bucket!r} does not exist{at}. Fix: check the bucket "
                "name and storage_options={'client_kwargs': {'endpoint_url': ...}}, or create "
                "the bucket and upload the store."
            )
        return StoreNotFoundError(
            f"No {self.kind} at {self.shown}{at} ({type(exc).__name__}: {exc}). Fix: check "
            "the key after the bucket name, or upload the store there."
        )


# -- file objects and concurrency ----------------------------------------------------------

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
        opts = dict(storage_options)
        fs, path = import_fsspec().url_to_fs(url, **opts)
        kwargs: dict[str, Any] = {}
        if "default_block_size" not in opts and "block_size" not in opts:
            kwargs["block_size"] = FILE_BLOCK_SIZE
        if "default_cache_type" not in opts and "cache_type" not in opts:
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


class Limiter:
    """Bounds the requests in flight on one event loop (the semaphore is created there, lazily)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._sem: asyncio.Semaphore | None = None

    def get(self) -> asyncio.Semaphore:
        if self._sem is None:  # only ever called on the one loop thread
            self._sem = asyncio.Semaphore(self.limit)
        return self._sem
