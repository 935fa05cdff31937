"""Host copies of queued accelerator trees: runs of like trees stacked on the device and
copied to host a transfer per leaf per group, not one per leaf per append.

On an accelerator each device-to-host transfer has a fixed cost: measured on a TPU v5e
host, ``copy_to_host_async`` took ~70 us of the caller's thread a leaf, and a blocking
copy ~450 us. Five leaves copied one by one every step of a 1,024-env actor cost more
than the step. The writer's thread therefore takes the trees of a batch, groups
consecutive trees whose device leaves have the same dtypes, shapes and shardings (the
same actor step, append after append), and for each group runs one jitted function on
the device that stacks every leaf over the group: one transfer a leaf a group (up to
:data:`MAX_GROUP` trees), each tree's rows then a view of the stacked host array (no
copy). Groups have power-of-two sizes, so at most ``log2(MAX_GROUP)`` programs are
compiled for a tree shape (about a second each on a TPU; laying the leaves' bytes end to
end in one buffer, one transfer a group, compiled for 11 to 78 s there, for a few
percent). A CPU device's array is host memory already and is never packed (the thread
reads it in place). Anything the packer cannot take (leaves on different devices, an
unusual array) is left to the per-leaf copy, which also words the error naming the leaf.

jax is imported only here and only once a device leaf was appended (so it is loaded).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from grain_replay.writers.device import leaves as device_leaves
from grain_replay.writers.device.queue import Item

__all__ = ["MAX_GROUP", "pack_batch"]

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


def _groups(batch: list[Item]) -> list[tuple[Any, list[Item]]]:
    """Consecutive like trees of ``batch`` in power-of-two groups of 2 or more."""
    runs: list[tuple[Any, list[Item]]] = []
    for item in batch:
        key = None if item.pack is None else item.pack[0]
        if key is None or key in _unpackable:
            runs.append((None, [item]))
        elif runs and runs[-1][0] == key:
            runs[-1][1].append(item)
        else:
            runs.append((key, [item]))
    groups = []
    for key, items in runs:
        if key is None:
            continue
        start = 0
        for size in _sizes(len(items)):
            groups.append((key, items[start : start + size]))
            start += size
    return groups


def _unpack(stacked: list[np.ndarray], want: list[tuple[str, Any, Any]], items: list[Item]) -> None:
    """Replaces each item's packed leaves by its view of the stacked host arrays."""
    for (name, dtype, shape), host in zip(want, stacked, strict=True):
        if host.shape != (len(items), *shape) or host.dtype != dtype:
            raise ValueError(f"stacked {name!r} came back {host.dtype}{host.shape}")
        for i, item in enumerate(items):
            item.arrays[name] = host[i]


def pack_batch(batch: list[Item]) -> int:
    """Copies the accelerator leaves of like consecutive trees of ``batch`` to host, a
    transfer per leaf per group, replacing them in the items' arrays; returns the trees packed.

    Leaves it leaves alone (lone trees, CPU arrays, what the packer refused) are the
    caller's to copy one by one; a group whose packing fails is left whole to that path
    (which names the failing leaf), and its key is not tried again when the failure was
    the packer's (tracing, devices), not the arrays' (a deleted one)."""
    if not any(item.pack is not None for item in batch):
        return 0  # CPU devices' arrays (or lone host trees): nothing to stack
    groups = _groups(batch)
    if not groups:
        return 0
    pack = _packer_fn()
    started = []
    for key, items in groups:
        if key in _unpackable:  # refused by an earlier group of this batch
            continue
        names = items[0].pack[1] if items[0].pack is not None else ()
        try:
            first = items[0].arrays
            want = [(n, np.dtype(first[n].dtype), tuple(first[n].shape)) for n in names]
            out = pack([tuple(item.arrays[n] for n in names) for item in items])
            for leaf in out:
                leaf.copy_to_host_async()
        except Exception as e:
            if not any(_deleted(item.arrays[n]) for item in items for n in names):
                _unpackable.add(key)
                logger.info("device leaves not stacked (%s: %s); copied one by one", type(e), e)
            continue
        started.append((want, items, out))
    packed = 0
    for want, items, out in started:
        _unpack([np.asarray(leaf) for leaf in out], want, items)
        packed += len(items)
    return packed


def _deleted(leaf: Any) -> bool:
    try:
        return bool(leaf.is_deleted())
    except Exception:
        return False
