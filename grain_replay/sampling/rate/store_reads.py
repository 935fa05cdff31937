"""What the learner's side of a rate limit reads from the store it samples.

Its rows inserted (ever committed, evicted ones included) and live
(:class:`StoreCounts`), its learners' folder (:func:`learners_folder`, where
:class:`~grain_replay.sampling.rate.publish.ProgressPublisher` publishes), and the
limit a learner samples by: its options', checked against the one the store
declares, else the store's (:func:`sampling_limit`).
:mod:`grain_replay.sampling.rate.limit` waits on them.
"""

from __future__ import annotations

import logging
from typing import Any

from grain_replay.errors import InvalidSamplingError
from grain_replay.sampling.rate.options import limit_of
from grain_replay.sampling.store_length import probe_copy
from grain_replay.sources.capabilities import OnObjectStorage, ReadsIds, Refreshable
from grain_replay.store import progress as learners_lib
from grain_replay.store.object_folder import ObjectFolder, ObjectInsertedCount
from grain_replay.store.rate_limit import RateLimit, learners_dir, read_declared

__all__ = ["StoreCounts", "learners_folder", "sampling_limit"]

logger = logging.getLogger(__name__)


class StoreCounts:
    """Rows inserted (ever committed, evicted ones included) and live in the store."""

    def __init__(self, source: Any) -> None:
        self.parts = isinstance(source, ReadsIds) and isinstance(getattr(source, "path", None), str)
        self._inserted: learners_lib.InsertedCount | ObjectInsertedCount | None = None
        self._probe: Any = None
        self.grows = True
        if isinstance(source, OnObjectStorage):  # the manifests in the bucket
            self._inserted = source.inserted_count()
            return
        if self.parts:
            self._inserted = learners_lib.InsertedCount(source.path)
            return
        self._probe = probe_copy(source)
        self.grows = isinstance(self._probe, Refreshable)

    def read(self) -> tuple[int, int]:
        if self._inserted is not None:
            return self._inserted.read()
        n = int(self._probe.refresh()) if self.grows else len(self._probe)
        return n, n

    def capacities(self) -> list[int | None]:
        if self._inserted is None:
            return []
        return [m.capacity for m in self._inserted.manifests()]


def learners_folder(source: Any) -> str | ObjectFolder | None:
    """The learners' folder of a local store or of a many-writer store on object storage
    (None: not one, or another URL)."""
    if isinstance(source, OnObjectStorage):
        return source.learners_folder()
    path = getattr(source, "path", None)
    if not isinstance(path, str) or "://" in path:
        return None
    return learners_dir(path)


def sampling_limit(source: Any, options: Any) -> RateLimit | None:
    """The limit a learner over ``source`` samples by: its options', checked against the
    one the store declares, else the store's (timeout: the options').

    Raises:
      InvalidSamplingError: the two contradict (naming both).
    """
    own = limit_of(options)
    directory = learners_folder(source)
    declared = None if directory is None else read_declared(directory)
    if declared is None:
        return own
    owner = type(options).__name__
    if own is None:
        logger.info(
            "%s over %s: samples by the limit the store declares, %s",
            owner,
            getattr(source, "path", source),
            declared.terms(),
        )
        return RateLimit(
            min_size=declared.min_size,
            samples_per_insert=declared.samples_per_insert,
            tolerance=declared.tolerance,
            timeout=getattr(options, "timeout", None),
        )
    if not own.agrees(declared):
        raise InvalidSamplingError(
            f"{owner} over {getattr(source, 'path', source)}: its limit {own.terms()} "
            f"contradicts the one the store declares, {declared.terms()} (written by its "
            "first writer given rate_limit=). Expected one limit per store, on every writer "
            f"and learner. Fix: sample with rate_limit={declared.terms()}, or with no "
            "limit (the learner then takes the store's)."
        )
    return own
