"""What a global batch is: loader options and the seeded permutation slices read per batch."""

from __future__ import annotations

import dataclasses
import operator
import sys
import threading
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import ArgumentTypeError, InvalidArgumentError
from grain_replay.pipeline.shuffle import epoch_order, permute
from grain_replay.pipeline.state import StreamShape, stream_repr
from grain_replay.sources.base import BatchSource
from grain_replay.sources.capabilities import HasSpec, HasTreedef, ReadsInto

__all__ = ["CACHED_ORDER_MAX_RECORDS", "LoaderOptions", "BatchedReads"]

# Below this many records a whole epoch's order is computed once and sliced
# per batch (int32: 32 MiB at the limit); above it each batch's slice of the
# order is computed on its own, in O(batch) memory.
CACHED_ORDER_MAX_RECORDS = 1 << 23


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """How records become batches: validated once, shared by every process and worker."""

    batch_size: int
    shuffle: bool = True
    seed: int = 0
    num_epochs: int | None = 1
    drop_remainder: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_size", _as_int("batch_size", self.batch_size))
        object.__setattr__(self, "seed", _as_int("seed", self.seed))
        if self.num_epochs is not None:
            object.__setattr__(self, "num_epochs", _as_int("num_epochs", self.num_epochs))
        if self.batch_size <= 0:
            raise InvalidArgumentError(
                f"batch_size must be positive (rows per batch), got {self.batch_size}. Fix: "
                "batch_size >= 1 (e.g. 256)."
            )
        if not 0 <= self.seed < 2**64:
            raise InvalidArgumentError(
                f"seed must be in [0, 2**64), got {self.seed}. Fix: a seed in that range "
                "(e.g. seed % 2**64)."
            )
        if self.num_epochs is not None and self.num_epochs <= 0:
            raise InvalidArgumentError(
                f"num_epochs must be a positive int or None (forever), got {self.num_epochs}. "
                "Fix: num_epochs >= 1, or None to repeat forever."
            )


def _as_int(name: str, value: Any) -> int:
    """``value`` as a Python int; numpy integers are fine, bools and floats are not."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(
            f"{name} must be an int, got the bool {value!r}. Fix: pass {name} as an int."
        )
    try:
        return operator.index(value)
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be an int, got {value!r} ({type(value).__name__}). Fix: pass an "
            f"int (a Python or numpy integer; int(x) of a whole float)."
        ) from None


class BatchedReads:
    """A random-access source whose element ``g`` is global batch ``g``, read in one call.

    Global batch ``g`` belongs to epoch ``g // batches_per_epoch``; its records are
    a slice of that epoch's seeded permutation, read with one
    ``source.read_batch`` (one vectorized read per leaf). With ``shard_count``
    processes, ``batches_per_epoch`` is a multiple of ``shard_count`` so that the
    processes' share of an epoch covers each record at most once, and exactly once
    when nothing is dropped.
    """

    def __init__(self, source: BatchSource, options: LoaderOptions, shard_count: int = 1):
        self.source = source
        self.options = options
        n = len(source)
        b = options.batch_size
        if options.drop_remainder:
            per_epoch = (n // b) // shard_count * shard_count
        else:
            if shard_count > 1:
                raise InvalidArgumentError(
                    f"drop_remainder=False with {shard_count} processes would give the "
                    "processes batches of different sizes, which a globally sharded array "
                    "cannot hold. Fix: use drop_remainder=True."
                )
            per_epoch = -(-n // b)
        if per_epoch == 0:
            raise InvalidArgumentError(
                f"{source!r} has {n} records, fewer than one batch of {b} for each of "
                f"{shard_count} process(es). Fix: lower batch_size, or use drop_remainder=False."
            )
        self.batches_per_epoch = per_epoch
        self.shard_count = shard_count
        self.num_records = n  # fixed at construction: a growing store's new rows are not read
        self._n = n
        # asked once: a runtime Protocol check costs ~15 us, per batch in the read loop
        self._reads_into = isinstance(source, ReadsInto)
        self._order_lock = threading.Lock()
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        if self.options.num_epochs is None:
            return sys.maxsize
        return self.options.num_epochs * self.batches_per_epoch

    def __repr__(self) -> str:
        # grain checks restored states against it; it names the process count so that
        # a state resumes on another one (pipeline/state.py).
        o = self.options
        return stream_repr(
            StreamShape(
                source=repr(self.source),
                batch_size=o.batch_size,
                shuffle=o.shuffle,
                seed=o.seed,
                num_epochs=o.num_epochs,
                drop_remainder=o.drop_remainder,
                batches_per_epoch=self.batches_per_epoch,
                shard_count=self.shard_count,
            )
        )

    def element_spec(self) -> Any:
        """The batches' tree of ``grain.experimental.ShapeDtypeStruct``, from the source's spec.

        The leading axis is ``batch_size``, or None when the last batch of an epoch is
        shorter (``drop_remainder=False``). Reads no data.
        """
        import grain  # here: spawned loader workers unpickle this class without grain

        b = self.options.batch_size
        rows: int | None = b if self.options.drop_remainder or self._n % b == 0 else None
        src = self.source
        spec = src.spec if isinstance(src, HasSpec) else None
        treedef = src.treedef if isinstance(src, HasTreedef) else None
        if spec is None or treedef is None:  # a source that does not say: its zero-row batch
            empty = self.source.read_batch(np.zeros(0, np.int64))
            return tree_lib.map_leaves(
                lambda _, leaf: grain.experimental.ShapeDtypeStruct(
                    (rows, *leaf.shape[1:]), leaf.dtype
                ),
                empty,
            )
        return tree_lib.unflatten(
            treedef,
            {
                key: grain.experimental.ShapeDtypeStruct((rows, *leaf.shape), leaf.dtype)
                for key, leaf in spec.items()
            },
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_order_lock"]
        state["_orders"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._order_lock = threading.Lock()

    def record_ids(self, index: int) -> np.ndarray:
        """The record ids of global batch ``index``, in batch order."""
        epoch, j = divmod(int(index), self.batches_per_epoch)
        b = self.options.batch_size
        start, stop = j * b, min((j + 1) * b, self._n)
        if not self.options.shuffle:
            return np.arange(start, stop, dtype=np.int64)
        if self._n <= CACHED_ORDER_MAX_RECORDS:
            return self._epoch_order(epoch)[start:stop].astype(np.int64)
        return permute(np.arange(start, stop), self._n, self.options.seed, epoch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            with self._order_lock:
                order = self._orders.get(epoch)
                if order is None:
                    order = epoch_order(self._n, self.options.seed, epoch)
                    # Keep the current and the next epoch (threads read ahead).
                    self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
                    self._orders[epoch] = order
        return order

    def __getitem__(self, index: int) -> Any:
        return self.source.read_batch(self.record_ids(index))

    def read_into(self, index: int, out: Mapping[str, np.ndarray]) -> bool:
        """Reads global batch ``index`` into ``out`` (leaf key -> array of the batch's rows)
        with the source's ``read_into``; False, reading nothing, when the source has none or
        the batch has another number of rows (a short last batch)."""
        ids = self.record_ids(index)
        if not self._reads_into or any(len(a) != len(ids) for a in out.values()):
            return False
        cast(ReadsInto, self.source).read_into(ids, out)
        return True
