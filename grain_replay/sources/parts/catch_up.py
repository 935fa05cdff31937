"""A snapshot of a many-writer store, taken however fast the writers evict while it is opened.

A writer keeps on disk the segments its manifest names and the newest one it evicted
(``RETAIN_SEGMENTS``); a segment it evicted two commits ago may be gone. A reader that
finds a segment of the manifest it read gone reads the writer's manifest again and
builds the part from that one, keeping the segments it did open (each checked whole when
it was opened): the next attempt opens only the segments committed since, which are the
newest, the last to be evicted. Each attempt so goes further than the one before, and a
writer cannot keep a reader from its snapshot by being fast; only a deadline ends the
attempts (the reader cannot open even the newest segments before they go).
:func:`take_snapshot` does so for each writer, the others' parts kept.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.base import ReplaySource
from grain_replay.sources.parts import snapshot as snapshots
from grain_replay.sources.parts.snapshot import Part, Snapshot
from grain_replay.store import parts as parts_lib
from grain_replay.store.layout import LeafSpec

__all__ = ["CATCH_UP_S", "take_part", "take_snapshot", "too_fast"]

# How long a refresh keeps taking newer manifests of writers that evict its segments
# before it can open them (each attempt opens only what was committed since the last).
CATCH_UP_S = 60.0


def too_fast(store: str, seconds: float) -> InvalidStoreError:
    return InvalidStoreError(
        f"{store}: the writers evicted the segments this reader was opening, again and "
        f"again for {seconds:g} s: they evict faster than this reader can open even the "
        "newest segments. Fix: raise capacity (more rows per segment), or give the "
        "reader's process more CPU."
    )


def take_snapshot(
    store: str,
    previous: Snapshot | None,
    schema: Callable[[list[parts_lib.Manifest]], Mapping[str, LeafSpec]],
    kwargs: Mapping[str, Any],
) -> Snapshot:
    """A snapshot of ``store`` now, reusing what did not change since ``previous``.

    Each writer's manifest is read again just before its segments are opened, and a
    writer that evicts a segment before it is opened is caught up with (:func:`take_part`):
    the other writers' parts stay. ``schema`` is given the manifests found and returns the
    leaves to open (the reader's spec, which their schemas may change).
    """
    old = {} if previous is None else {p.manifest.writer_id: p for p in previous.parts}
    deadline = time.monotonic() + CATCH_UP_S
    while True:
        found: list[tuple[parts_lib.Manifest, Any, Part | None, bool]] = []
        for wid in parts_lib.list_writers(store):
            wdir = parts_lib.writer_dir(store, wid)
            stamp = snapshots.stamp(os.path.join(wdir, parts_lib.MANIFEST_FILE))
            if stamp is None:
                continue  # no commit yet
            prev = old.get(wid)
            if prev is not None and prev.stamp == stamp:
                found.append((prev.manifest, stamp, prev, True))
                continue
            m = parts_lib.read_manifest(wdir)
            if m is not None:
                found.append((m, stamp, prev, False))
        spec = schema([m for m, _, _, _ in found])
        parts: list[Part] = []
        for m, stamp, prev, same in found:
            part = prev if same else take_part(store, m, stamp, prev, spec, kwargs, deadline)
            if part is None:
                break  # a writer's folder or schema changed meanwhile: list them again
            parts.append(part)
        else:
            return Snapshot(parts)
        if time.monotonic() >= deadline:
            raise too_fast(store, CATCH_UP_S)


def take_part(
    store: str,
    m: parts_lib.Manifest,
    seen: Any,
    prev: Part | None,
    spec: Mapping[str, LeafSpec],
    kwargs: Mapping[str, Any],
    deadline: float,
) -> Part | None:
    """Writer ``m``'s part, from ``m`` or a newer manifest of the writer: the one read just
    before its segments are opened, then a newer one each time a segment it names was
    evicted before it could be opened. ``seen``: the manifest's stamp before ``m`` was
    read; ``prev``: the writer's part in the previous snapshot. None when the writer's
    folder or schema changed meanwhile (the caller lists the writers again).

    Raises:
      InvalidStoreError: a segment the manifest names is missing though the writer
        committed nothing since (a damaged store), or the deadline passed.
    """
    wdir = parts_lib.writer_dir(store, m.writer_id)
    file = os.path.join(wdir, parts_lib.MANIFEST_FILE)
    # The manifest as it is now: other writers' segments were opened since it was read.
    now = snapshots.stamp(file)
    if now != seen:
        fresh = parts_lib.read_manifest(wdir)
        if fresh is None or fresh.schema != m.schema:
            return None
        m, seen = fresh, now
    opened: dict[int, ReplaySource] = {}
    while True:
        part = snapshots.build_part(store, m, seen, prev, False, spec, kwargs, opened)
        listed = [s.first for s in m.segments]
        kept = {f: part.segments[f] for f in listed if f in part.segments}
        _close(opened.values(), [*kept.values(), *_sources(prev)])
        if len(kept) == len(listed):
            return part
        opened = kept
        missing = next(f for f in listed if f not in kept)
        seen_next = snapshots.stamp(file)
        newer = parts_lib.read_manifest(wdir)
        if newer is None or newer.schema != m.schema:
            _close(opened.values(), _sources(prev))
            return None
        if newer == m:
            _close(opened.values(), _sources(prev))
            raise InvalidStoreError(
                f"{os.path.join(wdir, parts_lib.segment_name(missing, m.format))}: writer "
                f"{m.writer_id!r}'s manifest names this segment, which is gone, and the "
                "writer committed nothing since: the store is damaged (a segment removed "
                f"by hand?). Fix: restore the segment, or remove {wdir} to drop the "
                "writer's rows."
            )
        if time.monotonic() >= deadline:
            _close(opened.values(), _sources(prev))
            raise too_fast(store, CATCH_UP_S)
        m, seen = newer, seen_next


def _sources(part: Part | None) -> list[ReplaySource]:
    return [] if part is None else list(part.segments.values())


def _close(sources: Iterable[ReplaySource], keep: list[ReplaySource]) -> None:
    """Closes ``sources`` but those in ``keep`` (by identity: a previous snapshot's source
    grown in place is that snapshot's too)."""
    for src in sources:
        if not any(src is k for k in keep):
            with contextlib.suppress(Exception):
                src.close()
