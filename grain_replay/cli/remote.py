"""The CLI over object storage: ``--storage-option KEY=VALUE``, and ``info`` / ``verify`` of a
many-writer store on ``s3://`` (docs/cli.md#stores-on-object-storage)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidArgumentError
from grain_replay.store.formats import is_url

__all__ = [
    "add_storage_option",
    "object_writers",
    "storage_options",
    "verify_object_store",
]

_HELP = (
    "fsspec option of an URL store (s3://...), repeatable: VALUE is read as JSON where it "
    "parses (true, 3, {...}), else as text; a dotted KEY sets a nested one "
    "(client_kwargs.endpoint_url=http://host:9000)"
)


def add_storage_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="storage_option",
        help=_HELP,
    )


def storage_options(path: str, given: Sequence[str] | None) -> dict[str, Any] | None:
    """The fsspec options ``--storage-option`` gave for ``path``: None when none was given.

    Raises:
      InvalidArgumentError: an option is not ``KEY=VALUE``, or options are given for a
        path on the file system (which takes none).
    """
    if not given:
        return None
    if not is_url(path):
        raise InvalidArgumentError(
            f"{path}: --storage-option applies to a store at an URL (s3://...) only; a path "
            "on the file system takes none. Fix: drop --storage-option, or pass the store's URL."
        )
    out: dict[str, Any] = {}
    for item in given:
        key, eq, text = item.partition("=")
        names = key.strip().split(".")
        if not eq or not all(names):
            raise InvalidArgumentError(
                f"{path}: --storage-option {item!r} is not KEY=VALUE. Fix: e.g. "
                "--storage-option anon=true or --storage-option "
                "client_kwargs.endpoint_url=http://127.0.0.1:9000."
            )
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        at = out
        for name in names[:-1]:
            nested = at.setdefault(name, {})
            if not isinstance(nested, dict):
                raise InvalidArgumentError(
                    f"{path}: --storage-option {item!r}: {name} was given a value already, "
                    f"so it cannot hold {'.'.join(names[1:])}. Fix: give {name} as one JSON "
                    "object, or its fields as dotted keys only."
                )
            at = nested
        at[names[-1]] = value
    return out


def object_writers(src: Any, url: str, opts: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``info``'s per-writer rows, pieces, bytes and live holder of the store on S3 at ``url``."""
    from grain_replay.store.lease import Lease
    from grain_replay.store.objects import DEFAULT_LEASE_S, ObjectStore

    objects = ObjectStore(url, opts)
    out = []
    for m in src.writers:
        listed = objects.listing(objects.writer_key(m.writer_id, "pieces"))
        where = f"{objects.shown} (writer {m.writer_id!r})"
        holder = Lease(objects, m.writer_id, DEFAULT_LEASE_S, where).live_holder()
        out.append(writer_row(m, sum(int(e.get("size") or 0) for e in listed), holder))
    return out


def writer_row(m: Any, size: int, holder: Any) -> dict[str, Any]:
    """``info``'s row of one writer of a many-writer store (on a path or on S3): its
    manifest's counts, ``size`` bytes stored and the live ``holder`` of its id, or None."""
    return {
        "writer_id": m.writer_id,
        "ordinal": m.ordinal,
        "capacity": m.capacity,
        "committed": m.committed,
        "live": m.live,
        "evicted": m.evicted,
        "segments": len(m.segments),
        "segment_rows": m.segment_rows,
        "size_on_disk": size,
        "holder": holder,
    }


def verify_object_store(src: Any, url: str, opts: dict[str, Any] | None) -> int:
    """``verify`` of a many-writer store on S3: each writer's newest manifest version
    (pieces back to back, ending at its committed count, covering its live rows), each
    piece it names (there, of the size its rows need), then every live row read.
    Pieces record no checksums: a bit flipped inside one is not found."""
    from grain_replay.errors import GrainReplayError
    from grain_replay.store.object_manifest import leaf_offsets
    from grain_replay.store.objects import ObjectStore

    objects = ObjectStore(url, opts)
    row_bytes = sum(w for _, w in leaf_offsets(src.spec, 1).values())
    problems = []
    pieces = 0
    for wid in objects.list_writers():
        m = objects.newest_manifest(wid)
        if m is None or m.schema is None:
            continue
        ends = [p.first + p.rows for p in m.pieces]
        gaps = [p.first for p, end in zip(m.pieces[1:], ends, strict=False) if p.first != end]
        first = m.pieces[0].first if m.pieces else m.committed
        if gaps or (ends[-1] if ends else m.committed) != m.committed or first > m.live_start:
            problems.append(
                f"writer {wid!r}: manifest version {m.version} names pieces "
                f"{[(p.first, p.rows) for p in m.pieces]} (not back to back at {gaps}), "
                f"committed {m.committed}, live from {m.live_start}"
            )
        sizes = {
            e["name"].rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in objects.listing(objects.writer_key(wid, "pieces"))
        }
        for p in m.pieces:
            pieces += 1
            want = p.rows * row_bytes
            if p.name not in sizes:
                problems.append(f"writer {wid!r}: piece {p.name} (rows {p.first}+{p.rows}) is gone")
            elif sizes[p.name] != want:
                problems.append(
                    f"writer {wid!r}: piece {p.name} holds {sizes[p.name]} bytes, its "
                    f"{p.rows} rows need {want}"
                )
    n = len(src)
    if not problems:
        step = max(1, (64 << 20) // max(1, row_bytes))
        try:
            for start in range(0, n, step):
                src.read_batch(np.arange(start, min(n, start + step)))
        except (GrainReplayError, OSError) as e:
            problems.append(f"reading the live rows: {e}")
    if problems:
        for problem in problems:
            print(f"CORRUPT {src.path}: {problem}", file=sys.stderr)
        return 1
    print(
        f"OK {src.path}: {n:,} live records of {len(src.writers)} writers, {pieces} "
        "pieces, readable (no checksums recorded)"
    )
    return 0
