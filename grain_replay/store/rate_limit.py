"""``RateLimit``: one samples-per-insert limit, named alike by writers and learners, and the
limit a store declares (``limit.json`` in its learners' folder, written once).

A writer given ``rate_limit=`` declares it in the store before its first row (the first
declaration stays; a different one is refused, naming both). From then on every writer of
the store holds while it would run ahead of the learner, counting ``sampled = 0`` while no
learner has published (:mod:`grain_replay.store.progress`). A learner given no limit takes
the store's; one given another is refused. See docs/rate_limits.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import operator
import os
import socket
import time
from typing import Any

import numpy as np

from grain_replay.errors import InvalidSamplingError, InvalidStoreError
from grain_replay.store import parts as parts_lib
from grain_replay.store.filesync import fsync_path, temp_path
from grain_replay.store.object_folder import ObjectFolder

__all__ = [
    "LIMIT_FILE",
    "TOLERANCE_FRACTION",
    "RateLimit",
    "check_rate_limit",
    "declare",
    "default_tolerance",
    "learners_dir",
    "least_tolerance",
    "read_declared",
]

LEARNERS_DIR = "learners"
# The store's declared limit, in its learners' folder (not *.json's progress files: those
# are named process-<p>-of-<P>.json).
LIMIT_FILE = "limit.json"
_VERSION = 1
# Acme's default error buffer: 10 % of min_size * samples_per_insert.
TOLERANCE_FRACTION = 0.1


def learners_dir(store: str, *, parts: bool | None = None) -> str:
    """Where the learners of ``store`` publish, and where its declared limit lies: inside a
    many-writer store, beside a plain one (``parts=None``: as the store on disk says)."""
    if parts is None:
        parts = parts_lib.is_parts_store(store)
    return os.path.join(store, LEARNERS_DIR) if parts else store + ".learners"


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise InvalidSamplingError(
            f"{owner}: {name} must be a number, got {value!r}. Fix: pass {name} as a float."
        )
    return float(value)


def check_rate_limit(
    owner: str,
    min_size: Any,
    samples_per_insert: Any,
    tolerance: Any,
    timeout: Any,
) -> tuple[int, float | None, float | None, float | None]:
    """The four rate-limit options, checked; the error names the option and the fix."""
    if isinstance(min_size, (bool, np.bool_)) or not isinstance(min_size, int):
        try:
            if isinstance(min_size, (bool, np.bool_)):
                raise TypeError
            min_size = operator.index(min_size)
        except TypeError:
            raise InvalidSamplingError(
                f"{owner}: min_size must be an int (rows live before the first batch), got "
                f"{min_size!r}. Fix: min_size=1_000 (or 0: no wait)."
            ) from None
    if min_size < 0:
        raise InvalidSamplingError(
            f"{owner}: min_size must be >= 0 rows, got {min_size}. Fix: min_size >= 0."
        )
    r = None
    if samples_per_insert is not None:
        r = _number(owner, "samples_per_insert", samples_per_insert)
        if not (math.isfinite(r) and r > 0):
            raise InvalidSamplingError(
                f"{owner}: samples_per_insert must be a positive finite number (rows handed "
                f"out per row inserted), got {samples_per_insert!r}. Fix: e.g. "
                "samples_per_insert=8.0, or None for no ratio."
            )
    e = None
    if tolerance is not None:
        if r is None:
            raise InvalidSamplingError(
                f"{owner}: tolerance={tolerance!r} bounds the samples_per_insert ratio, but "
                "samples_per_insert is None. Fix: pass samples_per_insert= too, or drop "
                "tolerance."
            )
        e = _number(owner, "tolerance", tolerance)
        if not (math.isfinite(e) and e >= 0):
            raise InvalidSamplingError(
                f"{owner}: tolerance must be a finite number of rows >= 0, got {tolerance!r}. "
                "Fix: tolerance >= 0, or None (the default)."
            )
    t = None
    if timeout is not None:
        t = _number(owner, "timeout", timeout)
        if not (math.isfinite(t) and t > 0):
            raise InvalidSamplingError(
                f"{owner}: timeout must be positive seconds, or None (wait as long as it "
                f"takes), got {timeout!r}. Fix: timeout=None or seconds > 0."
            )
    return int(min_size), r, e, t


def least_tolerance(batch: int, r: float) -> float:
    """The smallest tolerance that can make progress: a band of ``2e`` rows must hold a
    whole batch and one row's samples, ``2e >= B + r``, and ``e >= B``."""
    return max(float(batch), (batch + r) / 2)


def default_tolerance(batch: int, r: float, min_size: int) -> float:
    """Acme's 10 % of ``min_size * r``, but at least two batches and ``B + r`` rows
    (``batch=0``, a writer's before any learner: at least one row's ``r`` samples)."""
    return max(TOLERANCE_FRACTION * min_size * r, 2.0 * batch, batch + r)


@dataclasses.dataclass(frozen=True)
class RateLimit:
    """A samples-per-insert rate limit (Reverb's ``SampleToInsertRatio``), on either side.

    The rows a learner hands out stay within ``samples_per_insert * (inserted - min_size)
    +- tolerance``, ``inserted`` counting every row every writer of the store committed.
    Given to a writer (``gr.ReplayWriter(..., rate_limit=)``), it is declared in the store
    before the writer's first row: from then on every writer of the store holds in
    ``flush()`` while it would run ahead, counting ``sampled = 0`` until a learner
    publishes, so at most ``min_size + tolerance / samples_per_insert`` rows (plus the
    flush that crosses ``min_size``, and those of writers flushing at the same instant)
    are committed before the first batch. Given to a learner
    (``gr.UniformReplay(rate_limit=)`` / ``gr.PrioritizedReplay(rate_limit=)``), it holds
    the writers from the moment the loader is built. A learner without a limit takes its
    store's; one whose limit differs is refused.

    Args:
      min_size: no batch until this many rows are live (committed and not evicted).
      samples_per_insert: ``r``, rows handed out per row inserted; None: no ratio
        (then ``min_size`` is only the learner's wait, and writers never hold).
      tolerance: ``e`` in rows. None: the learner's default ``max(0.1 * min_size * r,
        2 * B, B + r)`` (``B`` its global batch); before any learner exists, writers
        hold with ``max(0.1 * min_size * r, r)``.
      timeout: seconds this side may wait (a learner for inserts, a writer's ``flush()``
        for the learner) before raising :class:`~grain_replay.RateLimitTimeoutError`;
        None waits, logging why every 30 s. Each side's own: not part of what both sides
        must agree on, nor of what a store declares.

    Raises:
      InvalidSamplingError: a value out of range (naming it and the fix), or neither
        ``min_size`` nor ``samples_per_insert`` (a limit of nothing).

    Example:
      >>> limit = gr.RateLimit(min_size=1_000, samples_per_insert=8.0)
      >>> writer = gr.ReplayWriter("replay", capacity=100_000, writer_id="actor-0",
      ...                          rate_limit=limit)
      >>> loader = gr.make_data_loader(gr.open_source("replay"), batch_size=256,
      ...                              sampling=gr.UniformReplay(rate_limit=limit))
    """

    min_size: int = 0
    samples_per_insert: float | None = None
    tolerance: float | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        values = check_rate_limit(
            "RateLimit", self.min_size, self.samples_per_insert, self.tolerance, self.timeout
        )
        for name, value in zip(("min_size", "samples_per_insert", "tolerance", "timeout"), values):
            object.__setattr__(self, name, value)
        if not self.min_size and self.samples_per_insert is None:
            raise InvalidSamplingError(
                "RateLimit: expected min_size > 0 or samples_per_insert, got neither "
                f"({self.terms()}): such a limit holds nothing. Fix: pass "
                "samples_per_insert= (and min_size=), or no rate_limit= at all."
            )

    def terms(self) -> str:
        """The terms both sides agree on, as Python: ``RateLimit(min_size=.., ...)``."""
        return (
            f"RateLimit(min_size={self.min_size}, samples_per_insert={self.samples_per_insert!r}"
            f", tolerance={self.tolerance!r})"
        )

    def agrees(self, other: RateLimit) -> bool:
        """Whether ``other`` names the same limit (``timeout`` is each side's own)."""
        return (self.min_size, self.samples_per_insert, self.tolerance) == (
            other.min_size,
            other.samples_per_insert,
            other.tolerance,
        )

    def writer_tolerance(self) -> float | None:
        """The tolerance writers hold with while no learner has published its own."""
        if self.samples_per_insert is None:
            return None
        if self.tolerance is not None:
            return self.tolerance
        return default_tolerance(0, self.samples_per_insert, self.min_size)

    @classmethod
    def of_store(cls, path: str | os.PathLike[str]) -> RateLimit | None:
        """The limit the store at ``path`` declares (its first rate-limited writer's), or
        None; ``timeout`` is None (each side's own).

        Raises:
          InvalidStoreError: the declaration is damaged (naming the file and the fix).
        """
        return read_declared(learners_dir(os.path.abspath(os.fspath(path))))

    def _to_json(self, who: str) -> str:
        return json.dumps(
            {
                "version": _VERSION,
                "min_size": self.min_size,
                "samples_per_insert": self.samples_per_insert,
                "tolerance": self.tolerance,
                "declared_by": who,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "time": time.time(),
            }
        )


def read_declared(directory: str | ObjectFolder) -> RateLimit | None:
    """The limit declared in the learners' folder ``directory``, or None.

    Raises:
      InvalidStoreError: the file is not a declaration this version reads.
    """
    if isinstance(directory, ObjectFolder):
        path = f"{directory}/{LIMIT_FILE}"
        found = directory.read(LIMIT_FILE)
        if found is None:
            return None
        text = found
    else:
        path = os.path.join(directory, LIMIT_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
    try:
        raw = json.loads(text)
        if int(raw["version"]) != _VERSION:
            raise ValueError(f"version {raw['version']!r}, this version reads {_VERSION}")
        return RateLimit(
            min_size=raw["min_size"],
            samples_per_insert=raw["samples_per_insert"],
            tolerance=raw["tolerance"],
        )
    except (ValueError, KeyError, TypeError, InvalidSamplingError) as e:
        raise InvalidStoreError(
            f"{path}: the store's declared rate limit cannot be read ({type(e).__name__}: "
            f"{e}). Expected the JSON a gr.ReplayWriter(..., rate_limit=) writes. Fix: "
            "remove the file while no writer runs (the next writer given rate_limit= "
            "declares the limit again)."
        ) from e


def declare(directory: str | ObjectFolder, limit: RateLimit, who: str) -> RateLimit:
    """Declares ``limit`` in ``directory`` unless a limit is declared there already;
    returns the declared one (``limit`` itself, timeout included, when it agrees).

    The first declaration stays: it is written whole (a temporary file, ``fsync``, then a
    hard link, which fails when the name exists), so two writers declaring at once agree
    on one.

    Raises:
      InvalidSamplingError: the store declares another limit (naming both).
    """
    declared = read_declared(directory)
    if declared is None and isinstance(directory, ObjectFolder):
        directory.create(LIMIT_FILE, limit._to_json(who))  # the first declaration stays
        declared = read_declared(directory)
        assert declared is not None
    if declared is None:
        assert isinstance(directory, str)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, LIMIT_FILE)
        tmp = temp_path(path)
        try:
            with open(tmp, "x", encoding="utf-8") as f:
                f.write(limit._to_json(who))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
                fsync_path(directory)
            except FileExistsError:
                pass  # another writer declared first: compared below
            except OSError:  # no hard links on this file system: exclusive create
                with contextlib.suppress(FileExistsError), open(path, "x") as f:
                    f.write(limit._to_json(who))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        declared = read_declared(directory)
        assert declared is not None
    if not declared.agrees(limit):
        raise InvalidSamplingError(
            f"{who}: rate_limit={limit.terms()} contradicts the limit the store declares, "
            f"{declared.terms()} ({directory}{os.sep if isinstance(directory, str) else '/'}"
            f"{LIMIT_FILE}, written by its "
            "first rate-limited writer). Expected the same min_size, samples_per_insert and "
            f"tolerance on every writer and learner of a store. Fix: pass "
            f"rate_limit={declared.terms()} (or no rate_limit=: every writer of the store "
            "holds by its limit anyway), or remove that file while no writer runs to "
            "declare another."
        )
    return limit
