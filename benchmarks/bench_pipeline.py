"""Section ``pipeline``: read_batch -> make_data_loader -> sharded_device_put, and baselines."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from baselines import H5OpenPerItemSource, H5PerRecordSource
from bench_common import PAGE_CACHE, Case, Config, SectionResult, index_batches, time_steps
from bench_data import Store
from bench_formats import grain_loader_case, open_source

import grain_replay as gr

__all__ = ["run_pipeline"]

LOADER_TARGET = 0.8
FULL_TARGET = 0.8
OPEN_PER_ITEM_TARGET = 100.0
PER_RECORD_TARGET = 30.0
HOST_BATCHES = 16
PAIRED_HOST_BATCHES = 256  # 34 MB of transitions at batch 256
_SLICES = 8  # slices of a repeat timed in turns (_paired)
_DRAIN = 3  # untimed steps before a slice: more than sharded_device_put's prefetch of 2


def _case(
    cfg: Config, store: Store, fmt: str, method: str, step: Callable[[int], Any], **kw: Any
) -> Case | None:
    name = f"pipeline/{store.dataset.name}/{fmt}/{method}"
    note = kw.pop("note", "")
    if not cfg.wants(name):
        return None
    batches, times = time_steps(step, cfg, **kw)
    return Case(
        name, "pipeline", store.dataset.name, fmt, store.layout.name, method, "pipeline",
        cfg.batch_size, store.dataset.record_bytes, batches, times, note,
    )  # fmt: skip


def _paired(
    cfg: Config,
    store: Store,
    fmt: str,
    steps: dict[str, Callable[[int], Any]],
    *,
    epochs: dict[str, int] | None = None,
    **kw: Any,
) -> dict[str, Case]:
    """Times ``steps`` in turns, in slices of a repeat, so that all see the same machine load.

    Ratios of cases timed seconds apart on a busy 2-core machine measure the load
    as much as the code. Each case is warmed up and sized on its own (see
    :func:`time_steps`); then every repeat is cut in ``_SLICES`` slices, and each
    slice times the cases one after the other. Before a slice of a case,
    ``_DRAIN`` untimed steps empty what its prefetch threads buffered while the
    other cases ran, so that a slice sees the case's steady state.

    ``epochs`` names cases without prefetch whose repeat is one whole epoch of
    that many steps (no drain steps): every repeat then pays the epoch's
    once-per-epoch work (the loader's shuffled order) exactly once, as a
    training run does, instead of a median of repeats leaving it out.
    """
    epochs = epochs or {}
    names = {m: f"pipeline/{store.dataset.name}/{fmt}/{m}" for m in steps}
    steps = {m: f for m, f in steps.items() if cfg.wants(names[m])}
    one = dataclasses.replace(cfg, repeats=1, case_budget_s=None)
    slices: dict[str, list[int]] = {}
    for m, step in steps.items():
        k, _ = time_steps(step, one, **kw)
        if m in epochs:
            slices[m] = [len(a) for a in np.array_split(np.arange(epochs[m]), _SLICES)]
        else:
            slices[m] = [max(1, k // _SLICES)] * _SLICES
    times: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(cfg.repeats):
        total = dict.fromkeys(steps, 0.0)
        for j in range(_SLICES):
            for m, step in steps.items():
                for _ in range(0 if m in epochs else _DRAIN):
                    step(0)
                t0 = time.perf_counter()
                for _ in range(slices[m][j]):
                    step(0)
                total[m] += time.perf_counter() - t0
        for m in steps:
            times[m].append(total[m])
    out = {}
    for m in steps:
        note = "timed in turns with its format's other cases"
        if m in epochs:
            note += f"; a repeat is one epoch ({epochs[m]} batches)"
        out[m] = Case(
            names[m], "pipeline", store.dataset.name, fmt, store.layout.name, m, "pipeline",
            cfg.batch_size, store.dataset.record_bytes, sum(slices[m]), times[m], note,
        )  # fmt: skip
    return out


_WORKER_METHODS = ("make_data_loader-2-workers", "grain-worker-iterator-2-workers")


def _workers_vs_grain(
    cfg: Config, store: Store, fmt: str, src: Any, steady: dict[str, Any]
) -> list[Case]:
    """make_data_loader(worker_count=2): our worker iterator against grain's, same loader."""
    import grain

    loader = gr.make_data_loader(src, batch_size=cfg.batch_size, worker_count=2, num_epochs=None)
    out = []
    for method, make in zip(_WORKER_METHODS, (iter, grain.DataLoader.__iter__), strict=True):
        it = make(loader)
        case = _case(cfg, store, fmt, method, _iterate(it), **steady)
        if case is not None:
            out.append(case)
        close = getattr(it, "close", None)
        if close is not None:
            close()
        del it
        gc.collect()
    return out


def _copied(tree: Any) -> Any:
    """Every leaf copied into fresh memory: what the consumer of a worker loader did to each
    batch before batches viewed the workers' shared memory (the ``-copied`` cases)."""
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    return np.array(tree, copy=True)


def _image_workers(
    cfg: Config, stores: dict[str, dict[str, Store]], res: SectionResult, log: Callable[[str], None]
) -> None:
    """Large batches (images: 7 MB at batch 256) through 2 workers, each case in turn: batches
    that view the workers' shared memory, the same copied out (the loader before), 0 workers,
    and sharded_device_put over the 2 workers."""
    import jax

    store = stores.get("images", {}).get("npy")
    if store is None:
        return
    b = cfg.batch_size
    PAGE_CACHE.keep_only([store.path])
    with open_source(store) as src:

        def loader(workers: int) -> Any:
            return gr.make_data_loader(src, batch_size=b, worker_count=workers, num_epochs=None)

        its: dict[str, Any] = {
            "make_data_loader-0-workers": iter(loader(0)),
            "make_data_loader-2-workers": iter(loader(2)),
            "make_data_loader-2-workers-copied": iter(loader(2)),
            "full-2-workers": gr.sharded_device_put(loader(2)),
        }
        timed = {
            "make_data_loader-0-workers": _iterate(its["make_data_loader-0-workers"]),
            "make_data_loader-2-workers": _iterate(its["make_data_loader-2-workers"]),
            "make_data_loader-2-workers-copied": _iterate(
                its["make_data_loader-2-workers-copied"], _copied
            ),
            "full-2-workers": _iterate(its["full-2-workers"], jax.block_until_ready),
        }
        try:
            # One after the other, not in turns: slices of a few batches would be served
            # from the workers' read-ahead (4 batches). Each case drains it while warming up.
            cases = {}
            for m, step in timed.items():
                case = _case(
                    cfg, store, "npy", m, step, warmup=8, warmup_s=cfg.target_s, min_batches=16
                )
                if case is not None:
                    cases[m] = case
        finally:
            for it in its.values():
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            its.clear()
            timed.clear()
            gc.collect()
    for c in cases.values():
        res.add(c)
    p = f"pipeline/{store.dataset.name}: npy"
    views, copied = (
        cases.get(m) for m in ("make_data_loader-2-workers", "make_data_loader-2-workers-copied")
    )
    if views is not None and copied is not None:
        log(
            f"  {store.dataset.name}, 2 workers: {views.records_per_s:,.0f} rec/s viewing shared "
            f"memory, {copied.records_per_s:,.0f} copied out"
        )
    res.ratio(
        f"{p} 2 workers, batches viewing shared memory / copied out", views, copied, None, "loader"
    )
    res.ratio(
        f"{p} 2 workers / 0 workers", views, cases.get("make_data_loader-0-workers"), None, "loader"
    )
    res.ratio(
        f"{p} full with 2 workers / loader with 2 workers",
        cases.get("full-2-workers"), views, None, "full",
    )  # fmt: skip


def _iterate(it: Iterator[Any], block: Callable[[Any], Any] | None = None) -> Callable[[int], Any]:
    if block is None:
        return lambda i: next(it)
    return lambda i: block(next(it))


def _epoch_order_cost(
    res: SectionResult, log: Callable[[str], None], n: int, per_epoch: int
) -> None:
    """The loader's once-per-epoch work, alone: the shuffled order of ``n`` records."""
    from grain_replay.pipeline.shuffle import epoch_order

    times = []
    for epoch in range(3):
        t0 = time.perf_counter()
        epoch_order(n, 0, epoch)
        times.append(time.perf_counter() - t0)
    s = sorted(times)[1]
    res.extra["epoch_order"] = {"records": n, "ms": s * 1e3, "us_per_batch": s / per_epoch * 1e6}
    log(f"  epoch order of {n:,} records: {s * 1e3:.2f} ms = {s / per_epoch * 1e6:.2f} us a batch")


def run_pipeline(
    cfg: Config,
    stores: dict[str, dict[str, Store]],
    res: SectionResult,
    log: Callable[[str], None],
) -> None:
    import jax

    layouts = stores["transitions"]
    ds = layouts["npy"].dataset
    b = cfg.batch_size
    pool = index_batches(ds.n, cfg)
    platform = jax.devices()[0].platform
    on_gpu = platform in ("gpu", "cuda", "rocm")
    res.extra["jax"] = {
        "platform": platform,
        "device_count": jax.device_count(),
        "devices": [str(d) for d in jax.devices()[:8]],
    }
    log(f"  jax platform={platform} devices={jax.device_count()}")
    block = jax.block_until_ready
    # Iterators with prefetch buffers: time them only once the buffers are drained.
    steady: dict[str, Any] = {"warmup": 6, "warmup_s": cfg.target_s}

    # sharded_device_put alone, over pre-read host batches, and a bare jax.device_put.
    npy = layouts["npy"]
    PAGE_CACHE.keep_only([npy.path])
    with open_source(npy) as src:
        host = [src.read_batch(pool[j]) for j in range(HOST_BATCHES)]
    dp_it = gr.sharded_device_put(itertools.cycle(host))
    dp_only = res.add(
        _case(cfg, npy, "host", "sharded_device_put-only", _iterate(dp_it, block), **steady)
    )
    dp_it.close()
    bare = res.add(
        _case(
            cfg, npy, "host", "bare-jax.device_put",
            lambda i: block(jax.device_put(host[i % HOST_BATCHES])),
            **steady,
            note="one device" + ("" if on_gpu else " (CPU: no host-to-device link)"),
        )
    )  # fmt: skip
    host.clear()
    if dp_only is not None and bare is not None:
        res.extra["device_put_gb_per_s"] = {
            "sharded_device_put": dp_only.mb_per_s / 1e3,
            "bare_jax_device_put": bare.mb_per_s / 1e3,
            "host_to_device": on_gpu,
        }
        if on_gpu:
            res.ratio(
                "pipeline: sharded_device_put H2D GB/s / bare jax.device_put",
                dp_only, bare, None, "host-to-device",
            )  # fmt: skip
        else:
            res.notes.append(
                f"device_put rates are CPU copies (platform={platform}), not host-to-device "
                "transfers: no GB/s comparison is reported."
            )

    # Per format, the four cases of its two ratios are timed in turns (see _paired):
    # read_batch, the loader, sharded_device_put over pre-read batches, and both stages.
    for fmt in ("npy", "hdf5", "zarr"):
        store = layouts[fmt]
        PAGE_CACHE.keep_only([store.path])
        with open_source(store) as src:
            # The batches the full pipeline starts with, too many to stay in CPU caches.
            first = gr.make_data_loader(src, batch_size=b, worker_count=0, num_epochs=None)
            host_batches = list(itertools.islice(first, PAIRED_HOST_BATCHES))
            reads = itertools.count()
            loader = gr.make_data_loader(src, batch_size=b, num_epochs=None)
            loader_it = iter(loader)
            # The loader's own batches (its first epoch), read with read_batch: the
            # loader's cost over the same reads, cache effects of its order included.
            plan = loader.plan.reads
            per_epoch = plan.batches_per_epoch
            own_ids = [plan.record_ids(g) for g in range(per_epoch)]
            own = itertools.count()
            dp_it = gr.sharded_device_put(itertools.cycle(host_batches))
            full_it = gr.sharded_device_put(
                gr.make_data_loader(src, batch_size=b, worker_count=0, num_epochs=None)
            )
            timed = {
                "read_batch": lambda i, src=src, reads=reads: src.read_batch(
                    pool[next(reads) % len(pool)]
                ),
                "read_batch-loader-ids": lambda i, src=src, own=own, ids=own_ids: src.read_batch(
                    ids[next(own) % len(ids)]
                ),
                "make_data_loader": _iterate(loader_it),
                "sharded_device_put-only": _iterate(dp_it, block),
                "full": _iterate(full_it, block),
            }
            # --quick: the cases with worker processes for one format only (each start
            # of workers takes seconds), as the formats section does.
            with_workers = not cfg.quick or fmt == "npy"
            full_w_it = None
            if with_workers:  # the same with the reads in a worker process, off the GIL
                full_w_it = gr.sharded_device_put(
                    gr.make_data_loader(src, batch_size=b, worker_count=1, num_epochs=None)
                )
                timed["full-1-worker"] = _iterate(full_w_it, block)
            # A repeat of the loader is one whole epoch: its once-per-epoch order is paid.
            cases = _paired(
                cfg, store, fmt, timed, epochs={"make_data_loader": per_epoch}, **steady
            )
            if fmt == "npy":
                _epoch_order_cost(res, log, plan.num_records, per_epoch)
            for it in (dp_it, full_it, full_w_it):
                if it is not None:
                    it.close()
            del loader, loader_it, dp_it, full_it, full_w_it, host_batches, timed, own_ids
            gc.collect()
            workers = _workers_vs_grain(cfg, store, fmt, src, steady) if with_workers else []
        for c in [*cases.values(), *workers]:
            res.add(c)
        rb, loader = cases.get("read_batch"), cases.get("make_data_loader")
        dp, full = cases.get("sharded_device_put-only"), cases.get("full")
        if rb is not None and loader is not None:
            log(
                f"  {fmt}: read_batch {rb.records_per_s:,.0f} rec/s, loader "
                f"{loader.records_per_s:,.0f}"
                + (f", full {full.records_per_s:,.0f}" if full else "")
            )
        p = f"pipeline/{ds.name}: {fmt}"
        res.ratio(f"{p} make_data_loader / read_batch", loader, rb, LOADER_TARGET, "loader")
        # Reported without a target: the loader's own cost, over the same rows in the same order.
        res.ratio(
            f"{p} make_data_loader / read_batch of the loader's batches",
            loader, cases.get("read_batch-loader-ids"), None, "loader",
        )  # fmt: skip
        if full is not None and loader is not None and dp is not None:
            slower = min(loader, dp, key=lambda c: c.records_per_s)
            res.ratio(
                f"{p} full / min(loader, device_put-only) ({slower.method})",
                full, slower, FULL_TARGET, "full",
            )  # fmt: skip
            # Reported without a target: with 2 cores, the worker takes CPU from
            # the consuming process's two threads; with more cores it overlaps.
            full_w = cases.get("full-1-worker")
            res.ratio(
                f"{p} full with 1 worker / min(loader, device_put-only) ({slower.method})",
                full_w, slower, None, "full",
            )  # fmt: skip
        ours, grains = (res.get(f"pipeline/{ds.name}/{fmt}/{m}") for m in _WORKER_METHODS)
        res.ratio(
            f"{p} workers=2: grain_replay / grain's worker iterator", ours, grains, None, "loader"
        )
        res.extra.setdefault("full_cases", []).append(f"pipeline/{ds.name}/{fmt}/full")

    _image_workers(cfg, stores, res, log)

    # Baselines on the same HDF5 file, in-process (worker_count=0).
    h5 = layouts["hdf5"]
    PAGE_CACHE.keep_only([h5.path])
    naive = res.add(
        grain_loader_case(
            cfg, "pipeline", h5, "grain-h5py-open-per-item",
            H5OpenPerItemSource(h5.path, ds.keys), [], 0, fmt="hdf5", max_batches=4,
        )
    )  # fmt: skip
    per_record = res.add(
        grain_loader_case(
            cfg, "pipeline", h5, "grain-h5py-per-record",
            H5PerRecordSource(h5.path, ds.keys), [], 0, fmt="hdf5",
        )
    )  # fmt: skip
    for fmt in ("npy", "hdf5", "zarr"):
        full = res.get(f"pipeline/{ds.name}/{fmt}/full")
        p = f"pipeline/{ds.name}: {fmt}"
        res.ratio(
            f"{p} full / grain+h5py open-per-item", full, naive, OPEN_PER_ITEM_TARGET, "vs naive"
        )
        res.ratio(
            f"{p} full / grain+h5py per-record", full, per_record, PER_RECORD_TARGET, "vs naive"
        )
