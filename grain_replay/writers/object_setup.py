"""A ReplayWriter's set-up on object storage (s3://): the URL's checks, its writer part, its gate.

:class:`~grain_replay.writers.replay_writer.ReplayWriter` takes a POSIX path or an
``s3://`` URL; what only an URL needs (the writer part of npy pieces, the lease
settings, the rate-limit gate over the bucket) and what an URL or a POSIX path refuses
of the other's arguments is here. See docs/replay_store.md#on-object-storage.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from grain_replay.errors import InvalidArgumentError
from grain_replay.remote.options import redact_url
from grain_replay.store.formats import is_url
from grain_replay.store.objects import DEFAULT_EVICT_GRACE_S, DEFAULT_LEASE_S
from grain_replay.store.rate_limit import RateLimit
from grain_replay.writers.device import background
from grain_replay.writers.object_parts import ObjectPartWriter, check_url_arguments
from grain_replay.writers.rate_wait import WriterGate, check_rate_limit_timeout, check_writer_limit

__all__ = ["ObjectSetup", "open_object_part", "refuse_object_options", "writer_path"]


def writer_path(path: str | os.PathLike[str], writer_id: str | None) -> str:
    """The absolute path of a store on a file system, or a many-writer store's URL
    (s3://); a plain store's URL is refused (see docs/replay_store.md#file-systems-and-formats)."""
    text = os.fspath(path)
    if is_url(text):
        if writer_id is not None:
            return text
        raise InvalidArgumentError(
            f"{text}: a plain ReplayWriter (no capacity= or writer_id=) writes to a POSIX "
            "file system only (a local disk, or NFSv4 / Lustre / GPFS shared by the hosts), "
            "in every format: it appends to files in place, which object storage does not "
            "offer. Fix: pass writer_id=... (and capacity=...) for a many-writer store of "
            "npy pieces on s3:// (docs/replay_store.md#on-object-storage), or write to a "
            "path on such a file system; to serve a plain store from object storage, copy "
            "it into one Zarr store (grain-replay convert) and upload it, then read it with "
            "gr.ZarrDataSource(url, storage_options=...)."
        )
    return os.path.abspath(text)


def refuse_object_options(
    path: str, storage_options: Any, lease_s: Any, evict_grace_s: Any, writer_id: str | None
) -> None:
    """Refuses the object-storage arguments for a POSIX path, naming the fix."""
    given = [
        n
        for n, v in (
            ("storage_options", storage_options),
            ("lease_s", lease_s),
            ("evict_grace_s", evict_grace_s),
        )
        if v is not None
    ]
    if given and not is_url(path):
        who = "" if writer_id is None else f" (writer {writer_id!r})"
        raise InvalidArgumentError(
            f"{path}{who}: {', '.join(given)} apply to a many-writer store on object storage "
            "(an s3:// URL) only; on a POSIX file system writer ids are held by flock and "
            f"evicted segments stay readable while open. Fix: drop {', '.join(given)}."
        )


@dataclasses.dataclass(frozen=True)
class ObjectSetup:
    """What a ReplayWriter on an URL holds: its writer part, its gate and their names."""

    store: ObjectPartWriter
    gate: WriterGate
    who: str
    max_inflight: int


def open_object_part(
    url: str,
    format: str | None,
    writer_id: str,
    capacity: int | None,
    storage_options: dict[str, Any] | None,
    lease_s: float | None,
    evict_grace_s: float | None,
    *,
    segment_rows: int | None,
    resume_from: object,
    rate_limit: RateLimit | None,
    rate_limit_timeout: float | None,
    max_inflight_bytes: int,
) -> ObjectSetup:
    """A writer part on object storage (docs/replay_store.md#on-object-storage), its
    rate limit declared."""
    check_url_arguments(url, writer_id, segment_rows=segment_rows)
    who = f"{redact_url(url)} (writer {writer_id!r})"
    timeout = check_rate_limit_timeout(rate_limit_timeout, who)
    limit, timeout = check_writer_limit(rate_limit, timeout, who)
    max_inflight = background.check_max_inflight_bytes(max_inflight_bytes, who)
    store = ObjectPartWriter(
        url,
        format,
        writer_id=writer_id,
        capacity=capacity,
        storage_options=storage_options,
        lease_s=DEFAULT_LEASE_S if lease_s is None else lease_s,
        evict_grace_s=DEFAULT_EVICT_GRACE_S if evict_grace_s is None else evict_grace_s,
        resume_from=resume_from,
    )
    gate = WriterGate(url, parts=True, timeout=timeout, who=who, objects=store.objects)
    if limit is not None:
        try:
            gate.declare(limit)  # before the first row: writers hold from it on
        except BaseException:
            store.abandon()  # nothing appended: frees the writer id
            raise
    return ObjectSetup(store, gate, who, max_inflight)
