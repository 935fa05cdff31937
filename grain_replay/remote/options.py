"""fsspec storage options and URLs: the defaults grain_replay opens a store with, and redaction."""

from __future__ import annotations

import functools
import inspect
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULT_CONCURRENCY",
    "effective_storage_options",
    "endpoint_of",
    "protocol_of",
    "redact_url",
]

# Requests in flight per process for a batch read (all leaves together).
DEFAULT_CONCURRENCY = 64


def protocol_of(url: str) -> str:
    """The lower-cased scheme of ``url`` (``"s3"`` for ``s3://bucket/key``)."""
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


def endpoint_of(storage_options: Mapping[str, Any]) -> str | None:
    """The endpoint URL set in ``storage_options`` (top level or ``client_kwargs``), if any."""
    client = storage_options.get("client_kwargs") or {}
    return storage_options.get("endpoint_url") or client.get("endpoint_url")
