"""A store's leaves packed into row matrices and loaded onto every device, and its budget."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from grain_replay.errors import ResidentUnsupportedError

__all__ = ["Probe", "default_budget", "format_bytes", "load_store"]

_DEFAULT_BUDGET_FRACTION = 0.5  # of the free memory a device reports, when no budget is given


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def default_budget() -> tuple[int, str]:
    """Bytes per device when no budget is given, and how they were worked out."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        share = int(free * _DEFAULT_BUDGET_FRACTION)
        return share, f"half of the {format_bytes(free)} free on {device}"
    # The CPU backend reports no limit: its devices share the host's memory.
    available = _host_available_bytes()
    count = jax.local_device_count()
    share = int(available * _DEFAULT_BUDGET_FRACTION) // count
    why = f"half of the {format_bytes(available)} of available host memory over {count} devices"
    return share, why


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Probe:
    """A source's leaves (structure, device dtypes, bytes) from its first record; their packing."""

    def __init__(self, source: Any) -> None:
        first = source.read_batch(np.arange(1))
        leaves, self.treedef = jax.tree_util.tree_flatten(first)
        self.shapes = [tuple(np.shape(a))[1:] for a in leaves]
        # The dtype jax gives the leaf on the device (float64 -> float32 without x64),
        # as the host pipeline's transfer does.
        self.dtypes = [jax.dtypes.canonicalize_dtype(np.asarray(a).dtype) for a in leaves]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.record_bytes = sum(
            n * np.dtype(d).itemsize for n, d in zip(self.sizes, self.dtypes, strict=True)
        )
        # The store is held as one row matrix per group of leaves: leaves whose dtype
        # can be bitcast to an unsigned int share the group of that width (a transition's
        # float32 and int32 leaves become one uint32 row), so a batch is one gather per
        # group rather than one per leaf (on XLA:CPU, 3-4x less time per batch).
        # A leaf alone in its group, or of another dtype (complex), is held as it is.
        self.groups: list[list[int]] = []
        self.group_dtypes: list[np.dtype[Any]] = []
        by_width: dict[int, int] = {}
        for i, d in enumerate(self.dtypes):
            d = np.dtype(d)
            packable = d == np.bool_ or d.kind in "iuf" or jnp.issubdtype(d, jnp.floating)
            if packable and d.itemsize in (1, 2, 4, 8):
                g = by_width.get(d.itemsize)
                if g is None:
                    g = by_width[d.itemsize] = len(self.groups)
                    self.groups.append([])
                    self.group_dtypes.append(np.dtype(f"uint{8 * d.itemsize}"))
                self.groups[g].append(i)
            else:
                self.groups.append([i])
                self.group_dtypes.append(d)
        for g, members in enumerate(self.groups):  # a leaf alone is held as it is
            if len(members) == 1:
                self.group_dtypes[g] = np.dtype(self.dtypes[members[0]])

    def group_shapes(self, n: int) -> list[tuple[int, ...]]:
        """Shape of each group's row matrix for ``n`` records."""
        out: list[tuple[int, ...]] = []
        for members in self.groups:
            if len(members) == 1:
                out.append((n, *self.shapes[members[0]]))
            else:
                out.append((n, sum(self.sizes[i] for i in members)))
        return out

    def pack(self, leaves: list[jax.Array]) -> list[jax.Array]:
        """Traced: the leaves of a chunk of rows as the groups' row matrices (bit-exact)."""
        out = []
        for members, dtype in zip(self.groups, self.group_dtypes, strict=True):
            if len(members) == 1:
                out.append(leaves[members[0]])
                continue
            cols = []
            for i in members:
                x = leaves[i].reshape(leaves[i].shape[0], -1)
                x = (
                    x.astype(dtype)
                    if x.dtype == jnp.bool_
                    else jax.lax.bitcast_convert_type(x, dtype)
                )
                cols.append(x)
            out.append(cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1))
        return out

    def unpack(self, rows: list[jax.Array]) -> list[jax.Array]:
        """Traced: the leaves of gathered group rows, in leaf order."""
        leaves: list[Any] = [None] * len(self.dtypes)
        for members, r in zip(self.groups, rows, strict=True):
            if len(members) == 1:
                leaves[members[0]] = r
                continue
            offset = 0
            for i in members:
                x = r[:, offset : offset + self.sizes[i]].reshape(r.shape[0], *self.shapes[i])
                offset += self.sizes[i]
                target = self.dtypes[i]
                leaves[i] = (
                    x != 0 if target == jnp.bool_ else jax.lax.bitcast_convert_type(x, target)
                )
        return leaves


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, desc=desc, unit="rec", unit_scale=True, leave=False)
    return None


def load_store(
    source: Any,
    n: int,
    probe: Probe,
    replicated: NamedSharding,
    progress: bool,
    chunk_bytes: int,
) -> list[jax.Array]:
    """Rows ``[0, n)`` of ``source`` as the probe's group matrices, replicated on every device.

    Reads ``chunk_bytes`` of rows at a time and writes them into preallocated device
    buffers (donated, so updated in place): the host holds one chunk, never the store.
    Each chunk's leaves are put as the host pipeline puts them (same dtype conversion)
    and packed on the devices.
    """
    shapes = probe.group_shapes(n)
    allocate = jax.jit(
        lambda: [jnp.zeros(s, d) for s, d in zip(shapes, probe.group_dtypes, strict=True)],
        out_shardings=replicated,
    )
    update = jax.jit(
        lambda bufs, chunk, lo: [
            jax.lax.dynamic_update_slice_in_dim(b, c, lo, axis=0)
            for b, c in zip(bufs, probe.pack(chunk), strict=True)
        ],
        donate_argnums=0,
        out_shardings=replicated,
    )
    bufs = allocate()
    rows = max(1, chunk_bytes // max(1, probe.record_bytes))
    bar = _progress(n, "loading store onto devices", progress)
    try:
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            leaves = jax.tree_util.tree_leaves(source.read_batch(np.arange(lo, hi)))
            for key, a, shape in zip(_keys(probe), leaves, probe.shapes, strict=True):
                if tuple(np.shape(a)) != (hi - lo, *shape):
                    raise ResidentUnsupportedError(
                        f"Leaf '{key}' of {source!r} gave records of shape {np.shape(a)[1:]} "
                        f"at rows [{lo}, {hi}), but {shape} at row 0. Device-resident replay "
                        "needs every record of a leaf to have one shape. Fix: use resident=False."
                    )
            chunk = [
                jax.make_array_from_callback(np.shape(a), replicated, np.asarray(a).__getitem__)
                for a in leaves
            ]
            bufs = update(bufs, chunk, lo)
            del leaves, chunk
            jax.block_until_ready(bufs)  # one chunk in flight: host memory stays one chunk
            if bar is not None:
                bar.update(hi - lo)
    finally:
        if bar is not None:
            bar.close()
    return bufs


def _keys(probe: Probe) -> list[str]:
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(probe.treedef, list(range(len(probe.shapes))))
    )[0]
    return [jax.tree_util.keystr(p, simple=True, separator="/") or "<root>" for p, _ in paths]
