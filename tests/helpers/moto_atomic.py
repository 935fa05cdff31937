"""moto's S3 server with conditional creates as atomic as S3's.

S3 applies a ``PutObject`` (or a ``CompleteMultipartUpload``) carrying ``If-None-Match: *``
atomically: of two racing creates of one key, one succeeds and the other gets 412. moto
5.2 checks that the key is absent, then writes it, with nothing between the two, and its
server answers each request in its own thread: two racing creates of one key can both
succeed (seen in ``test_a_race_for_one_manifest_version_has_one_winner``: two writers each
told they published the same manifest version). The commit protocol under test relies on
S3's guarantee, so the servers the tests and benchmarks start take conditional creates one
at a time (:func:`apply`); every other request runs as before.

Run as a script, it is ``moto.server`` with that applied: ``python moto_atomic.py -H
127.0.0.1 -p PORT``.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

_LOCK = threading.Lock()
_METHODS = ("put_object", "_key_response_post")  # PutObject; CompleteMultipartUpload


def apply() -> None:
    """Serializes moto's conditional creates in this process (idempotent)."""
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_atomic_conditional_creates", False):
        return
    missing = [m for m in _METHODS if not hasattr(S3Response, m)]
    if missing:
        raise RuntimeError(
            f"moto's S3Response has no {missing}: this moto cannot be made to create objects "
            "conditionally as atomically as S3 does, and the S3 tests would race. Fix: "
            "install moto[server]>=5,<6 (pyproject's test extra)."
        )
    for name in _METHODS:
        setattr(S3Response, name, _serialized(getattr(S3Response, name)))
    S3Response._atomic_conditional_creates = True  # type: ignore[attr-defined]


def _serialized(method: Any) -> Any:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.headers.get("If-None-Match") != "*":
            return method(self, *args, **kwargs)
        with _LOCK:  # the absence check and the write, one create at a time
            return method(self, *args, **kwargs)

    return run


if __name__ == "__main__":
    apply()
    from moto.server import main

    main(sys.argv[1:])
