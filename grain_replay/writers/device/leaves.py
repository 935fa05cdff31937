"""Device leaves of an append: recognising them, checking they can be copied to host, and
the quick check of a tree like the last one (any structure: flat or nested dicts,
lists, tuples, NamedTuples).

jax is never imported here: a leaf is a device array when ``jax`` is already loaded
and the leaf is a ``jax.Array``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.errors import InvalidTreeError
from grain_replay.tree_layout import TreeLayout

__all__ = ["TreeSignature", "device_leaf_test", "leaf_nbytes", "leaf_name", "start_copies"]

_ON_HOST: dict[Any, bool] = {}  # sharding -> whether all its devices are CPUs


def device_leaf_test() -> Callable[[Any], bool] | None:
    """``isinstance(leaf, jax.Array)`` when jax is loaded, else None (no leaf can be one)."""
    jax = sys.modules.get("jax")
    array_type = getattr(jax, "Array", None)
    if array_type is None:
        return None
    return lambda leaf: isinstance(leaf, array_type)


def leaf_nbytes(leaf: Any) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def leaf_name(key: str) -> str:
    return key or "<root>"


def on_host(leaf: Any) -> bool:
    """Whether every device of the leaf's sharding is a CPU (its array is host memory)."""
    sharding: Any = getattr(leaf, "sharding", None)
    try:
        return _ON_HOST[sharding]
    except (KeyError, TypeError):
        pass
    try:
        result = all(d.platform == "cpu" for d in sharding.device_set)
    except Exception:  # an unusual array: copy it the documented way
        return False
    if len(_ON_HOST) > 256:
        _ON_HOST.clear()
    with contextlib.suppress(TypeError):
        _ON_HOST[sharding] = result
    return result


def _refuse_unaddressable(key: str, where: str) -> InvalidTreeError:
    return InvalidTreeError(
        f"{where}: leaf {leaf_name(key)!r} is a jax.Array with shards on other processes' "
        "devices (not fully addressable), so this process cannot copy it to host. "
        "Fix: append each process's own rows with its own writer_id= (e.g. "
        "leaf.addressable_shards), or gather it first with "
        "jax.experimental.multihost_utils.process_allgather."
    )


def _refuse_dead(key: str, where: str, e: Exception) -> InvalidTreeError:
    return InvalidTreeError(
        f"{where}: leaf {leaf_name(key)!r} cannot be copied to host ({type(e).__name__}: "
        f"{e}). Fix: append arrays that are still alive (not donated or deleted)."
    )


def start_copies(arrays: dict[str, Any], is_device: Callable[[Any], bool], where: str) -> None:
    """Checks that every device leaf can be copied to host later (fully addressable, not
    deleted); host leaves are copied now (the caller may reuse its buffers once
    ``append`` returns). Device leaves are copied by the writer's thread: a CPU device's
    array read in place, an accelerator's stacked with like trees into one transfer
    (:mod:`grain_replay.writers.device.pack`)."""
    for key, leaf in arrays.items():
        if not is_device(leaf):
            arrays[key] = np.array(leaf, copy=True)
            continue
        if not getattr(leaf, "is_fully_addressable", True):
            raise _refuse_unaddressable(key, where)
        try:
            if leaf.is_deleted():
                raise RuntimeError("Array has been deleted.")
        except Exception as e:  # a deleted (donated) array, a broken device
            raise _refuse_dead(key, where, e) from e


@dataclasses.dataclass(frozen=True)
class _Leaf:
    key: str
    type: Any  # the array class (jax.Array is abstract: its instances are a subclass)
    dtype: np.dtype
    row_shape: tuple[int, ...]
    row_bytes: int
    sharding: Any  # a leaf with this sharding (or an equal one) needs no new look


class TreeSignature:
    """A tree of device arrays already checked against the store, remembered so a later
    tree with the same containers (:class:`~grain_replay.tree.TreeLayout`: exact types,
    dict keys in order), array types, dtypes, per-row shapes and shardings is taken from
    those attributes alone: the full tree walk and check give it the same answer.
    Anything else (another structure, host leaves, a new sharding, zero rows, a deleted
    array) is left to the full path, which also words the errors."""

    def __init__(
        self,
        leaves: tuple[_Leaf, ...],
        where: str,
        accel: tuple[str, ...] = (),
        layout: TreeLayout | None = None,
    ):
        self._leaves = leaves
        self._where = where
        self._layout = layout
        # The leaves' names when the tree is a dict of leaves (taken without the layout).
        self._flat_keys = layout.keys if layout is not None and layout.flat_dict else None
        # The leaves on an accelerator (not host memory): what the writer's thread stacks.
        self.accel = accel
        # The last tree taken, as (type, aval, sharding) a leaf, with its rows and bytes:
        # a jitted step's outputs share their aval (shape and dtype) and sharding objects
        # call after call, so the next step's tree is taken on identities alone (three
        # attribute reads and a liveness check a leaf).
        self._same: tuple[tuple[tuple[Any, ...], ...], int, int] | None = None

    @classmethod
    def of(
        cls,
        tree: Any,
        arrays: dict[str, Any],
        is_device: Callable[[Any], bool],
        where: str,
    ) -> TreeSignature | None:
        """The signature of a checked tree, or None when it is not a tree of fully
        addressable device arrays (``arrays`` is its checked leaves, flattened)."""
        layout = TreeLayout.of(tree, arrays)
        if layout is None:
            return None
        leaves = []
        accel = []
        for key, leaf in arrays.items():
            if not is_device(leaf) or not getattr(leaf, "is_fully_addressable", True):
                return None
            dtype = np.dtype(leaf.dtype)
            row_shape = tuple(leaf.shape[1:])
            row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
            sharding = getattr(leaf, "sharding", None)
            leaves.append(_Leaf(key, type(leaf), dtype, row_shape, row_bytes, sharding))
            if not on_host(leaf):
                accel.append(key)
        return cls(tuple(leaves), where, tuple(accel), layout)

    def check(self, tree: Any) -> tuple[int, int] | None:
        """``(rows, nbytes)`` of a tree like the remembered one; None for any other."""
        taken = self.take(tree)
        return None if taken is None else (taken[1], taken[2])

    def take(self, tree: Any) -> tuple[dict[str, Any], int, int] | None:
        """A tree like the remembered one as ``(leaves by name, rows, nbytes)``, the
        leaves a new dict (the caller's tree may change after); None for any other."""
        layout = self._layout
        if layout is None:
            return None
        keys = self._flat_keys
        if keys is not None:  # a dict of leaves (the common case): no call into the layout
            if type(tree) is not dict or tuple(tree) != keys:
                return None
            leaves: Any = tree.values()
        else:
            leaves = layout.leaves(tree)
            if leaves is None:
                return None
        same = self._same
        if same is not None:
            for leaf, (t, aval, sharding) in zip(leaves, same[0]):
                if (
                    type(leaf) is not t
                    or leaf.aval is not aval  # a jax.Array's shape and dtype are its aval's
                    or leaf.sharding is not sharding
                    or leaf.is_deleted()
                ):
                    break
            else:
                arrays = dict(tree) if keys is not None else dict(zip(layout.keys, leaves))
                return arrays, same[1], same[2]
        leaves = list(leaves)
        checked = self._check_attributes(leaves)
        if checked is None:
            return None
        self._same = _identities(leaves, *checked)
        return self._arrays(tree, leaves), *checked

    def _arrays(self, tree: Any, leaves: list[Any]) -> dict[str, Any]:
        assert self._layout is not None
        if self._layout.flat_dict:
            return dict(tree)
        return dict(zip(self._layout.keys, leaves))

    def _check_attributes(self, leaves: list[Any]) -> tuple[int, int] | None:
        """``(rows, nbytes)`` from every leaf's type, shape, dtype and sharding."""
        rows = -1
        nbytes = 0
        for leaf, spec in zip(leaves, self._leaves, strict=True):
            if type(leaf) is not spec.type:
                return None
            shape = leaf.shape
            if len(shape) != len(spec.row_shape) + 1 or shape[1:] != spec.row_shape:
                return None
            if rows < 0:
                rows = shape[0]
            if shape[0] != rows or rows == 0 or leaf.dtype != spec.dtype:
                return None
            sharding = leaf.sharding
            if sharding is not spec.sharding and sharding != spec.sharding:
                return None
            if leaf.is_deleted():
                return None
            nbytes += rows * spec.row_bytes
        return rows, nbytes


def _identities(
    leaves: list[Any], rows: int, nbytes: int
) -> tuple[tuple[tuple[Any, ...], ...], int, int] | None:
    """A checked tree's (type, aval, sharding) a leaf, with its rows and bytes, for the
    quick check on identities; None when a leaf has no aval (never for a jax.Array: the
    others are checked attribute by attribute every time)."""
    out = []
    for leaf in leaves:
        aval = getattr(leaf, "aval", None)
        if aval is None or aval.shape != leaf.shape or aval.dtype != leaf.dtype:
            return None
        out.append((type(leaf), aval, leaf.sharding))
    return tuple(out), rows, nbytes
