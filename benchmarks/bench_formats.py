"""Section ``formats``: page-cached random batch reads of every source, layout and baseline."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import grain
import numpy as np
from baselines import (
    DecodeRecord,
    H5OpenPerItemSource,
    H5PerRecordSource,
    decode_records,
    record_dtype,
)
from bench_common import PAGE_CACHE, Case, Config, SectionResult, index_batches, time_steps
from bench_data import Store, array_record_files, load_arrays

import grain_replay as gr

__all__ = ["SOURCE_CLASSES", "grain_loader_case", "open_source", "run_formats", "stack_records"]

SOURCE_CLASSES: dict[str, Any] = {
    "npy": gr.NpyDataSource,
    "hdf5": gr.HDF5DataSource,
    "zarr": gr.ZarrDataSource,
}

# Targets of the issue: read_batch over the in-RAM numpy gather, per default layout.
LIMIT_TARGETS = {
    "npy": {"transitions": 0.9, "images": 0.8},
    "hdf5": {"transitions": 0.9, "images": 0.8},
    "zarr": {"transitions": 0.5, "images": 0.4},
}
H5PY_SORTED_TARGET = 20.0
ZARR_OINDEX_TARGET = 30.0
ARRAY_RECORD_TARGET = 50.0


def open_source(store: Store) -> Any:
    return SOURCE_CLASSES[store.layout.fmt](store.path)


def stack_records(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in records]) for k in records[0]}


def _case(
    cfg: Config,
    section: str,
    store_or_ds: Store | Any,
    layout: str,
    fmt: str,
    method: str,
    kind: str,
    step: Callable[[int], Any],
    *,
    note: str = "",
    **timing: Any,
) -> Case | None:
    ds = store_or_ds.dataset if isinstance(store_or_ds, Store) else store_or_ds
    name = f"{section}/{ds.name}/{layout}/{method}"
    if kind not in ("limit", "ceiling") and not cfg.wants(name):
        return None
    batches, times = time_steps(step, cfg, **timing)
    case = Case(
        name, section, ds.name, fmt, layout, method, kind, cfg.batch_size, ds.record_bytes,
        batches, times, note,
    )  # fmt: skip
    return case


def grain_loader_case(
    cfg: Config,
    section: str,
    store: Store,
    label: str,
    source: Any,
    operations: list[Any],
    worker_count: int,
    *,
    fmt: str,
    note: str = "",
    max_batches: int | None = None,
) -> Case | None:
    """``grain.DataLoader`` + ``Batch`` over a per-record source, shuffled, forever."""
    name = f"{section}/{store.dataset.name}/{store.layout.name}/{label}-w{worker_count}"
    if not cfg.wants(name):
        return None
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(
            num_records=len(source),
            shard_options=grain.sharding.NoSharding(),
            shuffle=True,
            num_epochs=None,
            seed=cfg.seed,
        ),
        operations=[*operations, grain.transforms.Batch(cfg.batch_size, drop_remainder=True)],
        worker_count=worker_count,
    )
    held = [iter(loader)]  # dropping the last reference stops grain's workers
    try:
        # Several warm-up batches: worker start-up and a full prefetch buffer are
        # not steady state.
        batches, times = time_steps(
            lambda i: next(held[0]),
            cfg,
            warmup=3 + 2 * worker_count,
            warmup_s=cfg.target_s,
            min_batches=2 if worker_count else 1,
            max_batches=max_batches,
        )
    finally:
        held.clear()
        gc.collect()
    return Case(
        name, section, store.dataset.name, fmt, store.layout.name, f"{label}-w{worker_count}",
        "baseline", cfg.batch_size, store.dataset.record_bytes, batches, times, note,
    )  # fmt: skip


def _zarr_oindex_step(store: Store, pool: np.ndarray) -> Callable[[int], Any]:
    import zarr

    group = zarr.open_group(store.path, mode="r")
    arrays = {k: group[k] for k in store.dataset.keys}

    def step(i: int) -> dict[str, np.ndarray]:
        unique, inverse = np.unique(pool[i], return_inverse=True)
        return {k: a.oindex[unique][inverse] for k, a in arrays.items()}

    return step


def run_formats(
    cfg: Config,
    stores: dict[str, dict[str, Store]],
    res: SectionResult,
    log: Callable[[str], None],
) -> None:
    for ds_name, layouts in stores.items():
        _formats_dataset(cfg, ds_name, layouts, res, log)


def _formats_dataset(
    cfg: Config,
    ds_name: str,
    layouts: dict[str, Store],
    res: SectionResult,
    log: Callable[[str], None],
) -> None:
    sec = "formats"
    ds = layouts["npy"].dataset
    pool = index_batches(ds.n, cfg)
    log(f"  [{ds_name}] loading arrays into RAM for the limit")
    arrays = load_arrays(layouts["npy"])
    PAGE_CACHE.touched(layouts["npy"].path)
    n, b = ds.n, cfg.batch_size

    def gather(i: int, arrays: dict[str, np.ndarray] = arrays) -> Any:
        idx = pool[i]
        return {k: a[idx] for k, a in arrays.items()}

    def take(i: int, arrays: dict[str, np.ndarray] = arrays) -> Any:
        idx = pool[i]
        return {k: np.take(a, idx, axis=0) for k, a in arrays.items()}

    def memcpy(i: int, arrays: dict[str, np.ndarray] = arrays) -> Any:
        s = min(int(pool[i][0]), n - b)
        return {k: a[s : s + b].copy() for k, a in arrays.items()}

    # The references run before and after the sources (arrays stay in RAM in
    # between); their repeats are pooled so that drift on a noisy machine does
    # not land on one side of the ratios.
    references = [
        ("numpy-gather", "limit", gather),
        ("numpy-take", "limit", take),
        ("memcpy", "ceiling", memcpy),
    ]
    refs = {
        method: _case(cfg, sec, ds, "memory", "memory", method, kind, step)
        for method, kind, step in references
    }
    first = len(res.cases)
    _formats_sources(cfg, sec, ds_name, layouts, pool, res)
    for j, (method, _, step) in enumerate(references):
        ref = refs[method]
        assert ref is not None
        _, times = time_steps(step, cfg, batches=ref.batches)
        ref.repeat_s.extend(times)
        ref.note = f"repeats before + after the sources, pooled ({len(ref.repeat_s)})"
        res.add(ref, at=first + j)
    limit = refs["numpy-gather"]
    assert limit is not None
    del arrays, refs, references
    gc.collect()
    _formats_baselines(cfg, sec, ds_name, layouts, pool, res)
    _formats_ratios(res, ds_name, layouts, limit)


def _formats_sources(
    cfg: Config,
    sec: str,
    ds_name: str,
    layouts: dict[str, Store],
    pool: np.ndarray,
    res: SectionResult,
) -> None:

    # grain_replay sources over every layout.
    for layout, store in layouts.items():
        if store.layout.fmt not in SOURCE_CLASSES:
            continue
        name = f"{sec}/{ds_name}/{layout}/read_batch"
        if not cfg.wants(name):
            continue
        PAGE_CACHE.keep_only([store.path])
        with open_source(store) as src:
            res.add(
                _case(
                    cfg, sec, store, layout, store.layout.fmt, "read_batch", "source",
                    lambda i, src=src: src.read_batch(pool[i]),
                    note=f"{type(src).__name__}, default cache (fresh: fills while timed)",
                )
            )  # fmt: skip
            if store.layout.chunked and store.layout.written_by != "gr.write":
                _chunk_cache_cases(cfg, sec, store, layout, src, pool, res)


# Above this many decoded bytes, the "whole dataset cached" case is skipped.
CACHE_ALL_MAX_BYTES = 4 * 2**30


def _chunk_cache_cases(
    cfg: Config,
    sec: str,
    store: Store,
    layout: str,
    src: Any,
    pool: np.ndarray,
    res: SectionResult,
) -> None:
    """A chunked foreign store read with an empty cache, and with one holding everything."""
    cache = src._get_handle().cache

    def cold(i: int) -> Any:
        cache.clear()
        return src.read_batch(pool[i])

    res.add(
        _case(
            cfg, sec, store, layout, store.layout.fmt, "read_batch-cold", "source", cold,
            note="decoded-chunk cache emptied before every batch",
        )
    )  # fmt: skip
    ds = store.dataset
    need = ds.n * ds.record_bytes
    if need > CACHE_ALL_MAX_BYTES or not cfg.wants(f"{sec}/{ds.name}/{layout}/read_batch-cache"):
        return
    big = SOURCE_CLASSES[store.layout.fmt](store.path, cache_bytes=need + need // 4 + 2**26)
    step = max(1, 2**24 // ds.record_bytes)
    for lo in range(0, ds.n, step):  # one pass decodes every chunk into the cache
        big.read_batch(np.arange(lo, min(lo + step, ds.n)))
    res.add(
        _case(
            cfg, sec, store, layout, store.layout.fmt, "read_batch-cache-all", "source",
            lambda i: big.read_batch(pool[i]),
            note=f"cache_bytes={big._cache_bytes >> 20} MiB: every chunk cached",
        )
    )  # fmt: skip
    big.close()


def _formats_baselines(
    cfg: Config,
    sec: str,
    ds_name: str,
    layouts: dict[str, Store],
    pool: np.ndarray,
    res: SectionResult,
) -> None:
    ds = layouts["npy"].dataset
    # h5py baselines.
    h5_default = layouts["hdf5"]
    for layout, store in layouts.items():
        if store.layout.fmt != "hdf5":
            continue
        if not cfg.wants(f"{sec}/{ds_name}/{layout}/h5py-sorted"):
            continue
        PAGE_CACHE.keep_only([store.path])
        h5 = H5PerRecordSource(store.path, ds.keys)
        res.add(
            _case(
                cfg, sec, store, layout, "hdf5", "h5py-sorted", "baseline",
                lambda i, h5=h5: h5.read_sorted(pool[i]),
                note="dset[np.unique(idx)] per leaf",
            )
        )  # fmt: skip
        h5.close()
    PAGE_CACHE.keep_only([h5_default.path])
    h5 = H5PerRecordSource(h5_default.path, ds.keys)
    res.add(
        _case(
            cfg, sec, h5_default, "hdf5", "hdf5", "h5py-per-record", "baseline",
            lambda i: stack_records([h5[int(j)] for j in pool[i]]),
            note="persistent handle, dset[i] per leaf",
        )
    )  # fmt: skip
    h5.close()
    naive = H5OpenPerItemSource(h5_default.path, ds.keys)
    res.add(
        _case(
            cfg, sec, h5_default, "hdf5", "hdf5", "h5py-open-per-item", "baseline",
            lambda i: stack_records([naive[int(j)] for j in pool[i]]),
            note="h5py.File per __getitem__", max_batches=4,
        )
    )  # fmt: skip

    # zarr baselines.
    for layout, store in layouts.items():
        if store.layout.fmt != "zarr" or not cfg.wants(f"{sec}/{ds_name}/{layout}/oindex"):
            continue
        PAGE_CACHE.keep_only([store.path])
        res.add(
            _case(
                cfg, sec, store, layout, "zarr", "oindex", "baseline",
                _zarr_oindex_step(store, pool), note="arr.oindex[np.unique(idx)]",
            )
        )  # fmt: skip

    # ArrayRecord through grain.
    ar = layouts["arrayrecord"]
    PAGE_CACHE.keep_only([ar.path])
    rec_dtype = record_dtype(ds.leaves)
    ar_src = grain.sources.ArrayRecordDataSource(array_record_files(ar.path))
    res.add(
        _case(
            cfg, sec, ar, "arrayrecord", "arrayrecord", "getitems+decode", "baseline",
            lambda i: decode_records(ar_src.__getitems__(list(pool[i])), rec_dtype),
            note="ArrayRecordDataSource.__getitems__ + np.frombuffer",
        )
    )  # fmt: skip

    # grain.DataLoader + Batch over the per-record sources.
    PAGE_CACHE.keep_only([ar.path, h5_default.path])
    for wc in cfg.loader_workers:
        for label, store, source, ops, note, max_b in (
            ("grain-arrayrecord", ar, ar_src, [DecodeRecord(rec_dtype)], "", None),
            (
                "grain-h5py-per-record", h5_default, H5PerRecordSource(h5_default.path, ds.keys),
                [], "", None,
            ),
            (
                "grain-h5py-open-per-item", h5_default, naive, [], "", 4,
            ),
        ):  # fmt: skip
            if wc and cfg.quick and (label != "grain-arrayrecord" or ds_name != "transitions"):
                continue  # --quick: one spawned pipeline (worker start-up takes seconds)
            res.add(
                grain_loader_case(
                    cfg, sec, store, label, source, ops, wc,
                    fmt=store.layout.fmt, note=note, max_batches=max_b,
                )
            )  # fmt: skip


def _formats_ratios(
    res: SectionResult, ds_name: str, layouts: dict[str, Store], limit: Case
) -> None:
    sec = "formats"
    p = f"{sec}/{ds_name}"
    every = [c for c in res.cases if c.kind == "source" and c.dataset == ds_name]
    sources = [c for c in every if c.method == "read_batch"]
    for c in every:
        target = LIMIT_TARGETS.get(c.layout, {}).get(ds_name) if c in sources else None
        res.ratio(f"{p}: {c.layout} {c.method} / numpy gather", c, limit, target, "vs limit")
    take = res.get(f"{p}/memory/numpy-take")
    for c in sources:
        res.ratio(f"{p}: {c.layout} read_batch / np.take", c, take, None, "vs np.take")
    for layout, store in layouts.items():
        if not store.layout.chunked or store.layout.fmt not in ("hdf5", "zarr"):
            continue
        foreign = store.layout.written_by != "gr.write"
        if store.layout.fmt == "hdf5":
            base, label, target = "h5py-sorted", "h5py sorted read", H5PY_SORTED_TARGET
        else:
            base, label, target = "oindex", "zarr oindex", ZARR_OINDEX_TARGET
        for method, cache in (
            ("read_batch", "default cache, filling from empty"),
            ("read_batch-cold", "cold cache, every batch"),
            ("read_batch-cache-all", "cache holding every chunk, steady state"),
        ):
            res.ratio(
                f"{p}: {layout} {method} / {label} ({cache})",
                f"{p}/{layout}/{method}",
                f"{p}/{layout}/{base}",
                target if foreign else None,
                "vs library batched read",
            )
    pipelines = [
        c for c in res.cases if c.dataset == ds_name and c.method.startswith("grain-arrayrecord")
    ]
    if pipelines:
        best = max(pipelines, key=lambda c: c.records_per_s)
        for c in sources:
            res.ratio(
                f"{p}: {c.layout} read_batch / best grain+ArrayRecord ({best.method})",
                c,
                best,
                ARRAY_RECORD_TARGET,
                "vs grain+ArrayRecord",
            )
    direct = res.get(f"{p}/arrayrecord/getitems+decode")
    for c in sources:
        res.ratio(
            f"{p}: {c.layout} read_batch / ArrayRecord __getitems__",
            c,
            direct,
            None,
            "vs ArrayRecord batched read",
        )
