"""Section ``cold``: random batch reads with the page cache dropped before every repeat."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_common import (
    PAGE_CACHE,
    Case,
    Config,
    SectionResult,
    drop_page_cache,
    index_batches,
    time_steps,
)
from bench_data import Store, raw_leaf_offsets
from bench_formats import open_source

__all__ = ["run_cold"]

# Uncompressed layouts: the ones whose cold reads are bounded by the disk, not a codec.
COLD_LAYOUTS = ("npy", "hdf5", "hdf5-chunked", "zarr")
# The baselines read rows straight from files where rows lie contiguously.
RAW_LAYOUTS = ("npy", "hdf5")


class _RawLeaves:
    """Rows of every leaf at known file offsets: memmap gather and pread gathers."""

    def __init__(self, store: Store):
        ds = store.dataset
        self.n = ds.n
        self.leaves = []
        offsets = raw_leaf_offsets(store)
        for key, dtype, shape in ds.leaves:
            file, offset = offsets[key]
            dt = np.dtype(dtype)
            row = dt.itemsize * int(np.prod(shape, dtype=np.int64))
            self.leaves.append((key, file, offset, dt, tuple(shape), row))
        self._maps: dict[str, np.ndarray] | None = None
        self._fds: dict[str, int] = {}

    def close(self) -> None:
        self._maps = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def memmap_gather(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        if self._maps is None:
            self._maps = {
                key: np.memmap(file, dtype=dt, mode="r", offset=off, shape=(self.n, *shape))
                for key, file, off, dt, shape, _ in self.leaves
            }
        return {k: np.asarray(m[idx]) for k, m in self._maps.items()}

    def pread_gather(self, idx: np.ndarray, sort: bool) -> dict[str, np.ndarray]:
        order = np.argsort(idx, kind="stable") if sort else np.arange(len(idx))
        out = {}
        for key, file, off, dt, shape, row in self.leaves:
            fd = self._fds.get(file)
            if fd is None:
                fd = self._fds[file] = os.open(file, os.O_RDONLY)
            arr = np.empty((len(idx), *shape), dtype=dt)
            rows = arr.view(np.uint8).reshape(len(idx), row)
            for j in order:
                os.preadv(fd, [rows[j]], off + int(idx[j]) * row)
            out[key] = arr
        return out


def run_cold(
    cfg: Config,
    stores: dict[str, dict[str, Store]],
    res: SectionResult,
    log: Callable[[str], None],
) -> None:
    # --quick: images only (every format is covered; transitions cold is slow per batch).
    for ds_name in ("images",) if cfg.quick else ("images", "transitions"):
        _cold_dataset(cfg, ds_name, stores[ds_name], res)


def _cold_dataset(
    cfg: Config,
    ds_name: str,
    layouts: dict[str, Store],
    res: SectionResult,
) -> None:
    sec = "cold"
    ds = layouts["npy"].dataset
    pool = index_batches(ds.n, cfg)

    def case(
        store: Store,
        method: str,
        kind: str,
        step: Callable[[int], Any],
        before: Callable[[], Any] | None,
        note: str = "",
    ) -> Case | None:
        name = f"{sec}/{ds_name}/{store.layout.name}/{method}"
        if not cfg.wants(name):
            return None
        # One warm-up step only: later ones would find pages the first one cached.
        batches, times = time_steps(step, cfg, before_repeat=before, warmup_s=0.0)
        c = Case(
            name, sec, ds_name, store.layout.fmt, store.layout.name, method, kind,
            cfg.batch_size, ds.record_bytes, batches, times, note,
        )  # fmt: skip
        return res.add(c)

    # Page-cached reference: shows how much dropping the cache costs.
    npy = layouts["npy"]
    PAGE_CACHE.keep_only([npy.path])
    with open_source(npy) as src:
        warm = case(npy, "read_batch-warm", "source", lambda i: src.read_batch(pool[i]), None)

    for layout in COLD_LAYOUTS:
        store = layouts[layout]
        src = open_source(store)

        def drop(src: Any = src, store: Store = store) -> None:
            # Mapped pages survive the drop: close first. Reopen before the
            # timer: opening (metadata, one map per chunk file) is a one-time
            # cost per process, not a cost of reading cold batches.
            src.close()
            drop_page_cache([store.path])
            src._get_handle()

        case(store, "read_batch", "source", lambda i, src=src: src.read_batch(pool[i]), drop)
        src.close()
        PAGE_CACHE.touched(store.path)

    for layout in RAW_LAYOUTS:
        store = layouts[layout]
        raw = _RawLeaves(store)

        def drop_raw(raw: _RawLeaves = raw, store: Store = store) -> None:
            raw.close()
            drop_page_cache([store.path])

        case(
            store, "np.memmap-gather", "baseline",
            lambda i, raw=raw: raw.memmap_gather(pool[i]), drop_raw,
        )  # fmt: skip
        case(
            store, "pread-per-row", "baseline",
            lambda i, raw=raw: raw.pread_gather(pool[i], sort=False), drop_raw,
        )  # fmt: skip
        case(
            store, "pread-sorted", "baseline",
            lambda i, raw=raw: raw.pread_gather(pool[i], sort=True), drop_raw,
        )  # fmt: skip
        raw.close()
        PAGE_CACHE.touched(store.path)

    p = f"{sec}/{ds_name}"
    for layout in COLD_LAYOUTS:
        c = res.get(f"{p}/{layout}/read_batch")
        if c is None:
            continue
        base_layout = layout if layout in RAW_LAYOUTS else "npy"
        bases = [
            res.get(f"{p}/{base_layout}/{m}")
            for m in ("np.memmap-gather", "pread-per-row", "pread-sorted")
        ]
        present = [x for x in bases if x is not None]
        if not present:
            continue
        best = max(present, key=lambda x: x.records_per_s)
        where = "same file" if base_layout == layout else "the .npy files"
        res.ratio(
            f"{p}: {layout} read_batch / best raw gather ({best.method}, {where})",
            c, best, None, "vs raw gather",
        )  # fmt: skip
        if warm is not None:
            res.ratio(f"{p}: {layout} cold / npy warm", c, warm, None, "cold vs warm")
