"""Small appends gathered on the host and written as one block a leaf, and the quick check
of a host tree shaped like the last one.

A store's write has fixed costs a call: a system call (and a checksum update) a leaf,
the store's bookkeeping. An actor appending one step of 1,024 environments (41 B rows,
5 leaves) paid them every step: ~110 us of CPU an append on a 2-core VM, ~350 us on a
TPU host whose file system runs under gVisor. :class:`RowStage` copies such appends
into per-leaf buffers it keeps (about :data:`STAGE_BYTES` in all) and the store writes
them once the buffers fill, before a larger write, and at every commit: the rows are
committed exactly when they were before (``flush``), and a crash loses what it lost
before (the rows since the last commit). :class:`HostSignature` takes a tree of numpy
arrays like the last one checked from its leaves' attributes alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.store.layout import LeafSpec
from grain_replay.tree_layout import TreeLayout

__all__ = ["STAGE_BYTES", "HostSignature", "RowStage"]

# Bytes of rows a writer gathers before writing them (all leaves together).
STAGE_BYTES = 1 << 20


class RowStage:
    """Rows of small appends, gathered in per-leaf buffers allocated once (lazily).

    Appends of at most half the stage's rows are taken; larger ones are written as they
    come, after the stage (the caller's job: :meth:`takes`). ``write(block, rows)`` is
    the store's write of a joined block; the stage calls it from :meth:`drain`, and
    keeps its rows when it raises (a later drain writes them again, at the same place).
    """

    def __init__(self, leaves: dict[str, LeafSpec], limit_bytes: int | None = None):
        row = sum(s.dtype.itemsize * int(np.prod(s.shape, dtype=np.int64)) for s in leaves.values())
        limit = STAGE_BYTES if limit_bytes is None else limit_bytes
        self.capacity = max(1, limit // max(1, row))
        self._leaves = leaves
        self._buffers: dict[str, np.ndarray] | None = None
        self.rows = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers held (0 before the first append and after :meth:`clear`)."""
        return 0 if self._buffers is None else sum(b.nbytes for b in self._buffers.values())

    @property
    def buffers(self) -> dict[str, np.ndarray] | None:
        """The per-leaf buffers (None until the first append), the same ones throughout."""
        return self._buffers

    def takes(self, n: int) -> bool:
        """Whether an append of ``n`` rows is gathered here (else written as it comes)."""
        return 2 * n <= self.capacity

    def add(self, arrays: dict[str, np.ndarray], n: int, write: Callable[..., None]) -> None:
        """Copies ``n`` rows (``takes(n)``) into the stage, draining it first when they
        do not fit (a failed drain raises before they are taken)."""
        if self.rows + n > self.capacity:
            self.drain(write)
        if self._buffers is None:
            self._buffers = {
                k: np.empty((self.capacity, *s.shape), s.dtype) for k, s in self._leaves.items()
            }
        stop = self.rows + n
        for key, buf in self._buffers.items():
            buf[self.rows : stop] = arrays[key]
        self.rows = stop

    def write(
        self, arrays: dict[str, np.ndarray], n: int, by_leaf: bool, write: Callable[..., None]
    ) -> None:
        """Gathers ``n`` rows here when they are small (``takes(n)``), else writes what is
        gathered, then them, with ``write(block, rows, by_leaf=...)``: in append order.
        ``by_leaf`` blocks (a device writer's batches) are never gathered."""
        if not by_leaf and self.takes(n):
            self.add(arrays, n, write)
            return
        self.drain(write)
        write(arrays, n, by_leaf=by_leaf)

    def drain(self, write: Callable[..., None]) -> None:
        """Writes the gathered rows as one block (``write(block, rows, by_leaf=False)``)."""
        if not self.rows or self._buffers is None:
            return
        rows = self.rows
        write({k: b[:rows] for k, b in self._buffers.items()}, rows, by_leaf=False)
        self.rows = 0

    def clear(self) -> None:
        """Drops the gathered rows and the buffers (a writer let go without a commit)."""
        self.rows = 0
        self._buffers = None


class HostSignature:
    """The containers (:class:`~grain_replay.tree.TreeLayout`), dtypes and per-row shapes
    of the last tree of numpy arrays that passed the store's full check: a tree with the
    same containers (exact types, dict keys in the same order, lengths: flat or nested
    dicts, NamedTuples, lists, tuples) and leaves of exactly ``np.ndarray`` with the same
    dtypes and per-row shapes, and one common row count, passes it too, so it is taken
    from those attributes alone. Anything else (another structure, jax arrays, numpy
    subclasses, numbers) returns None and takes the full check, which also words the
    errors."""

    def __init__(self, arrays: dict[str, Any], layout: TreeLayout):
        self._leaves = tuple((a.dtype, a.shape[1:]) for a in arrays.values())
        self._layout = layout

    @classmethod
    def of(cls, tree: Any, arrays: dict[str, Any]) -> HostSignature | None:
        """The signature of a checked tree (``arrays``: its checked leaves, flattened),
        or None when it is not a tree of numpy arrays."""
        if any(type(a) is not np.ndarray for a in arrays.values()):
            return None
        layout = TreeLayout.of(tree, arrays)
        return None if layout is None else cls(arrays, layout)

    def check(self, tree: Any) -> int:
        """The rows of a tree like the remembered one (> 0); 0 for any other."""
        taken = self.take(tree)
        return 0 if taken is None else taken[1]

    def take(self, tree: Any) -> tuple[dict[str, np.ndarray], int] | None:
        """A tree like the remembered one as ``(leaves by name, rows)``, the leaves a new
        dict; None for any other (zero rows included: the full path's to handle)."""
        layout = self._layout
        leaves = layout.leaves(tree)
        if leaves is None:
            return None
        rows = -1
        for leaf, (dtype, row_shape) in zip(leaves, self._leaves, strict=True):
            if type(leaf) is not np.ndarray or leaf.dtype != dtype:
                return None
            shape = leaf.shape
            if len(shape) == 0 or shape[1:] != row_shape:
                return None
            if rows < 0:
                rows = shape[0]
            elif shape[0] != rows:
                return None
        if rows <= 0:
            return None
        if layout.flat_dict:
            return dict(tree), rows
        return dict(zip(layout.keys, leaves)), rows
