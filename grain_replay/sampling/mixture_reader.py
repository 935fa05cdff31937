"""Mixtures, worker side: each batch allocated once, every source gathers into its slice."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidSamplingError, LeafMismatchError
from grain_replay.sampling.replay import reaches
from grain_replay.sources.capabilities import HasSpec, HasTreedef, ReadsIds, ReadsInto

__all__ = ["MixtureReader", "source_leaves"]


def source_leaves(source: Any) -> list[str]:
    """The leaf keys of a source: its ``spec`` when it has one, else those of a 1-row read."""
    return list(_source_spec(source))


LeafShape = tuple[np.dtype, tuple[int, ...]] | None


def _source_spec(source: Any) -> dict[str, LeafShape]:
    """Leaf key -> (dtype, per-row shape): the ``spec``, else a 1-row read's.

    None for a leaf whose ``spec`` entry has no dtype and shape, of a source
    with no rows to read one from (an online store before its first commit).
    """
    spec = source.spec if isinstance(source, HasSpec) else None
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
    treedef = source.treedef if isinstance(source, HasTreedef) else None
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
            if name in self._by_id:  # a bounded store: ids, read against any snapshot
                stop = start + len(rows)
                leaves = self._by_id[name](rows, evicted="replace")
                for k, a in out.items():
                    a[start:stop] = leaves[k]
                start = stop
                continue
            if self.growing:  # rows drawn from what the consumer saw committed
                past_end = not reaches(source, int(rows.max()) + 1)
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
        del (
            state["_plan"],
            state["_by_id"],
        )  # bound methods of the sources: made again after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bind()

    def _bind(self) -> None:
        self._shapes: dict[int, list[tuple[str, tuple[int, ...], np.dtype]]] = {}
        # (name, source, its read_into or None), in mixture order: the read loop's plan.
        self._plan: list[tuple[str, Any, Callable[..., None] | None]] = []
        # name -> read of rows by id, for bounded stores under replay (see PartsDataSource).
        self._by_id: dict[str, Callable[..., dict[str, np.ndarray]]] = {}
        for name, source in self.sources.items():
            if self.growing and isinstance(source, ReadsIds):
                self._by_id[name] = source.read_ids_flat
            read_into = source.read_into if isinstance(source, ReadsInto) else None
            self._plan.append((name, source, read_into))

    def __repr__(self) -> str:
        inner = ", ".join(f"{n!r}: {s!r}" for n, s in self.sources.items())
        return f"MixtureReader({{{inner}}}, keys={self.keys}, source_leaf={self.source_leaf!r})"
