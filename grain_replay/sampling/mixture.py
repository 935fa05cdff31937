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

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidSamplingError, LeafMismatchError
from grain_replay.pipeline.batches import CACHED_ORDER_MAX_RECORDS
from grain_replay.pipeline.shuffle import permute
from grain_replay.sampling.draws import Draws
from grain_replay.sampling.replay import StoreLength

__all__ = ["apportion", "MixtureSampler", "MixtureReader", "source_leaves"]

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

    def _quotas(self) -> list[float]:
        weights = self._fixed_list
        if weights is None:
            weights = self.weights_at(self._step).tolist()
        b = self.batch_size
        return [b * w + d for w, d in zip(weights, self._debt)]

    def counts(self) -> np.ndarray:
        """The next step's rows per source, without drawing it."""
        return np.array(_apportion(self._quotas(), self.batch_size), dtype=np.int64)

    def draw(self) -> dict[str, np.ndarray]:
        """The next batch: source name -> record ids (only sources with rows)."""
        if self._blocked:
            if not self._ahead:
                self._draw_ahead()
            ahead, self._debt, self._given = self._ahead.popleft()
            self._step += 1
            return ahead
        quotas = self._quotas()
        counts = _apportion(quotas, self.batch_size)
        task: dict[str, np.ndarray] = {}
        for s, (name, c) in enumerate(zip(self.names, counts)):
            if c:
                task[name] = self._ids(s, self._given[s], c)
        self._debt = [q - c for q, c in zip(quotas, counts)]
        self._given = [g + c for g, c in zip(self._given, counts)]
        self._step += 1
        return task

    def _draw_ahead(self) -> None:
        """Draws the next ``_BLOCK`` steps at once (fixed weights, one process, epochs).

        Then each source's rows of those steps are one contiguous stretch of its
        stream: one slice of its epoch order, cut into the steps' shares. The
        steps and the state after each are exactly those of step-by-step draws.
        """
        b, weights = self.batch_size, self._fixed_list
        assert weights is not None
        debt, given = self._debt, self._given
        steps = []
        for _ in range(_BLOCK):
            quotas = [b * w + d for w, d in zip(weights, debt)]
            counts = _apportion(quotas, b)
            debt = [q - c for q, c in zip(quotas, counts)]
            steps.append((counts, debt, [g + c for g, c in zip(given, counts)]))
            given = steps[-1][2]
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
            return self._draws[s].integers(self._step, n)[:count]
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
            "debt": list(self._debt),
            "given": list(self._given),
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
        self._debt = [float(x) for x in debt]
        self._given = [int(x) for x in given]
        self._ahead.clear()
        for length, n in zip(self._lengths or (), state.get("n", ())):
            length.n = int(n)


def source_leaves(source: Any) -> list[str]:
    """The leaf keys of a source: its ``spec`` when it has one, else those of a 1-row read."""
    return list(_source_spec(source))


LeafShape = tuple[np.dtype, tuple[int, ...]] | None


def _source_spec(source: Any) -> dict[str, LeafShape]:
    """Leaf key -> (dtype, per-row shape): the ``spec``, else a 1-row read's.

    None for a leaf whose ``spec`` entry has no dtype and shape, of a source
    with no rows to read one from (an online store before its first commit).
    """
    spec = getattr(source, "spec", None)
    if isinstance(spec, Mapping):
        out: dict[str, LeafShape] = {}
        for k, v in spec.items():
            try:
                out[k] = (np.dtype(v.dtype), tuple(v.shape))
            except (AttributeError, TypeError):
                out[k] = None
        if all(v is not None for v in out.values()) or not len(source):
            return out
    leaves, _ = tree_lib.flatten(source.read_batch(np.zeros(1, dtype=np.int64)))
    return {k: (np.asarray(v).dtype, np.asarray(v).shape[1:]) for k, v in leaves.items()}


def _native(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("=")


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
        specs = {n: _source_spec(s) for n, s in self.sources.items()}
        leaves = {n: list(spec) for n, spec in specs.items()}
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
        self._check_alike(specs)
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
        # A flat dict batch is the dict of leaves itself, in order: no rebuild.
        self._flat = treedef.get("type") == "dict" and all(
            c.get("type") == "leaf" for c in treedef["children"]
        )
        # What each source held when the mixture was made: epochs draw below it.
        self.sizes = {name: len(src) for name, src in self.sources.items()}
        self._bind()

    def _check_alike(self, specs: Mapping[str, Mapping[str, LeafShape]]) -> None:
        """Sets each leaf's batch dtype and row shape; refuses leaves that differ by source."""
        self._rows: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        bad = []
        for k in self.keys:
            known = [(n, spec) for n in self.names if (spec := specs[n][k]) is not None]
            if not known:
                raise LeafMismatchError(
                    f"Leaf {k!r}: no source of the mixture says its dtype and shape (their "
                    "spec entries are not LeafSpecs and they hold no rows). Fix: give the "
                    "sources a spec of gr.LeafSpec(dtype, shape) per leaf."
                )
            first, (dtype, shape) = known[0]
            for name, (other_dtype, other_shape) in known[1:]:
                if other_shape != shape or _native(other_dtype) != _native(dtype):
                    bad.append(
                        f"{k!r}: {first!r} holds {dtype}{list(shape)}, {name!r} "
                        f"({self.sources[name]!r}) {other_dtype}{list(other_shape)}"
                    )
            # Each batch is allocated once; every source writes its rows into its slice.
            self._rows[k] = (_native(dtype), shape)
        if bad:
            raise LeafMismatchError(
                f"The mixture's sources hold leaves of different dtypes or shapes: "
                f"{'; '.join(bad)}. A batch holds rows of every source in one array per leaf. "
                "Fix: write the stores with the same dtypes and shapes, or leave those leaves "
                "out with keys=[...]."
            )

    def __call__(self, task: Mapping[str, np.ndarray]) -> Any:
        total = 0
        for rows in task.values():
            total += len(rows)
        shapes = self._shapes.get(total)
        if shapes is None:  # the batch size: almost always the same
            shapes = self._shapes[total] = [
                (k, (total, *tail), dtype) for k, (dtype, tail) in self._rows.items()
            ]
        out = {k: np.empty(shape, dtype) for k, shape, dtype in shapes}
        start = 0
        for name, source, read_into in self._plan:
            got = task.get(name)
            if got is None or not len(got):
                continue
            rows = got
            if self.growing:  # rows drawn from what the consumer saw committed
                past_end = int(rows.max()) >= len(source)
                if past_end and callable(refresh := getattr(source, "refresh", None)):
                    refresh()  # committed since this copy looked
                    past_end = int(rows.max()) >= len(source)
            else:  # epochs: rows < the size at construction (a store only grows)
                past_end = len(source) < self.sizes[name]
            stop = start + len(rows)
            part = {k: a[start:stop] for k, a in out.items()}
            if read_into is not None:
                # The rows are drawn >= 0 and `part` is allocated from the specs: only
                # rows past the end need the checks (which then raise RecordIndexError).
                read_into(rows, part, check=past_end)
            else:
                leaves, _ = tree_lib.flatten(source.read_batch(rows))
                for k, dst in part.items():
                    dst[...] = leaves[k]
            start = stop
        if self.source_leaf is not None:
            counts = [len(task.get(name, ())) for name in self.names]
            out[self.source_leaf] = np.repeat(np.arange(len(self.names), dtype=np.int32), counts)
        return out if self._flat else self._unflatten(out)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_plan"]  # bound methods of the sources: made again after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def _bind(self) -> None:
        self._shapes: dict[int, list[tuple[str, tuple[int, ...], np.dtype]]] = {}
        # (name, source, its read_into or None), in mixture order: the read loop's plan.
        self._plan: list[tuple[str, Any, Callable[..., None] | None]] = []
        for name, source in self.sources.items():
            read_into = getattr(source, "read_into", None)  # grain_replay's sources
            self._plan.append((name, source, read_into if callable(read_into) else None))

    def __repr__(self) -> str:
        inner = ", ".join(f"{n!r}: {s!r}" for n, s in self.sources.items())
        return f"MixtureReader({{{inner}}}, keys={self.keys}, source_leaf={self.source_leaf!r})"
