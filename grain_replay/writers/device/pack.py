"""Host copies of queued accelerator trees: runs of like trees stacked on the device and
copied to host a transfer per leaf per group, not one per leaf per append.

On an accelerator each device-to-host transfer has a fixed cost: measured on a TPU v5e
host, ``copy_to_host_async`` took ~70 us of the caller's thread a leaf, and a blocking
copy ~450 us. Five leaves copied one by one every step of a 1,024-env actor cost more
than the step. The writer's thread therefore takes the trees of a batch, groups
consecutive trees whose device leaves have the same dtypes, shapes and shardings (the
same actor step, append after append), and for each group runs one jitted function on
the device that stacks every leaf over the group: one transfer a leaf a group (up to
:data:`MAX_GROUP` trees), the group's rows of a leaf then one host block, written as it
is (no Python work tree by tree: the writer's thread holds the GIL, which the actor's
dispatch needs, a few microseconds a group rather than a few a tree). Groups have
power-of-two sizes, so at most ``log2(MAX_GROUP)`` programs are compiled for a tree
shape (about a second each on a TPU; laying the leaves' bytes end to end in one buffer,
one transfer a group, compiled for 11 to 78 s there, for a few percent); the writer's
thread takes batches of up to ``MAX_GROUP`` trees, so a steady actor's batch is one
group. A CPU device's array is host memory already and is never packed (the thread
reads it in place). Anything the packer cannot take (leaves on different devices, an
unusual array) is left to the per-leaf copy, which also words the error naming the leaf.

jax is imported only here and only once a device leaf was appended (so it is loaded).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from grain_replay.writers.device import leaves as device_leaves
from grain_replay.writers.device.queue import Item

__all__ = ["MAX_GROUP", "Packed", "pack_batch"]

logger = logging.getLogger(__name__)

# Trees stacked into one transfer a leaf at the most (64 steps of 1,024 CartPoles: 2.6 MB).
MAX_GROUP = 64

_lock = threading.Lock()
_packer: Callable[[Any], Any] | None = None
_unpackable: set[Hashable] = set()  # group keys the packer refused once


def _make_packer() -> Callable[[Any], Any]:
    import jax
    import jax.numpy as jnp

    def pack(trees: Sequence[Sequence[Any]]) -> tuple[Any, ...]:
        return tuple(jnp.stack(list(leaves)) for leaves in zip(*trees, strict=True))

    return jax.jit(pack)


def _packer_fn() -> Callable[[Any], Any]:
    global _packer
    with _lock:
        if _packer is None:
            _packer = _make_packer()
        return _packer


def group_of(
    arrays: dict[str, Any], is_device: Callable[[Any], bool]
) -> tuple[Any, tuple[str, ...]] | None:
    """What a queued tree shares with the trees it may be stacked with (its accelerator
    leaves' names, dtypes, shapes and shardings) and those leaves' names; None when it
    has none (CPU devices' arrays are host memory) or one that cannot be keyed. Trees
    taken by the quick check of a tree like the last one are keyed by that check's
    signature and their rows instead (the same guarantees, no look at the leaves)."""
    key = []
    for name, leaf in arrays.items():
        if isinstance(leaf, np.ndarray) or not is_device(leaf) or device_leaves.on_host(leaf):
            continue
        try:
            sharding = leaf.sharding
            hash(sharding)
            key.append((name, np.dtype(leaf.dtype), tuple(leaf.shape), sharding))
        except Exception:  # not an array we know how to stack: the per-leaf path
            return None
    return (tuple(key), tuple(k[0] for k in key)) if key else None


def _sizes(n: int) -> list[int]:
    """``n`` trees as power-of-two groups, largest first (1s left to the per-leaf path)."""
    out = []
    while n >= 2:
        size = min(MAX_GROUP, 1 << (n.bit_length() - 1))
        out.append(size)
        n -= size
    return out


_PACK = operator.attrgetter("pack")
_ARRAYS = operator.attrgetter("arrays")


def _groups(batch: list[Item]) -> list[tuple[Any, int, int]]:
    """Consecutive like trees of ``batch`` in power-of-two groups of 2 or more: each
    group's key, its first tree's index in ``batch`` and its size."""
    first = batch[0].pack
    packs = list(map(_PACK, batch))
    if first is not None and packs.count(first) == len(batch):
        # One run of like trees (an actor's steps: one key object, submit_like_last),
        # grouped without a look at each tree.
        key = first[0]
        if key in _unpackable:
            return []
        groups = []
        start = 0
        for size in _sizes(len(batch)):
            groups.append((key, start, size))
            start += size
        return groups
    runs: list[tuple[Any, int, int]] = []  # (key, start, length)
    for i, item in enumerate(batch):
        key = None if item.pack is None else item.pack[0]
        if key is None or key in _unpackable:
            runs.append((None, i, 1))
        elif runs and runs[-1][0] == key:
            runs[-1] = (key, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((key, i, 1))
    groups = []
    for key, start, length in runs:
        if key is None:
            continue
        for size in _sizes(length):
            groups.append((key, start, size))
            start += size
    return groups


@dataclasses.dataclass(slots=True)
class Packed:
    """A group of like trees copied to host: trees ``[start, start + count)`` of the
    batch; ``arrays``, their stacked leaves with the trees' rows end to end (views of
    the one host copy a leaf); the trees' other leaves are the caller's to copy."""

    start: int
    count: int
    arrays: dict[str, np.ndarray]


def _rows_end_to_end(
    stacked: list[np.ndarray], want: list[tuple[str, Any, Any]], count: int
) -> dict[str, np.ndarray]:
    """Each stacked host leaf ``(count, rows, ...)`` as ``(count * rows, ...)`` (a view)."""
    out = {}
    for (name, dtype, shape), host in zip(want, stacked, strict=True):
        if host.shape != (count, *shape) or host.dtype != dtype:
            raise ValueError(f"stacked {name!r} came back {host.dtype}{host.shape}")
        out[name] = host.reshape(count * shape[0], *shape[1:])
    return out


def pack_batch(batch: list[Item]) -> list[Packed]:
    """Copies the accelerator leaves of like consecutive trees of ``batch`` to host, a
    transfer per leaf per group; returns the groups, in batch order, each with its
    leaves' rows end to end (one block a group: nothing is unpacked tree by tree).

    Leaves it leaves alone (lone trees, CPU arrays, what the packer refused) are the
    caller's to copy one by one; a group whose packing fails is left whole to that path
    (which names the failing leaf), and its key is not tried again when the failure was
    the packer's (tracing, devices), not the arrays' (a deleted one)."""
    if not any(item.pack is not None for item in batch):
        return []  # CPU devices' arrays (or lone host trees): nothing to stack
    groups = _groups(batch)
    if not groups:
        return []
    pack = _packer_fn()
    started = []
    for key, start, size in groups:
        if key in _unpackable:  # refused by an earlier group of this batch
            continue
        items = batch[start : start + size]
        names = items[0].pack[1] if items[0].pack is not None else ()
        try:
            first = items[0].arrays
            want = [(n, np.dtype(first[n].dtype), tuple(first[n].shape)) for n in names]
            get = operator.itemgetter(*names)
            if len(names) == 1:
                args = [(get(item.arrays),) for item in items]
            else:  # the leaves taken tree by tree in C (no Python a tree)
                args = list(map(get, map(_ARRAYS, items)))
            out = pack(args)
            for leaf in out:
                leaf.copy_to_host_async()
        except Exception as e:
            if not any(_deleted(item.arrays[n]) for item in items for n in names):
                _unpackable.add(key)
                logger.info("device leaves not stacked (%s: %s); copied one by one", type(e), e)
            continue
        started.append((want, start, size, out))
    return [
        Packed(start, size, _rows_end_to_end([np.asarray(leaf) for leaf in out], want, size))
        for want, start, size, out in started
    ]


def _deleted(leaf: Any) -> bool:
    try:
        return bool(leaf.is_deleted())
    except Exception:
        return False
