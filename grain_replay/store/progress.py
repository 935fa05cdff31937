"""Rate-limited learners' published progress, read by the writers of the store they sample.

A learner sampling with ``samples_per_insert`` publishes one small JSON file per
learner process beside the store's rows::

    <store>/learners/process-<p>-of-<P>.json      a bounded, many-writer store
    <store>.learners/process-<p>-of-<P>.json      a plain single-writer store

replaced atomically (write a hidden temporary file, ``rename``), from the moment
its loader is built: the rows it handed out and drew, its ratio, tolerance,
``min_size`` and batch, a heartbeat time, its host and pid. The same folder holds
the limit the store declares, if a writer declared one (``limit.json``,
:mod:`grain_replay.store.rate_limit`): while no learner is live, writers hold by it
as if a learner had handed out nothing (or what the last learner handed out).
A writer's ``flush()`` lists that folder, ``stat``s each file and re-reads only
those that changed, and counts the rows every writer
committed from their manifests (also ``stat`` first). The decision both sides
share is :meth:`Progress.blocks_insert`; the learner's own is in
``grain_replay.sampling.rate.limit``.

Writers and the sampling layer both import this module; it imports neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import time
from typing import Any

from grain_replay.store import parts as parts_lib
from grain_replay.store.filesync import atomic_replace, pid_alive
from grain_replay.store.object_folder import ObjectFolder
from grain_replay.store.rate_limit import LIMIT_FILE, RateLimit, learners_dir

__all__ = [
    "STALE_AFTER_S",
    "InsertedCount",
    "LearnerWatch",
    "Progress",
    "learners_dir",
    "publish",
    "stand_in",
    "withdraw",
]

logger = logging.getLogger(__name__)

# A learner whose heartbeat is older than this (seconds; each learner writes its
# own value into its file) is taken for dead: writers stop waiting on it.
STALE_AFTER_S = 60.0
_VERSION = 1


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_mtime_ns, st.st_size, st.st_ino


@dataclasses.dataclass(frozen=True)
class Progress:
    """One learner process's published progress; every count is in global rows.

    A learner of ``P`` processes steps in lockstep (one global batch a step), so each
    process publishes its own count times ``P``: ``sampled`` rows handed out,
    ``drawn`` rows drawn (handed out plus drawn ahead for its loader's workers),
    ``batch`` the rows of one global batch.
    """

    name: str
    sampled: int
    drawn: int
    batch: int
    samples_per_insert: float
    tolerance: float
    min_size: int
    heartbeat: float  # time.time() of the last publish
    stale_after: float
    pid: int
    host: str
    waiting: bool = False  # the learner was waiting for inserts when it published
    # Which learner (in its process) published this file: a random token of its
    # publisher (only the holder of the token withdraws the file) and its label.
    token: str = ""
    learner: str = ""
    # The iterator was closed (a store that declares a limit keeps the file, so its
    # writers hold at what this learner handed out), and the tolerance the learner was
    # given (None: the default), which the declared limit is compared with.
    closed: bool = False
    given_tolerance: float | None = None

    def blocks_insert(self, inserted: int, live: int, pending: int) -> bool:
        """Whether a writer committing ``pending`` more rows now would run ahead of this learner.

        The learner hands out at most ``r * (inserted - min_size) + e`` rows; a writer
        waits while committing would take that target more than ``e`` past the rows
        handed out. It never waits while the learner cannot draw its next batch (too
        few rows, or at its ceiling): then only an insert makes progress.
        """
        r, e, m = self.samples_per_insert, self.tolerance, self.min_size
        if r * (inserted + pending - m) - self.sampled <= e:
            return False
        starved = live < m or self.drawn + self.batch > r * (inserted - m) + e
        return not starved

    def limit(self) -> RateLimit:
        """The limit this learner samples by, as it was given (its tolerance, or None)."""
        return RateLimit(
            min_size=self.min_size,
            samples_per_insert=self.samples_per_insert,
            tolerance=self.given_tolerance,
        )

    def describe(self) -> str:
        who = f"{self.learner}, " if self.learner else ""
        token = f", token {self.token}" if self.token else ""
        return (
            f"{self.name} ({who}pid {self.pid} on {self.host!r}{token}): handed out "
            f"{self.sampled} rows, "
            f"samples_per_insert={self.samples_per_insert:g}, min_size={self.min_size}, "
            f"tolerance={self.tolerance:g}"
        )

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        del fields["name"]
        return json.dumps({"version": _VERSION, **fields})

    @classmethod
    def from_json(cls, name: str, text: str) -> Progress | None:
        """The progress in ``text``, or None when it is not one (a newer or damaged file)."""
        try:
            raw = json.loads(text)
            if int(raw["version"]) != _VERSION:
                return None
            p = cls(
                name=name,
                sampled=int(raw["sampled"]),
                drawn=int(raw["drawn"]),
                batch=int(raw["batch"]),
                samples_per_insert=float(raw["samples_per_insert"]),
                tolerance=float(raw["tolerance"]),
                min_size=int(raw["min_size"]),
                heartbeat=float(raw["heartbeat"]),
                stale_after=float(raw["stale_after"]),
                pid=int(raw["pid"]),
                host=str(raw["host"]),
                waiting=bool(raw.get("waiting", False)),
                token=str(raw.get("token", "")),
                learner=str(raw.get("learner", "")),
                closed=bool(raw.get("closed", False)),
                given_tolerance=(
                    None if raw.get("given_tolerance") is None else float(raw["given_tolerance"])
                ),
            )
        except (ValueError, KeyError, TypeError):
            return None
        if not all(math.isfinite(x) for x in (p.samples_per_insert, p.tolerance, p.heartbeat)):
            return None
        return p

    def dead(self, now: float) -> str | None:
        """Why this learner is taken for gone (closed, stale heartbeat, or its pid gone),
        else None."""
        if self.closed:
            return "its iterator was closed"
        age = now - self.heartbeat
        if age > self.stale_after:
            return f"its heartbeat is {age:.0f} s old (stale after {self.stale_after:g} s)"
        if self.host == socket.gethostname() and not pid_alive(self.pid):
            return f"its process {self.pid} on this host has exited"
        return None


def publish(directory: str | ObjectFolder, progress: Progress) -> None:
    """Replaces ``directory/<name>`` with ``progress`` (not fsync'ed: it is a live hint)."""
    if isinstance(directory, ObjectFolder):
        directory.replace(progress.name, progress.to_json())  # one PUT: whole or not at all
        return
    os.makedirs(directory, exist_ok=True)
    # The temp name ends in .partial, not .json: LearnerWatch.live() never lists it.
    with atomic_replace(os.path.join(directory, progress.name), durable=False) as f:
        f.write(progress.to_json().encode())


def read_progress(directory: str | ObjectFolder, name: str) -> Progress | None:
    if isinstance(directory, ObjectFolder):
        text = directory.read(name)
        return None if text is None else Progress.from_json(name, text)
    with contextlib.suppress(OSError), open(os.path.join(directory, name)) as f:
        return Progress.from_json(name, f.read())
    return None


def withdraw(directory: str | ObjectFolder, name: str, token: str) -> bool:
    """Withdraws the file ``name`` if it holds ``token``: a learner withdraws only what it
    published, never another learner's file (of this process or another); whether it did.

    The file is removed, or, where the store declares a limit, marked closed: its writers
    then hold at the rows this learner handed out until another learner goes on (as a
    Reverb table's limiter keeps its counts when the learner stops).
    """
    p = read_progress(directory, name)
    if p is None or not token or p.token != token:
        return False
    if isinstance(directory, ObjectFolder):
        try:
            if directory.exists(LIMIT_FILE):
                if not p.closed:
                    publish(directory, dataclasses.replace(p, closed=True, waiting=False))
            else:
                directory.remove(name)
        except Exception as e:  # unreachable: the heartbeat goes stale, writers go on
            logger.warning("%s: could not withdraw %s: %s", directory, name, e)
            return False
        return True
    with contextlib.suppress(OSError):
        if os.path.exists(os.path.join(directory, LIMIT_FILE)):
            if not p.closed:
                publish(directory, dataclasses.replace(p, closed=True, waiting=False))
        else:
            os.unlink(os.path.join(directory, name))
        return True
    return False


def stand_in(limit: RateLimit, gone: list[Progress]) -> Progress | None:
    """The learner the writers of a store declaring ``limit`` hold for while none is live:
    the last one that was (closed or gone: the newest heartbeat), else one that handed out
    nothing. ``batch=0``: it draws nothing, so only ``live < min_size`` lets a writer past.
    None when ``limit`` has no ratio (writers never hold for ``min_size`` alone)."""
    r = limit.samples_per_insert
    if r is None:
        return None
    last = max(gone, key=lambda p: p.heartbeat, default=None)
    e = limit.writer_tolerance()
    assert e is not None
    sampled = 0
    if last is not None:
        sampled = last.sampled
        if limit.tolerance is None:
            e = last.tolerance
    return Progress(
        name=LIMIT_FILE,
        sampled=sampled,
        drawn=sampled,
        batch=0,
        samples_per_insert=r,
        tolerance=e,
        min_size=limit.min_size,
        heartbeat=time.time(),
        stale_after=STALE_AFTER_S,
        pid=os.getpid(),
        host=socket.gethostname(),
        learner=(
            f"the store's declared {limit.terms()}, "
            + ("no learner yet" if last is None else f"last learner {last.name} gone")
        ),
        given_tolerance=limit.tolerance,
    )


class LearnerWatch:
    """The live learners of a store, re-read only when their files change."""

    def __init__(self, directory: str | ObjectFolder) -> None:
        self.directory = directory
        self._cache: dict[str, tuple[Any, Progress | None]] = {}
        self._told: set[tuple[str, int, str]] = set()

    def live(self) -> list[Progress]:
        """Every learner whose file is fresh and whose process may be alive."""
        return self.scan()[0]

    def scan(self) -> tuple[list[Progress], list[Progress]]:
        """``(live, gone)``: the learners whose file is fresh and whose process may be alive,
        and those closed, stale or exited."""
        try:
            entries = self._entries()
        except (FileNotFoundError, NotADirectoryError):
            self._cache.clear()
            return [], []
        now = time.time()
        out = []
        gone = []
        seen = set()
        for name, stamp in entries:
            seen.add(name)
            cached = self._cache.get(name)
            if cached is None or cached[0] != stamp:
                cached = (stamp, read_progress(self.directory, name))
                self._cache[name] = cached
            p = cached[1]
            if p is None:
                continue
            why = p.dead(now)
            if why is None:
                out.append(p)
                continue
            gone.append(p)
            if not p.closed and (p.name, p.pid, p.host) not in self._told:
                self._told.add((p.name, p.pid, p.host))
                logger.warning(
                    "%s: learner %s is gone: %s; writers no longer follow its progress",
                    self.directory,
                    p.describe(),
                    why,
                )
        for name in set(self._cache) - seen:
            del self._cache[name]
        return out, gone

    def _entries(self) -> list[tuple[str, Any]]:
        """``(name, stamp)`` of each progress file (the stamp changes when it is replaced)."""
        if isinstance(self.directory, ObjectFolder):
            found = self.directory.entries()
        else:
            found = []
            for e in os.scandir(self.directory):
                try:
                    found.append((e.name, _stamp(e.stat())))
                except OSError:
                    continue
        return [
            (name, stamp)
            for name, stamp in found
            if name.endswith(".json") and not name.startswith(".") and name != LIMIT_FILE
        ]


class InsertedCount:
    """Rows committed by every writer of a many-writer store (evicted ones included), and
    their live rows, from the manifests (each ``stat``ed, re-read only when it changed)."""

    def __init__(self, store: str) -> None:
        self.store = store
        self._cache: dict[str, tuple[tuple[int, int, int], parts_lib.Manifest | None]] = {}

    def manifests(self) -> list[parts_lib.Manifest]:
        out = []
        for writer_id in parts_lib.list_writers(self.store):
            wdir = parts_lib.writer_dir(self.store, writer_id)
            try:
                stamp = _stamp(os.stat(os.path.join(wdir, parts_lib.MANIFEST_FILE)))
            except OSError:
                continue  # not committed yet
            cached = self._cache.get(writer_id)
            if cached is None or cached[0] != stamp:
                try:
                    cached = (stamp, parts_lib.read_manifest(wdir))
                except Exception:  # a manifest being replaced, or damaged: as before
                    if cached is None:
                        continue
                self._cache[writer_id] = cached
            if cached[1] is not None:
                out.append(cached[1])
        return out

    def read(self) -> tuple[int, int]:
        """``(inserted, live)``: rows ever committed, and rows readers see now."""
        ms = self.manifests()
        return sum(m.committed for m in ms), sum(m.live for m in ms)
