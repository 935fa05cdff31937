"""Uniform replay: rows drawn with replacement from the committed rows of a (growing) store."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.errors import InvalidSamplingError
from grain_replay.sampling.draws import Draws
from grain_replay.sampling.rate.options import set_rate_limit
from grain_replay.sampling.store_length import StoreLength, parse_layout
from grain_replay.sources.base import ReplaySource
from grain_replay.sources.capabilities import Refreshable
from grain_replay.store.rate_limit import RateLimit

__all__ = [
    "UniformReplay",
    "UniformSampler",
    "RowReader",
    "StoreLength",
    "check_refresh_every",
    "reaches",
    "IdTask",
]


def check_refresh_every(value: Any, owner: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise InvalidSamplingError(f"{owner}: refresh_every must be an int or None, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise InvalidSamplingError(
            f"{owner}: refresh_every must be an int or None, got {value!r}"
        ) from None
    if value <= 0:
        raise InvalidSamplingError(
            f"{owner}: refresh_every must be positive (batches between looks for new rows) "
            f"or None (only on refresh()), got {value}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class UniformReplay:
    """Uniform sampling with replacement over the rows committed so far.

    Batch ``t`` of process ``p`` is ``batch_size`` row indices drawn uniformly from
    ``[0, n_t)``, a pure function of ``(seed, p, t, n_t)``, where ``n_t`` is the
    store's length as last seen: the loader looks for newly committed rows (a
    ``ReplayWriter`` appending in this or another process) every ``refresh_every``
    batches and when the iterator's ``refresh()`` is called. No epochs and no
    array of size N: a draw is O(batch).

    [`PrioritizedReplay`][grain_replay.sampling.priority_options.PrioritizedReplay] takes
    the same ``refresh_every`` and rate-limit arguments, documented here once.

    Args:
      refresh_every: batches between looks for new rows (re-reading the store's
        metadata, ~a file read); None looks only when ``refresh()`` is called.
      min_size: no batch until this many rows are live (committed and not evicted).
      samples_per_insert: ``r``: rows handed out per row inserted. The rows handed
        out stay within ``r * (inserted - min_size) +- tolerance``, ``inserted``
        counting every row every writer committed (evicted ones included): the
        learner waits when ahead, and the store's writers wait in ``flush()`` when
        ahead, from the moment the loader is built. None: no ratio.
      tolerance: ``e`` in rows; default ``max(0.1 * min_size * r, 2 * B, B + r)``
        (Acme's 10 %, at least what progress needs; ``B`` the global batch).
      timeout: seconds the learner may wait for inserts before raising
        :class:`~grain_replay.RateLimitTimeoutError`; None waits, logging why
        every 30 s. See docs/rate_limits.md.
      rate_limit: the four above as one :class:`~grain_replay.RateLimit`, the value its
        store's writers are given too (the flat fields are a shorthand: one given as well
        must say the same). The writers are held from the moment the loader is built.
        Without a limit here, a store that declares one (a writer's ``rate_limit=``)
        lends the learner its limit; a limit that differs from the store's is refused.

    Examples:
      >>> loader = gr.make_data_loader(src, batch_size=256, sampling=gr.UniformReplay())
    """

    refresh_every: int | None = 16
    min_size: int = 0
    samples_per_insert: float | None = None
    tolerance: float | None = None
    timeout: float | None = None
    rate_limit: RateLimit | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "refresh_every", check_refresh_every(self.refresh_every, "UniformReplay")
        )
        set_rate_limit(self)


class UniformSampler:
    """Consumer side of :class:`UniformReplay`: the row indices of each step."""

    def __init__(
        self,
        source: Any,
        options: UniformReplay,
        batch_size: int,
        *,
        seed: int,
        shard_index: int = 0,
    ) -> None:
        self.options = options
        self._length = StoreLength(source, options.refresh_every)
        self._batch_size = batch_size
        self._draws = Draws(seed, shard_index, batch_size)
        self._step = 0
        self._source = source

    def refresh(self) -> None:
        self._length.request()

    @property
    def source(self) -> Any:
        """The store the rows are drawn from."""
        return self._source

    @property
    def bound(self) -> int:
        """The length the last draw drew below."""
        return self._length.n

    def draw(self) -> np.ndarray:
        n = self._length.at(self._step)
        if n == 0:
            raise InvalidSamplingError(
                f"{self._source!r} has no committed rows to replay. Fix: append and flush rows "
                "with a ReplayWriter before the first batch."
            )
        ids = self._draws.integers(self._step, n)
        self._step += 1
        return ids

    def task(self, rows: np.ndarray) -> Any:
        """What the reader is sent for ``rows`` drawn now: ``(rows, bound)``, or the rows'
        ids (``IdTask``) for a bounded store, whose positions move between snapshots."""
        if self._length.by_id:
            return IdTask(self._length.ids(rows))
        return rows, self.bound

    def commit_watermark(self) -> dict[str, int] | None:
        """Each writer's committed rows in the snapshot the draws come from (by-id stores;
        None for a plain store, whose watermark is :attr:`bound`)."""
        return self._length.commit_watermark()

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self._step, "n": self._length.n}
        if self._length.by_id:  # the positions' layout: a restore draws the same rows
            out["writers"] = self._length.layout()
        return out

    def set_state(self, state: Mapping[str, Any]) -> None:
        step, n = int(state["step"]), int(state["n"])
        layout = state.get("writers")
        pinned = parse_layout(layout, n) if layout is not None and self._length.by_id else None
        self._step = step
        self._length.n = n
        self._length.pin(pinned)


class IdTask:
    """Rows by id (``PartsDataSource.ids``): read against whatever snapshot the reader holds."""

    __slots__ = ("ids",)

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids

    def __getstate__(self) -> np.ndarray:
        return self.ids

    def __setstate__(self, ids: np.ndarray) -> None:
        self.ids = ids


def reaches(source: Any, bound: int) -> bool:
    """Whether ``source`` holds the rows below ``bound``, refreshing it first if not yet.

    Rows are drawn in the consuming process from the length it saw; the copy of
    the source that reads them (in a worker, say) may not have seen the commit.
    """
    if bound > len(source):
        if isinstance(source, Refreshable):
            source.refresh()
    return bound <= len(source)


class RowReader:
    """Worker side: ``read_batch`` of a step's rows, looking for new rows when one is past the end.

    A task is ``(rows, bound)``: the rows were drawn below ``bound``, the length
    the consuming process saw, which may be more than this process's copy of
    the source has seen yet. A bare array of rows (a restored draw) is checked
    row by row.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        # grain_replay's stores read drawn rows without checking them again.
        self._trusted = isinstance(source, ReplaySource)

    def __call__(self, task: Any) -> Any:
        if isinstance(task, IdTask):
            # A row evicted before this process opened it: another live row of its
            # writer, as good a uniform draw (never a torn or mislabeled row).
            return self.source.read_ids(task.ids, evicted="replace")
        if isinstance(task, tuple):
            rows, bound = task
        else:
            rows = np.asarray(task)
            bound = int(rows.max()) + 1 if len(rows) else 0
        if self._trusted and reaches(self.source, bound):
            return self.source.read_batch(rows, check=False)
        return self.source.read_batch(rows)

    def __repr__(self) -> str:
        return f"RowReader({self.source!r})"
