"""Mixtures: exact per-batch counts by largest remainder, each source on its own permutation.

Step ``t`` gives source ``s`` the quota ``batch_size * w_s(t) + d_s``, where ``d_s`` is
what earlier steps owed it (target rows minus rows given). The counts are the
largest-remainder rounding of the quotas: they sum to the batch size, and the
debt stays in ``(-1, 1)``, so the rounding error never drifts. Source ``s``
reads positions ``[C_s, C_s + count)`` of its own endless stream of seeded
epochs (``C_s`` = rows it gave so far), one ``read_batch`` per source per batch.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidSamplingError
from grain_replay.pipeline.batches import CACHED_ORDER_MAX_RECORDS
from grain_replay.pipeline.shuffle import epoch_order, permute
from grain_replay.sampling.draws import Draws
from grain_replay.sampling.store_length import StoreLength, parse_layout

__all__ = ["apportion", "MixtureSampler"]

# Below CACHED_ORDER_MAX_RECORDS (the loader's threshold) a source's epoch order is
# computed once per epoch (int32) and sliced; above, each batch permutes its own slice.

Weights = Mapping[str, float] | Callable[[int], Mapping[str, float]]
# Steps a mixture with fixed weights draws at once.
_BLOCK = 16


def apportion(quotas: Sequence[float] | np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder rounding of nonnegative ``quotas`` (summing to ``total``) to ints.

    Ties go to the earlier entry; a zero quota never receives a row.
    """
    return np.array(_apportion([float(q) for q in quotas], total), dtype=np.int64)


def _apportion(quotas: list[float], total: int) -> list[int]:
    """:func:`apportion` on a short list (a mixture has a few sources: no numpy per batch)."""
    q = [x if x > 0.0 else 0.0 for x in quotas]
    counts = [math.floor(x) for x in q]
    short = total - sum(counts)
    if short > 0:
        rest = [x - c if x > 0 else -1.0 for x, c in zip(q, counts)]
        for i in sorted(range(len(q)), key=lambda i: -rest[i])[:short]:  # stable: ties go first
            counts[i] += 1
    elif short < 0:  # only from float noise in the quotas' sum: take back from the smallest
        rest = [x - c if c > 0 else math.inf for x, c in zip(q, counts)]
        for i in sorted(range(len(q)), key=lambda i: rest[i])[:-short]:
            counts[i] -= 1
    return counts


def _next_counts(
    weights: list[float], debt: list[float], batch_size: int
) -> tuple[list[int], list[float]]:
    """One step's rows per source and the debt after it (see the module docstring)."""
    quotas = [batch_size * w + d for w, d in zip(weights, debt)]
    counts = _apportion(quotas, batch_size)
    return counts, [q - c for q, c in zip(quotas, counts)]


def _check_weights(weights: Mapping[str, float], names: tuple[str, ...], step: int) -> np.ndarray:
    where = f"weights at step {step}" if step >= 0 else "weights"
    if not isinstance(weights, Mapping):
        raise InvalidSamplingError(
            f"{where} must be a mapping from source name to weight, got "
            f"{type(weights).__name__}. Fix: return e.g. {{{names[0]!r}: 1.0}}."
        )
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise InvalidSamplingError(
            f"{where} name sources {unknown} that are not in the mixture {list(names)}."
        )
    w = np.array([float(weights.get(n, 0.0)) for n in names])
    bad = [n for n, x in zip(names, w) if not math.isfinite(x) or x < 0]
    if bad:
        raise InvalidSamplingError(
            f"{where}: the weights of {bad} are negative, NaN or infinite ({dict(weights)}). "
            "Fix: give finite weights >= 0."
        )
    if w.sum() <= 0:
        raise InvalidSamplingError(
            f"{where} sum to 0 ({dict(weights)}). Fix: give at least one source a weight > 0."
        )
    return w / w.sum()


class MixtureSampler:
    """Consumer side: the per-source record ids of each batch, in step order.

    Args:
      sizes: name -> number of records of each source, in mixture order.
      weights: a mapping of name -> weight, or a callable of the step returning one.
      batch_size: rows per batch in this process.
      seed, shuffle: each source walks its own seeded permutations (or its order).
      shard_index, shard_count: this process's disjoint share of every source's stream.
      lengths: with replay, each source's committed length (``StoreLength``): rows
        are drawn uniformly with replacement from what each source committed so
        far (an online store that grows), instead of walking epochs.
    """

    def __init__(
        self,
        sizes: Mapping[str, int],
        weights: Weights,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool,
        shard_index: int = 0,
        shard_count: int = 1,
        lengths: Sequence[StoreLength] | None = None,
    ) -> None:
        self.names = tuple(sizes)
        self._lengths = None if lengths is None else list(lengths)
        self.sizes = tuple(int(sizes[n]) for n in self.names)
        self._weights = weights
        self._fixed = None if callable(weights) else _check_weights(weights, self.names, -1)
        self._fixed_list = None if self._fixed is None else self._fixed.tolist()
        self.batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._shard_index = shard_index
        self._shard_count = shard_count
        # Python floats and ints: a few sources, so lists beat numpy's per-call cost.
        self._debt = [0.0] * len(self.names)
        self._given = [0] * len(self.names)  # rows per process so far
        self._draws = (
            None
            if lengths is None
            else [
                Draws(seed, s * shard_count + shard_index, batch_size)
                for s in range(len(self.names))
            ]
        )
        self._step = 0
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # (source, epoch) -> order
        # Steps drawn ahead, each with the state after it (see _draw_ahead).
        self._ahead: collections.deque[tuple[dict[str, np.ndarray], list[float], list[int]]]
        self._ahead = collections.deque()
        self._blocked = self._fixed is not None and lengths is None and shard_count == 1

    @property
    def replay(self) -> bool:
        """Whether rows are drawn with replacement from growing sources."""
        return self._lengths is not None

    def weights_at(self, step: int) -> np.ndarray:
        """The normalized weights of ``step``."""
        if self._fixed is not None:
            return self._fixed
        assert callable(self._weights)
        return _check_weights(self._weights(step), self.names, step)

    def _weights_list(self) -> list[float]:
        return self._fixed_list or self.weights_at(self._step).tolist()

    def counts(self) -> np.ndarray:
        """The next step's rows per source, without drawing it."""
        counts, _ = _next_counts(self._weights_list(), self._debt, self.batch_size)
        return np.array(counts, dtype=np.int64)

    def draw(self) -> dict[str, np.ndarray]:
        """The next batch: source name -> record ids (only sources with rows)."""
        if self._blocked:
            if not self._ahead:
                self._draw_ahead()
            ahead, self._debt, self._given = self._ahead.popleft()
            self._step += 1
            return ahead
        counts, debt = _next_counts(self._weights_list(), self._debt, self.batch_size)
        task: dict[str, np.ndarray] = {}
        for s, (name, c) in enumerate(zip(self.names, counts)):
            if c:
                task[name] = self._ids(s, self._given[s], c)
        self._debt = debt
        self._given = [g + c for g, c in zip(self._given, counts)]
        self._step += 1
        return task

    def _draw_ahead(self) -> None:
        """Draws the next ``_BLOCK`` steps at once (fixed weights, one process, epochs).

        Then each source's rows of those steps are one contiguous stretch of its
        stream: one slice of its epoch order, cut into the steps' shares. The
        steps and the state after each are exactly those of step-by-step draws.
        """
        weights = self._fixed_list
        assert weights is not None
        debt, given = self._debt, self._given
        steps = []  # (counts, debt after, given after) of each step
        for _ in range(_BLOCK):
            counts, debt = _next_counts(weights, debt, self.batch_size)
            given = [g + c for g, c in zip(given, counts)]
            steps.append((counts, debt, given))
        tasks: list[dict[str, np.ndarray]] = [{} for _ in steps]
        for s, name in enumerate(self.names):
            total = sum(counts[s] for counts, _, _ in steps)
            if not total:
                continue
            ids = self._ids(s, self._given[s], total)
            at = 0
            for task, (counts, _, _) in zip(tasks, steps):
                if counts[s]:
                    task[name] = ids[at : at + counts[s]]
                    at += counts[s]
        self._ahead.extend((task, debt, given) for task, (_, debt, given) in zip(tasks, steps))

    @property
    def lengths(self) -> list[StoreLength] | None:
        """With replay, each source's committed length, in mixture order (else None)."""
        return self._lengths

    def refresh(self) -> None:
        """With replay: every source looks for new rows before the next draw."""
        for length in self._lengths or ():
            length.request()

    def _ids(self, s: int, given: int, count: int) -> np.ndarray:
        if self._lengths is not None:
            n = self._lengths[s].at(self._step)
            if n == 0:
                raise InvalidSamplingError(
                    f"Step {self._step} gives source {self.names[s]!r} {count} rows, but it has "
                    "no committed rows yet. Fix: commit rows first, or give it weight 0 until "
                    "it has some."
                )
            assert self._draws is not None
            # The first `count` numbers of a full batch's are integers(..., count, n).
            rows = self._draws[s].integers(self._step, n)[:count]
            # A bounded store's positions move between snapshots: its rows travel by id.
            return self._lengths[s].ids(rows) if self._lengths[s].by_id else rows
        n = self.sizes[s]
        start = given * self._shard_count + self._shard_index * count
        first, at = divmod(start, n)
        if self._shuffle and n <= CACHED_ORDER_MAX_RECORDS and at + count <= n:
            return self._order(s, first)[at : at + count].astype(np.int64)  # within one epoch
        pos = np.arange(start, start + count, dtype=np.int64)
        if not self._shuffle:
            return pos % n
        epoch, offset = np.divmod(pos, n)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epoch):  # a batch spans at most a few epochs
            sel = epoch == e
            if n <= CACHED_ORDER_MAX_RECORDS:
                out[sel] = self._order(s, int(e))[offset[sel]]
            else:
                out[sel] = permute(offset[sel], n, self._source_seed(s), int(e))
        return out

    def _source_seed(self, s: int) -> int:
        # Each source has its own seed stream: (seed, source position) -> epochs.
        return (self._seed ^ (0x5EED * (s + 1))) & ((1 << 64) - 1)

    def _order(self, s: int, epoch: int) -> np.ndarray:
        order = self._orders.get((s, epoch))
        if order is None:
            n = self.sizes[s]
            order = epoch_order(n, self._source_seed(s), epoch)
            # Keep this and the previous epoch of each source (a batch may span both).
            self._orders = {k: v for k, v in self._orders.items() if k[0] != s or k[1] >= epoch - 1}
            self._orders[(s, epoch)] = order
        return order

    def state(self) -> dict[str, Any]:
        """JSON-able state before the next draw (floats round-trip exactly through JSON)."""
        state: dict[str, Any] = {
            "step": self._step,
            "debt": list(self._debt),
            "given": list(self._given),
        }
        if self._lengths is not None:
            state["n"] = [length.n for length in self._lengths]
            if any(length.by_id for length in self._lengths):
                # the by-id sources' positions' layouts: a restore draws the same rows
                state["writers"] = [
                    length.layout() if length.by_id else None for length in self._lengths
                ]
        return state

    def set_state(self, state: Mapping[str, Any]) -> None:
        debt, given = state["debt"], state["given"]
        if len(debt) != len(self.names) or len(given) != len(self.names):
            raise InvalidSamplingError(
                f"The checkpoint is of a mixture of {len(given)} sources; this one has "
                f"{len(self.names)} ({list(self.names)}). Fix: resume with the same sources."
            )
        layouts = state.get("writers")
        pinned: list[Any] = [None] * len(self.names)
        if layouts is not None and self._lengths is not None:
            if not isinstance(layouts, list) or len(layouts) != len(self.names):
                raise InvalidSamplingError(
                    f"The checkpoint's writers' layouts {layouts!r} are not one per source "
                    f"of {list(self.names)}. Fix: pass bytes from get_state() of a loader "
                    "made with the same arguments."
                )
            ns = state.get("n", ())
            for s, (length, layout) in enumerate(zip(self._lengths, layouts)):
                if layout is not None and length.by_id:
                    pinned[s] = parse_layout(layout, int(ns[s]))
        self._step = int(state["step"])
        self._debt = [float(x) for x in debt]
        self._given = [int(x) for x in given]
        self._ahead.clear()
        for length, n in zip(self._lengths or (), state.get("n", ())):
            length.n = int(n)
        for length, layout in zip(self._lengths or (), pinned):
            length.pin(layout)
