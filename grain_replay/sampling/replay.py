"""Uniform replay: rows drawn with replacement from the committed rows of a (growing) store."""

from __future__ import annotations

import dataclasses
import operator
import os
import pickle
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.errors import InvalidSamplingError, ReplayCheckpointError
from grain_replay.sampling.draws import Draws
from grain_replay.sampling.rate.options import set_rate_limit
from grain_replay.sources.base import ReplaySource
from grain_replay.sources.capabilities import ReadsIds, Refreshable
from grain_replay.store import parts as parts_lib
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


def _stamp(path: str) -> tuple[int, int, int] | None:
    """``(mtime_ns, size, inode)`` of ``path``, None if it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _tick_bound(mtime_ns: int) -> int:
    """Nanoseconds after a change within which another change may share its mtime.

    File systems that keep nanoseconds (ext4, xfs, btrfs, tmpfs, overlayfs)
    stamp with the kernel's coarse clock, a tick of at most 10 ms: 50 ms is
    safe. A whole-millisecond mtime suggests a coarse file system (FAT, HFS+,
    ext3, some network file systems): 2 s.
    """
    return 2_000_000_000 if mtime_ns % 1_000_000 == 0 else 50_000_000


def probe_copy(source: Any) -> Any:
    """An independent copy of a growing ``source`` to refresh apart from the one that
    reads (grain_replay's sources pickle without handles); ``source`` itself when it
    cannot grow or does not pickle."""
    if isinstance(source, Refreshable):
        try:
            return pickle.loads(pickle.dumps(source))
        except Exception:
            return source
    return source


class StoreLength:
    """The committed length of a source, re-read on a schedule of steps or on request.

    The length is read from a copy of the source that never reads rows (its
    ``refresh()`` re-reads the metadata only), so looking costs no reopening of the
    store's files; the reading copy refreshes only when a drawn row is past its end
    (:class:`RowReader`). A scheduled look at a local store first compares the
    store's ``stat`` (a commit replaces the metadata file, which changes the
    directory's or the file's mtime) and re-reads the metadata only on a change
    (and once more after the file system's clock has ticked, in case a second
    commit shared the first one's mtime); ``refresh()`` always re-reads.
    """

    def __init__(self, source: Any, refresh_every: int | None) -> None:
        self._every = refresh_every
        self._forced = False
        self.looks = 0  # times the length was re-read
        self.n = len(source)
        self.source = source  # the store (for its checkpoint's watermark)
        self._stamp: tuple[int, int, int] | None = None
        self._settled = False  # whether the stamp was seen after its tick had passed
        self._probe = probe_copy(source)
        # By-id stores: the snapshot's writers as [writer_id, ordinal, live_start,
        # committed] (made once per look), and a restored checkpoint's layout that the
        # positions map through until the next look (None: the probe's snapshot).
        self._layout: list[list[Any]] | None = None
        self._pinned: list[list[Any]] | None = None

    @property
    def by_id(self) -> bool:
        """Whether rows travel as ids: a bounded or many-writer store, whose positions
        move as writers evict (see :class:`grain_replay.sources.PartsDataSource`)."""
        return isinstance(self._probe, ReadsIds)

    @property
    def writers(self) -> list[Any]:
        """The writers' manifests of the snapshot the length was read from (by-id stores)."""
        writers: list[Any] = self._probe.writers
        return writers

    def layout(self) -> list[list[Any]]:
        """The writers the positions map through (by-id stores), oldest row first each:
        ``[writer_id, ordinal, live_start, committed]`` in reading order. Not to be mutated."""
        if self._pinned is not None:
            return self._pinned
        if self._layout is None:
            self._layout = [
                [m.writer_id, int(m.ordinal), int(m.live_start), int(m.committed)]
                for m in self.writers
            ]
        return self._layout

    @property
    def bound(self) -> int:
        """The length the last draw drew below (a plain store's watermark)."""
        return self.n

    def commit_watermark(self) -> dict[str, int] | None:
        """Each writer's committed rows in the snapshot the draws come from (by-id stores;
        None for a plain store, whose watermark is :attr:`bound`)."""
        if not self.by_id:
            return None
        return {w: hi for w, _, _, hi in self.layout()}

    def pin(self, layout: list[list[Any]] | None) -> None:
        """Maps positions through ``layout`` (a checkpoint's, checked by :func:`parse_layout`)
        until the next look, as the run that saved it did: the rows drawn stay below its
        watermark until then. None: through the probe's snapshot."""
        self._pinned = layout

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """The row ids of ``positions`` in the snapshot the length was read from."""
        if self._pinned is None:
            ids: np.ndarray = self._probe.ids(positions, check=False)
            return ids
        table = np.array([row[1:] for row in self._pinned], dtype=np.int64).reshape(-1, 3)
        ordinal, lo, hi = table.T
        starts = np.concatenate([[0], np.cumsum(hi - lo)])
        pos = np.asarray(positions, dtype=np.int64)
        p = np.searchsorted(starts, pos, side="right") - 1
        return parts_lib.make_ids(ordinal[p], lo[p] + pos - starts[p])

    def _changed(self) -> bool:
        """False only when the local store's stat is what it was at the last look."""
        if self.by_id:
            return True  # its refresh() is the listing of what changed
        path = getattr(self._probe, "path", None)
        if not isinstance(path, str) or "://" in path:
            return True
        stamp = _stamp(path)
        if stamp is None:
            return True
        # Two commits within one tick of the file system's clock leave the same
        # stamp. A stamp first seen within a tick of its change is confirmed by
        # one more look once that tick has surely passed.
        recent = time.time_ns() - stamp[0] < _tick_bound(stamp[0])
        if stamp != self._stamp:
            self._stamp, self._settled = stamp, not recent
            return True
        if not self._settled and not recent:
            self._settled = True
            return True
        return False

    def request(self) -> None:
        """The next draw re-reads the length."""
        self._forced = True

    def at(self, step: int) -> int:
        """The length to draw step ``step`` from (re-read when due)."""
        due = self._forced or (
            self._every is not None and step % self._every == 0 and self._changed()
        )
        if due:
            self._forced = False
            self.looks += 1
            probe = self._probe
            n = int(probe.refresh()) if isinstance(probe, Refreshable) else len(probe)
            self._layout = self._pinned = None
            # A reader never goes back: a store is only appended to (a bounded
            # store's positions are its snapshot's, whatever their count).
            self.n = n if self.by_id else max(self.n, n)
        return self.n


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


def parse_layout(layout: Any, n: int) -> list[list[Any]]:
    """A saved positions' layout (``[writer_id, ordinal, live_start, committed]`` a writer)
    as :meth:`StoreLength.pin` takes it.

    Raises:
      ReplayCheckpointError: it is malformed, or its live rows are not the state's ``n``.
    """
    try:
        out: list[list[Any]] = [[str(w), int(o), int(lo), int(hi)] for w, o, lo, hi in layout]
    except (TypeError, ValueError) as e:
        raise ReplayCheckpointError(
            f"Not a uniform replay state: its writers' layout is malformed ({e}). Fix: pass "
            "bytes from get_state() of a loader made with the same arguments."
        ) from None
    bad = any(o < 0 or not 0 <= lo <= hi for _, o, lo, hi in out)
    if bad or sum(hi - lo for _, _, lo, hi in out) != n:
        raise ReplayCheckpointError(
            f"Not a uniform replay state: its writers' layout {out} does not hold the {n} "
            "live rows it drew from. Fix: pass bytes from get_state() of a loader made "
            "with the same arguments."
        )
    return out


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
