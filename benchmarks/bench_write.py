"""Section ``write``: gr.write throughput per format/layout against np.save of the same arrays."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
from bench_common import Case, Config, SectionResult, time_steps
from bench_data import Store, fsync_path, load_arrays, write_zarr_direct

import grain_replay as gr

__all__ = ["run_write"]


def _rows(cfg: Config, ds_name: str, n: int) -> int:
    """Rows written per repeat: ~16 MB of records (~1 MB with --quick)."""
    want = {"transitions": 32_768, "images": 512}[ds_name]
    if cfg.quick:
        want //= 16
    return min(n, want)


def _np_save(path: str, arrays: dict[str, np.ndarray], fsync: bool) -> None:
    os.makedirs(path)
    for key, arr in arrays.items():
        with open(os.path.join(path, key + ".npy"), "wb") as f:
            np.save(f, arr, allow_pickle=False)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def run_write(
    cfg: Config,
    stores: dict[str, dict[str, Store]],
    res: SectionResult,
    log: Callable[[str], None],
) -> None:
    for ds_name, layouts in stores.items():
        _write_dataset(cfg, ds_name, layouts, res)


def _write_dataset(
    cfg: Config, ds_name: str, layouts: dict[str, Store], res: SectionResult
) -> None:
    sec = "write"
    tmp = os.path.join(cfg.data_dir, "_write_tmp")
    ds = layouts["npy"].dataset
    rows = _rows(cfg, ds_name, ds.n)
    full = load_arrays(layouts["npy"])
    arrays = {k: np.ascontiguousarray(a[:rows]) for k, a in full.items()}
    del full
    chunk_rows = max(1, (64 << 10) // max(1, max(a[0].nbytes for a in arrays.values())))
    writers: list[tuple[str, str, str, Callable[[str], Any]]] = [
        ("npy", "npy", "gr.write", lambda p: gr.write(p, arrays, format="npy")),
        ("hdf5", "hdf5", "gr.write", lambda p: gr.write(p, arrays, format="hdf5")),
        ("zarr", "zarr", "gr.write", lambda p: gr.write(p, arrays, format="zarr")),
        (
            "hdf5-gzip", "hdf5", "gr.write",
            lambda p: gr.write(p, arrays, format="hdf5", compression="gzip"),
        ),
        (
            "hdf5-lzf", "hdf5", "gr.write",
            lambda p: gr.write(p, arrays, format="hdf5", compression="lzf"),
        ),
        (
            "hdf5-chunked", "hdf5", "gr.write",
            lambda p: gr.write(p, arrays, format="hdf5", chunk_rows=chunk_rows),
        ),
        (
            "zarr-zstd", "zarr", "gr.write",
            lambda p: gr.write(p, arrays, format="zarr", compression="zstd"),
        ),
        ("np.save", "npy", "baseline", lambda p: _np_save(p, arrays, fsync=False)),
        ("np.save+fsync", "npy", "baseline", lambda p: _np_save(p, arrays, fsync=True)),
        (
            "zarr-native", "zarr", "baseline",
            lambda p: (write_zarr_direct(p, arrays, native=True), fsync_path(p)),
        ),
    ]  # fmt: skip
    for layout, fmt, kind, write in writers:
        name = f"{sec}/{ds_name}/{layout}/write"
        if not cfg.wants(name) and kind != "baseline":
            continue
        target = os.path.join(tmp, f"{ds_name}-{layout}")

        def clear(target: str = target) -> None:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)

        batches, times = time_steps(
            lambda i, write=write, target=target: write(f"{target}-{i}"),
            cfg,
            max_batches=1,
            before_repeat=clear,
        )
        note = {
            "gr.write": "atomic, fsynced",
            "baseline": "fsynced" if layout != "np.save" else "page cache only (no fsync)",
        }[kind]
        if layout == "hdf5-chunked":
            note += f", chunk_rows={chunk_rows}"
        res.add(
            Case(
                name, sec, ds_name, fmt, layout, "write",
                "source" if kind == "gr.write" else "baseline",
                rows, ds.record_bytes, batches, times, note,
            )
        )  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)
    p = f"{sec}/{ds_name}"
    for c in [c for c in res.cases if c.dataset == ds_name and c.kind == "source"]:
        res.ratio(
            f"{p}: gr.write {c.layout} / np.save", c, f"{p}/np.save/write", None, "vs np.save"
        )
        res.ratio(
            f"{p}: gr.write {c.layout} / np.save+fsync",
            c, f"{p}/np.save+fsync/write", None, "vs np.save+fsync",
        )  # fmt: skip
