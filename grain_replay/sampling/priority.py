"""Prioritized replay (Schaul et al. 2016): proportional sampling from a sum tree in numpy."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from grain_replay.errors import (
    InvalidPriorityError,
    InvalidSamplingError,
    PriorityIndexError,
    ReplayCheckpointError,
)
from grain_replay.sampling.draws import Draws
from grain_replay.sampling.rate_options import set_rate_limit
from grain_replay.sampling.replay import StoreLength, check_refresh_every
from grain_replay.sampling.sumtree import SumTree

__all__ = ["PrioritizedReplay", "Sampled", "PrioritySampler"]


class Sampled(NamedTuple):
    """A prioritized batch: ``data`` (the rows), ``index`` (int64 row indices) and ``weight``.

    ``weight`` holds float32 importance-sampling weights, ``(p_min / p_i) ** beta``
    with ``p = (priority + eps) ** alpha`` and ``p_min`` the smallest over this
    process's rows: 1 for the least likely row, below 1 for the others. A
    NamedTuple, so it flows through ``sharded_device_put`` like any pytree.
    """

    data: Any
    index: np.ndarray  # type: ignore[assignment]  # shadows tuple.index, as the contract names it
    weight: np.ndarray


def _check_float(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise InvalidSamplingError(f"PrioritizedReplay: {name} must be a float, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidSamplingError(
            f"PrioritizedReplay: {name} must be in [{low}, {high}], got {value}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class PrioritizedReplay:
    """Proportional prioritized replay over a source or a growing store.

    Row ``i`` is drawn with probability ``p_i / sum(p)``, ``p_i = (priority_i + eps) **
    alpha``; a batch is stratified (one draw in each of ``batch_size`` equal slices
    of the total), as in Schaul et al. New rows get the largest priority given so
    far (1.0 before any update). Batches are :class:`Sampled` tuples; the learner
    gives new priorities with ``update_priorities(index, priorities)`` on the
    iterator it holds.

    Args:
      alpha: how much priorities count (0: uniform).
      beta: importance-sampling exponent in ``[0, 1]``, or a callable of the step
        returning it (annealed towards 1).
      eps: added to every priority, so no row is never drawn.
      refresh_every: batches between looks for newly committed rows; None looks
        only when the iterator's ``refresh()`` is called.
      min_size: no batch until this many rows are live (committed and not evicted).
      samples_per_insert: ``r``: rows handed out per row inserted. The rows handed
        out stay within ``r * (inserted - min_size) +- tolerance``, ``inserted``
        counting every row every writer committed (evicted ones included): the
        learner waits when ahead, and the store's writers wait in ``flush()`` when
        ahead, from the learner's first batch on. None: no ratio.
      tolerance: ``e`` in rows; default ``max(0.1 * min_size * r, 2 * B, B + r)``
        (Acme's 10 %, at least what progress needs; ``B`` the global batch).
      timeout: seconds the learner may wait for inserts before raising
        :class:`~grain_replay.RateLimitTimeoutError`; None waits, logging why
        every 30 s. See docs/rate_limits.md.

    Example:
      >>> loader = gr.make_data_loader(src, batch_size=256, num_epochs=None,
      ...                              sampling=gr.PrioritizedReplay(alpha=0.6, beta=0.4))
      >>> it = iter(loader); batch = next(it)
      >>> it.update_priorities(batch.index, td_errors)
    """

    alpha: float = 0.6
    beta: float | Callable[[int], float] = 0.4
    eps: float = 1e-6
    refresh_every: int | None = 16
    min_size: int = 0
    samples_per_insert: float | None = None
    tolerance: float | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", _check_float("alpha", self.alpha, 0.0, 1e3))
        if not callable(self.beta):
            object.__setattr__(self, "beta", _check_float("beta", self.beta, 0.0, 1.0))
        object.__setattr__(self, "eps", _check_float("eps", self.eps, 0.0, 1e30))
        object.__setattr__(
            self,
            "refresh_every",
            check_refresh_every(self.refresh_every, "PrioritizedReplay"),
        )
        set_rate_limit(self)

    def beta_at(self, step: int) -> float:
        """``beta`` at ``step`` (checked when it comes from a schedule)."""
        if callable(self.beta):
            return _check_float(f"beta({step})", self.beta(step), 0.0, 1.0)
        return self.beta


_STATE_VERSION = 1


class PrioritySampler:
    """Consumer side of :class:`PrioritizedReplay`, over this process's share of the rows.

    Process ``p`` of ``P`` owns the rows ``i`` with ``i % P == p`` (a growing store
    spreads its new rows over every process). Updates are checked at once and
    applied just before the first draw allowed to see them: an update stamped
    ``s`` (the loader position it follows) reaches draws of steps ``>= s + lag``.
    That keeps the draws a function of the seed and the sequence of updates, even
    when the draws run ahead of the learner on another thread.
    """

    def __init__(
        self,
        source: Any,
        options: PrioritizedReplay,
        batch_size: int,
        *,
        seed: int,
        lag: int,
        shard_index: int = 0,
        shard_count: int = 1,
    ) -> None:
        self.options = options
        self._source = source
        self._length = StoreLength(source, options.refresh_every)
        self._batch_size = batch_size
        self._draws = Draws(seed, shard_index, batch_size)
        self._offsets = np.arange(batch_size, dtype=np.float64)  # stratum of each row
        self.lag = lag
        self._p = shard_index
        self._count = shard_count
        self._tree = SumTree()
        self._max = 1.0  # largest priority given so far (raw, before eps and alpha)
        self._seen = np.zeros(0, dtype=bool)  # local rows ever drawn
        self._pending: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._lock = threading.Lock()

    @property
    def source(self) -> Any:
        """The store the rows are drawn from."""
        return self._source

    def _local_count(self, n: int) -> int:
        return max(0, -(-(n - self._p) // self._count))

    def _leaf(self, priorities: Any) -> Any:
        return (priorities + self.options.eps) ** self.options.alpha

    def refresh(self) -> None:
        self._length.request()

    def _grow(self, step: int) -> None:
        local = self._local_count(self._length.at(step))
        if local > len(self._tree):
            self._tree.extend(local, float(self._leaf(np.float64(self._max))))
            seen = np.zeros(local, dtype=bool)
            seen[: len(self._seen)] = self._seen
            self._seen = seen

    @property
    def bound(self) -> int:
        """The length the last draw drew below (its rows are < it)."""
        return self._length.n

    def draw(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Step ``step``'s global row indices (int64) and importance weights (float32)."""
        with self._lock:
            self._apply(step)
            self._grow(step)
            total = self._tree.total
            if len(self._tree) == 0 or total <= 0:
                raise InvalidSamplingError(
                    f"{self._source!r} has no committed rows for process {self._p} of "
                    f"{self._count} to replay. Fix: append and flush rows with a ReplayWriter "
                    "before the first batch."
                )
            b = self._batch_size
            u = self._draws.uniforms(step)
            u += self._offsets
            u *= total / b
            local = self._tree.find(u)
            p = self._tree.get(local)
            weight = (self._tree.min / p) ** self.options.beta_at(step)
            self._seen[local] = True
            return local * self._count + self._p, weight.astype(np.float32)

    def apply_updates(self, step: int) -> None:
        """Writes the queued updates that the draw of ``step`` may see into the tree."""
        with self._lock:
            self._apply(step)

    def _apply(self, step: int) -> None:
        keep = []
        for stamp, local, priorities in self._pending:
            if stamp + self.lag <= step:
                self._tree.set(local, self._leaf(priorities))
                self._max = max(self._max, float(priorities.max(initial=0.0)))
            else:
                keep.append((stamp, local, priorities))
        self._pending = keep

    def update(self, index: Any, priorities: Any, stamp: int) -> None:
        """Checks an update at once and queues it for the draws from ``stamp + lag`` on.

        Raises:
          InvalidPriorityError: wrong length, or a priority negative, NaN or infinite.
          PriorityIndexError: a row that this process never handed out.
        """
        index, priorities = self._checked(index, priorities)
        with self._lock:
            n_local = len(self._seen)
            if self._count == 1:
                local = index
                unknown = (index < 0) | (index >= n_local)
            else:
                local, rest = np.divmod(index, self._count)
                unknown = (index < 0) | (rest != self._p) | (local >= n_local)
            if unknown.any():
                unknown[~unknown] = ~self._seen[local[~unknown]]
            else:  # the usual case: all in range, one gather
                unknown = ~self._seen[local]
            if unknown.any():
                rows = index[unknown][:5].tolist()
                raise PriorityIndexError(
                    f"update_priorities: rows {rows} were never handed out by this iterator "
                    f"(process {self._p} of {self._count} draws rows i with i % "
                    f"{self._count} == {self._p}). Nothing was updated. Fix: pass the .index "
                    "of batches from this iterator."
                )
            self._pending.append((int(stamp), local, priorities))

    @staticmethod
    def _checked(index: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(index, priorities)`` as flat int64 and float64, checked (nothing changes)."""
        index = np.asarray(index)
        priorities = np.asarray(priorities)
        if index.size != priorities.size:
            raise InvalidPriorityError(
                f"update_priorities got {index.size} indices but {priorities.size} priorities. "
                "Fix: pass one priority per index (e.g. the batch's index and its TD errors)."
            )
        if index.size and not np.issubdtype(index.dtype, np.integer):
            raise InvalidPriorityError(
                f"update_priorities: index must hold integers (a batch's .index), got "
                f"dtype {index.dtype}."
            )
        index = index.reshape(-1).astype(np.int64)
        priorities = priorities.reshape(-1).astype(np.float64)
        bad = ~np.isfinite(priorities) | (priorities < 0)
        if bad.any():
            where = np.flatnonzero(bad)[:5]
            raise InvalidPriorityError(
                f"update_priorities: priorities must be finite and >= 0; got "
                f"{priorities[where].tolist()} at positions {where.tolist()} (rows "
                f"{index[where].tolist()}). Nothing was updated. Fix: pass abs(td_error), "
                "with NaNs removed."
            )
        return index, priorities

    # -- checkpointing -------------------------------------------------------

    def state(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        """Arrays that restore the priorities exactly: tree values, pending updates, ...

        Args:
          copy: False returns a read-only view of the tree's values, valid until the
            next draw (for a caller that encodes them at once, holding off draws).
        """
        with self._lock:
            counts = [len(x) for _, x, _ in self._pending]
            return {
                "version": np.array(_STATE_VERSION, dtype=np.int64),
                "shard": np.array([self._p, self._count], dtype=np.int64),
                "options": np.array(
                    [self.options.alpha, self.options.eps, self.lag], dtype=np.float64
                ),
                "n": np.array(self._length.n, dtype=np.int64),
                "values": self._tree.values.copy() if copy else self._tree.values,
                "max_priority": np.array(self._max, dtype=np.float64),
                "seen": np.packbits(self._seen),
                "pending_stamp": np.array([s for s, _, _ in self._pending], dtype=np.int64),
                "pending_count": np.array(counts, dtype=np.int64),
                "pending_index": np.concatenate(
                    [np.zeros(0, np.int64)] + [x for _, x, _ in self._pending]
                ),
                "pending_priority": np.concatenate(
                    [np.zeros(0)] + [p for _, _, p in self._pending]
                ),
            }

    def _parse(self, state: Mapping[str, Any]) -> tuple[Any, ...]:
        """:meth:`state`'s arrays, checked against this sampler's settings (nothing changes)."""
        try:
            version = int(state["version"])
            shard = np.asarray(state["shard"]).tolist()
            options = np.asarray(state["options"]).tolist()
            n = int(state["n"])
            values = np.asarray(state["values"], dtype=np.float64)
            seen = np.unpackbits(np.asarray(state["seen"], dtype=np.uint8))[: len(values)]
            counts = np.asarray(state["pending_count"], dtype=np.int64)
            stamps = np.asarray(state["pending_stamp"], dtype=np.int64)
            index = np.asarray(state["pending_index"], dtype=np.int64)
            prio = np.asarray(state["pending_priority"], dtype=np.float64)
            max_priority = float(state["max_priority"])
        except (KeyError, TypeError, ValueError) as e:
            raise ReplayCheckpointError(
                f"Not a prioritized-replay state ({type(e).__name__}: {e}). Fix: pass what "
                "priority_state() returned."
            ) from e
        want = [self.options.alpha, self.options.eps, self.lag]
        if version != _STATE_VERSION or shard != [self._p, self._count] or options != want:
            raise ReplayCheckpointError(
                f"The priority state was saved by process {shard[0]} of {shard[1]} with "
                f"(alpha, eps, lag)={tuple(options)}; this is process {self._p} of "
                f"{self._count} with {tuple(want)}. Fix: restore each process's own state "
                "with the same PrioritizedReplay, worker_count and worker_buffer_size."
            )
        if len(values) != self._local_count(n) or len(seen) != len(values):
            raise ReplayCheckpointError(
                f"The priority state holds {len(values)} rows, but {n} committed rows give "
                f"process {self._p} {self._local_count(n)}. Fix: pass it unchanged."
            )
        if int(counts.sum()) != len(index) or len(index) != len(prio) or len(stamps) != len(counts):
            raise ReplayCheckpointError(
                f"The priority state's pending updates are inconsistent ({len(stamps)} stamps, "
                f"{len(counts)} counts summing to {int(counts.sum())}, {len(index)} rows, "
                f"{len(prio)} priorities). Fix: pass it unchanged."
            )
        return n, values, seen, counts, stamps, index, prio, max_priority

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raises what :meth:`set_state` would raise, changing nothing."""
        self._parse(state)

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state` (checked against this sampler's settings first)."""
        n, values, seen, counts, stamps, index, prio, max_priority = self._parse(state)
        pending = []
        for stamp, end, count in zip(stamps, np.cumsum(counts), counts):
            pending.append((int(stamp), index[end - count : end], prio[end - count : end]))
        with self._lock:
            self._tree = SumTree.from_values(values)
            self._seen = seen.astype(bool)
            self._max = max_priority
            self._pending = pending
            self._length.n = n
