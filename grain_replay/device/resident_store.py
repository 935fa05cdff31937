"""A store loaded onto every device in the line layout (``device/lines.py``), and its budget."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from grain_replay.device.lines import ROW_ALIGN, Probe, RowLayout
from grain_replay.device.resident_programs import load_programs
from grain_replay.errors import ResidentUnsupportedError

__all__ = ["chunk_rows", "default_budget", "format_bytes", "load_store"]

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


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, desc=desc, unit="rec", unit_scale=True, leave=False)
    return None


def chunk_rows(record_bytes: int, chunk_bytes: int) -> int:
    """Rows read (and copied to the devices) per loading step: ``chunk_bytes`` of records,
    a multiple of :data:`~grain_replay.device.lines.ROW_ALIGN` rows (each chunk starts a
    line of every leaf's buffer), at least one such block."""
    rows = chunk_bytes // max(1, record_bytes)
    return max(ROW_ALIGN, rows // ROW_ALIGN * ROW_ALIGN)


def load_store(
    source: Any,
    layout: RowLayout,
    replicated: NamedSharding,
    progress: bool,
    chunk_bytes: int,
) -> list[jax.Array]:
    """Rows ``[0, layout.capacity)`` of ``source`` in the layout's buffers, replicated on
    every device.

    Reads :func:`chunk_rows` rows at a time and writes them into preallocated device
    buffers (donated, so updated in place): the host holds one chunk, never the store.
    Each chunk's leaves are put as the host pipeline puts them (same dtype conversion)
    and laid out on the devices (:meth:`RowLayout.write_rows`).
    """
    probe, n = layout.probe, layout.capacity
    allocate, update = load_programs(layout, replicated)  # compiled once a process
    bufs = allocate()
    rows = chunk_rows(probe.record_bytes, chunk_bytes)
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
            bufs = update(bufs, chunk, np.int32(lo))
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
