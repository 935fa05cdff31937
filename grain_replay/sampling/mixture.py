"""Mixtures: exact per-batch counts by largest remainder, each source on its own permutation.

Step ``t`` gives source ``s`` the quota ``batch_size * w_s(t) + d_s``, where ``d_s`` is
what earlier steps owed it (target rows minus rows given). The counts are the
largest-remainder rounding of the quotas: they sum to the batch size, and the
debt stays in ``(-1, 1)``, so the rounding error never drifts. Source ``s``
reads positions ``[C_s, C_s + count)`` of its own endless stream of seeded
epochs (``C_s`` = rows it gave so far), one ``read_batch`` per source per batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidSamplingError, LeafMismatchError
from grain_replay.pipeline.batches import CACHED_ORDER_MAX_RECORDS
from grain_replay.pipeline.shuffle import permute
from grain_replay.sampling.draws import integers
from grain_replay.sampling.replay import StoreLength

__all__ = ["apportion", "MixtureSampler", "MixtureReader", "source_leaves"]

# Below CACHED_ORDER_MAX_RECORDS (the loader's threshold) a source's epoch order is
# computed once per epoch (int32) and sliced; above, each batch permutes its own slice.

Weights = Mapping[str, float] | Callable[[int], Mapping[str, float]]


def apportion(quotas: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder rounding of nonnegative ``quotas`` (summing to ``total``) to ints.

    Ties go to the earlier entry; a zero quota never receives a row.
    """
    q = np.maximum(quotas, 0.0)
    counts = np.floor(q).astype(np.int64)
    short = total - int(counts.sum())
    if short > 0:
        rest = np.where(q > 0, q - counts, -1.0)
        order = np.argsort(-rest, kind="stable")
        counts[order[:short]] += 1
    elif short < 0:  # only from float noise in the quotas' sum: take back from the smallest
        rest = np.where(counts > 0, q - counts, np.inf)
        order = np.argsort(rest, kind="stable")
        counts[order[:-short]] -= 1
    return counts


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
        self.batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._shard_index = shard_index
        self._shard_count = shard_count
        self._debt = np.zeros(len(self.names))
        self._given = np.zeros(len(self.names), dtype=np.int64)  # rows per process so far
        self._step = 0
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # (source, epoch) -> order

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

    def counts(self) -> np.ndarray:
        """The next step's rows per source, without drawing it."""
        quotas = self.batch_size * self.weights_at(self._step) + self._debt
        return apportion(quotas, self.batch_size)

    def draw(self) -> dict[str, np.ndarray]:
        """The next batch: source name -> record ids (only sources with rows)."""
        weights = self.weights_at(self._step)
        quotas = self.batch_size * weights + self._debt
        counts = apportion(quotas, self.batch_size)
        self._debt = quotas - counts
        task: dict[str, np.ndarray] = {}
        for s, (name, c) in enumerate(zip(self.names, counts)):
            if c:
                task[name] = self._ids(s, int(self._given[s]), int(c))
        self._given += counts
        self._step += 1
        return task

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
            stream = s * self._shard_count + self._shard_index
            return integers(self._seed, stream, self._step, count, n)
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
            order = permute(np.arange(n), n, self._source_seed(s), epoch).astype(np.int32)
            # Keep this and the previous epoch of each source (a batch may span both).
            self._orders = {k: v for k, v in self._orders.items() if k[0] != s or k[1] >= epoch - 1}
            self._orders[(s, epoch)] = order
        return order

    def state(self) -> dict[str, Any]:
        """JSON-able state before the next draw (floats round-trip exactly through JSON)."""
        state: dict[str, Any] = {
            "step": self._step,
            "debt": [float(x) for x in self._debt],
            "given": [int(x) for x in self._given],
        }
        if self._lengths is not None:
            state["n"] = [length.n for length in self._lengths]
        return state

    def set_state(self, state: Mapping[str, Any]) -> None:
        debt, given = state["debt"], state["given"]
        if len(debt) != len(self.names) or len(given) != len(self.names):
            raise InvalidSamplingError(
                f"The checkpoint is of a mixture of {len(given)} sources; this one has "
                f"{len(self.names)} ({list(self.names)}). Fix: resume with the same sources."
            )
        self._step = int(state["step"])
        self._debt = np.array(debt, dtype=np.float64)
        self._given = np.array(given, dtype=np.int64)
        for length, n in zip(self._lengths or (), state.get("n", ())):
            length.n = int(n)


def source_leaves(source: Any) -> list[str]:
    """The leaf keys of a source: its ``spec`` when it has one, else those of a 1-row read."""
    spec = getattr(source, "spec", None)
    if isinstance(spec, Mapping):
        return list(spec)
    leaves, _ = tree_lib.flatten(source.read_batch(np.zeros(1, dtype=np.int64)))
    return list(leaves)


def _treedef(source: Any, keys: list[str]) -> dict[str, Any]:
    treedef = getattr(source, "treedef", None)
    if not isinstance(treedef, Mapping):
        _, treedef = tree_lib.flatten(source.read_batch(np.zeros(1, dtype=np.int64)))
    return tree_lib.prune_treedef(treedef, keys)


class MixtureReader:
    """Worker side: reads a batch's per-source ids and joins the rows, source by source.

    Rows of the first source come first. With ``source_leaf``, the batch gains an
    int32 leaf of that name: the position of each row's source in the mixture.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        keys: list[str] | None = None,
        source_leaf: str | None = None,
        growing: bool = False,
    ) -> None:
        self.growing = growing  # rows may lie past what a source had committed at open
        if not sources:
            raise InvalidSamplingError("A mixture needs at least one source; got an empty mapping.")
        self.sources = dict(sources)
        self.names = tuple(self.sources)
        leaves = {n: source_leaves(s) for n, s in self.sources.items()}
        if keys is None:
            union = sorted(set().union(*leaves.values()), key=tree_lib.natural_key)
            lacking = {n: [k for k in union if k not in have] for n, have in leaves.items()}
            lacking = {n: miss for n, miss in lacking.items() if miss}
            if lacking:
                common = [k for k in union if all(k in have for have in leaves.values())]
                detail = "; ".join(
                    f"{n!r} ({self.sources[n]!r}) lacks {miss}" for n, miss in lacking.items()
                )
                raise LeafMismatchError(
                    f"The mixture's sources hold different leaves: {detail}. Fix: pass "
                    f"keys={common} to read the leaves they share."
                )
            keys = leaves[self.names[0]]
        else:
            keys = [keys] if isinstance(keys, str) else list(keys)
            lacking = {n: [k for k in keys if k not in have] for n, have in leaves.items()}
            lacking = {n: miss for n, miss in lacking.items() if miss}
            if lacking:
                detail = "; ".join(
                    f"{n!r} ({self.sources[n]!r}) lacks {miss}" for n, miss in lacking.items()
                )
                raise LeafMismatchError(f"keys={keys} names leaves some sources lack: {detail}.")
        first = self.sources[self.names[0]]
        treedef = _treedef(first, keys)
        self.keys = tree_lib.leaf_keys(treedef)
        if source_leaf is not None:
            if source_leaf in self.keys or "/" in source_leaf or not source_leaf:
                raise InvalidSamplingError(
                    f"source_leaf={source_leaf!r} must be a new top-level leaf name; the "
                    f"batch already has the leaves {self.keys}. Fix: pick another name."
                )
            if treedef.get("type") != "dict":
                raise InvalidSamplingError(
                    f"source_leaf={source_leaf!r} adds a leaf to a dict batch, but the "
                    "sources' records are not dicts. Fix: source_leaf=None."
                )
            treedef = {
                **treedef,
                "keys": [*treedef["keys"], source_leaf],
                "children": [*treedef["children"], {"type": "leaf"}],
            }
        self.source_leaf = source_leaf
        self._unflatten = tree_lib.compile_unflatten(treedef)

    def __call__(self, task: Mapping[str, np.ndarray]) -> Any:
        parts = []
        ids = []
        for s, name in enumerate(self.names):
            rows = task.get(name)
            if rows is None or not len(rows):
                continue
            source = self.sources[name]
            if self.growing and int(rows.max()) >= len(source):  # committed since it opened
                refresh = getattr(source, "refresh", None)
                if callable(refresh):
                    refresh()
            read_flat = getattr(source, "read_flat", None)  # grain_replay's sources: no tree
            if callable(read_flat):
                leaves = read_flat(rows)
            else:
                leaves, _ = tree_lib.flatten(source.read_batch(rows))
            parts.append(leaves)
            ids.append(np.full(len(rows), s, dtype=np.int32))
        if len(parts) == 1:
            out = {k: parts[0][k] for k in self.keys}
        else:
            out = {k: np.concatenate([p[k] for p in parts]) for k in self.keys}
        if self.source_leaf is not None:
            out[self.source_leaf] = ids[0] if len(ids) == 1 else np.concatenate(ids)
        return self._unflatten(out)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n!r}: {s!r}" for n, s in self.sources.items())
        return f"MixtureReader({{{inner}}}, keys={self.keys}, source_leaf={self.source_leaf!r})"
