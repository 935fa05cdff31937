"""Retries with backoff and error classification for remote reads: RetryOptions, Remote."""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
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
from grain_replay.remote.options import endpoint_of, protocol_of, redact_url
from grain_replay.store.optional import import_fsspec

__all__ = ["Remote", "RetryOptions", "classify", "is_transient", "retry_options"]

# The name the log had when this was one module, so logging configured for it still applies.
logger = logging.getLogger("grain_replay.remote")

T = TypeVar("T")

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

    Examples:
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


def _error_code(e: BaseException) -> Any:
    """The botocore error code (``"AccessDenied"``, ``"503"``, ...) of ``e``, if any."""
    response = getattr(e, "response", None)
    return (response.get("Error") or {}).get("Code") if isinstance(response, Mapping) else None


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
        status = _http_status(e)
        code = _error_code(e)
        if status is not None or code:
            extra = " ".join(str(x) for x in (status, code) if x and str(x) not in text)
            return f"{text} [HTTP {extra}]" if extra else text
    return text


def classify(exc: BaseException) -> str:
    """The kind of failure: credentials, access, unreachable, transient, not_found or other."""
    chain = _chain(exc)
    names = set().union(*(_names(e) for e in chain))
    codes = {str(c) for c in map(_error_code, chain) if c is not None}
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
        self.endpoint = endpoint_of(storage_options)
        self.option_names = sorted(storage_options)
        self.retry = retry
        self.kind = kind
        self._lock = threading.Lock()
        self.retried = 0  # retries made, for tests and logs

    def _retry_wait(self, error: Exception, what: str, attempt: int) -> float:
        """Seconds to wait before retrying after ``error``; raises it, translated, if no retry."""
        if attempt < self.retry.retries and is_transient(error):
            wait = self.retry.delay(attempt)
            with self._lock:
                self.retried += 1
            logger.warning(
                "%s: transient error reading %s (%s: %s); retry %d of %d in %.2fs",
                self.shown, what, type(error).__name__, error,
                attempt + 1, self.retry.retries, wait,
            )  # fmt: skip
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
                pass
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
