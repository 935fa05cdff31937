"""Remote (fsspec URL) access: tuned options, retries with backoff, clear errors, file objects.

Everything here takes explicit arguments (URL, storage options, retry policy,
concurrency) and returns files, bytes or errors; it never sees a source.
``options`` holds the storage options and URLs, ``retry`` the retry policy and
error classification (``Remote``), ``files`` the file objects.
"""

from __future__ import annotations

# Names outside __all__ stay importable from here as they were from the one module.
from grain_replay.remote.files import FILE_BLOCK_SIZE as FILE_BLOCK_SIZE
from grain_replay.remote.files import FILE_CACHE_BLOCKS as FILE_CACHE_BLOCKS
from grain_replay.remote.files import RetryingFile
from grain_replay.remote.options import DEFAULT_CONCURRENCY, effective_storage_options, redact_url
from grain_replay.remote.options import protocol_of as protocol_of
from grain_replay.remote.retry import Remote, RetryOptions, classify, is_transient, retry_options

__all__ = [
    "DEFAULT_CONCURRENCY",
    "RetryOptions",
    "Remote",
    "RetryingFile",
    "classify",
    "effective_storage_options",
    "is_transient",
    "redact_url",
    "retry_options",
]
