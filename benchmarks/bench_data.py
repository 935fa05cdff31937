"""The benchmark datasets: generation, one store per format/layout, reuse across runs."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from baselines import record_dtype

import grain_replay as gr

__all__ = [
    "LAYOUTS",
    "Dataset",
    "Layout",
    "Store",
    "dataset_specs",
    "ensure_stores",
    "fsync_path",
    "load_arrays",
    "make_arrays",
    "raw_leaf_offsets",
    "store_bytes",
]

# Chunk size of the row-chunked foreign layouts: the same ~64 KiB per chunk that
# gr.write picks for compressed stores, a sensible choice for random access.
FOREIGN_CHUNK_BYTES = 64 << 10
GENERATOR_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A synthetic replay: leaves ``(key, dtype, per-record shape)`` and N."""

    name: str
    n: int
    leaves: tuple[tuple[str, str, tuple[int, ...]], ...]
    seed: int = 0

    @property
    def record_bytes(self) -> int:
        return sum(
            np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for _, d, s in self.leaves
        )

    @property
    def keys(self) -> list[str]:
        return [k for k, _, _ in self.leaves]

    @property
    def dir_name(self) -> str:
        return f"{self.name}-{self.n}"

    def params(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n": self.n,
            "leaves": [[k, d, list(s)] for k, d, s in self.leaves],
            "seed": self.seed,
            "generator": GENERATOR_VERSION,
        }


def dataset_specs(transitions: int, image_records: int, seed: int = 0) -> list[Dataset]:
    return [
        Dataset(
            "transitions",
            transitions,
            (
                ("obs", "float32", (64,)),
                ("action", "int64", ()),
                ("reward", "float32", ()),
                ("next_obs", "float32", (64,)),
                ("done", "bool", ()),
            ),
            seed,
        ),
        Dataset("images", image_records, (("obs", "uint8", (84, 84, 4)),), seed + 1),
    ]


def make_arrays(ds: Dataset) -> dict[str, np.ndarray]:
    """Deterministic synthetic data for ``ds``."""
    rng = np.random.default_rng(ds.seed)
    n = ds.n
    if ds.name == "transitions":
        states = rng.standard_normal((n + 1, 64), dtype=np.float32)
        return {
            "obs": states[:-1].copy(),
            "action": rng.integers(0, 18, n, dtype=np.int64),
            "reward": (rng.random(n, dtype=np.float32) < 0.05).astype(np.float32),
            "next_obs": states[1:].copy(),
            "done": rng.random(n) < 0.001,
        }
    if ds.name == "images":
        # Atari-like frame stacks: blocky backgrounds (compressible, as real frames
        # are) from a bank of frames, plus a random 6x6 "sprite" per record.
        bank = rng.integers(0, 256, (64, 12, 12), dtype=np.uint8).repeat(7, 1).repeat(7, 2)
        # stacks[s] is the frame stack (bank[s], bank[s+1], ...) as (84, 84, 4).
        stacks = np.stack([np.roll(bank, -t, axis=0) for t in range(4)], axis=-1)
        out = np.empty((n, 84, 84, 4), dtype=np.uint8)
        d = np.arange(6)
        for lo in range(0, n, 4096):
            hi = min(n, lo + 4096)
            block = out[lo:hi]
            np.take(stacks, (np.arange(lo, hi) * 5) % len(stacks), axis=0, out=block)
            ys = rng.integers(0, 78, hi - lo)
            xs = rng.integers(0, 78, hi - lo)
            patch = rng.integers(0, 256, (hi - lo, 6, 6, 4), dtype=np.uint8)
            b = np.arange(hi - lo)[:, None, None]
            block[b, ys[:, None, None] + d[None, :, None], xs[:, None, None] + d[None, None, :]] = (
                patch
            )
        return {"obs": out}
    raise ValueError(f"unknown dataset {ds.name!r}")


def fsync_path(path: str) -> None:
    """fsyncs every file of a store so that the page cache can later be dropped."""
    from bench_common import files_under

    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def store_bytes(path: str) -> int:
    from bench_common import files_under

    return sum(os.path.getsize(f) for f in files_under(path))


def _foreign_rows(arr: np.ndarray) -> int:
    row = max(1, arr.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64)))
    return max(1, min(len(arr), FOREIGN_CHUNK_BYTES // row))


def write_h5py(path: str, arrays: dict[str, np.ndarray], compression: str | None) -> None:
    """An HDF5 file as other tools write it: h5py directly, ~64 KiB row chunks, no metadata."""
    import h5py

    with h5py.File(path, "w") as f:
        for key, arr in arrays.items():
            f.create_dataset(
                key,
                data=arr,
                chunks=(_foreign_rows(arr), *arr.shape[1:]),
                compression=compression,
            )


def write_zarr_direct(path: str, arrays: dict[str, np.ndarray], native: bool) -> None:
    """A Zarr v3 group written by zarr itself: its default chunks/codecs, or zstd row chunks."""
    import zarr
    from zarr.codecs import ZstdCodec

    group = zarr.open_group(path, mode="w", zarr_format=3)
    for key, arr in arrays.items():
        if native:
            z = group.create_array(key, shape=arr.shape, dtype=arr.dtype)
        else:
            z = group.create_array(
                key,
                shape=arr.shape,
                dtype=arr.dtype,
                chunks=(_foreign_rows(arr), *arr.shape[1:]),
                compressors=(ZstdCodec(),),
            )
        z[...] = arr


def write_array_record(path: str, arrays: dict[str, np.ndarray], ds: Dataset, shards: int) -> None:
    """``shards`` ArrayRecord files; a record is the concatenated raw bytes of its leaves."""
    from array_record.python.array_record_module import ArrayRecordWriter

    os.makedirs(path)
    dtype = record_dtype(ds.leaves)
    size = dtype.itemsize
    bounds = np.linspace(0, ds.n, shards + 1).astype(np.int64)
    for s in range(shards):
        lo, hi = int(bounds[s]), int(bounds[s + 1])
        table = np.empty(hi - lo, dtype=dtype)
        for key in ds.keys:
            table[key] = arrays[key][lo:hi]
        buf = table.tobytes()
        del table
        writer = ArrayRecordWriter(
            os.path.join(path, f"records-{s:05d}-of-{shards:05d}.array_record"),
            "group_size:1,uncompressed",
        )
        for j in range(hi - lo):
            writer.write(buf[j * size : (j + 1) * size])
        writer.close()


def array_record_files(path: str) -> list[str]:
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".array_record"))


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to lay a dataset out on disk."""

    name: str
    fmt: str  # npy | hdf5 | zarr | arrayrecord
    suffix: str
    written_by: str  # "gr.write" or the foreign library
    compressed: bool
    chunked: bool
    write: Callable[[str, dict[str, np.ndarray], Dataset, bool], None]


def _gr(fmt: str) -> Callable[[str, dict[str, np.ndarray], Dataset, bool], None]:
    def write(path: str, arrays: dict[str, np.ndarray], ds: Dataset, quick: bool) -> None:
        gr.write(path, arrays, format=fmt)

    return write


def _shards(ds: Dataset, quick: bool) -> int:
    return max(1, min(10 if quick else 100, ds.n // 100))


LAYOUTS: tuple[Layout, ...] = (
    Layout("npy", "npy", "", "gr.write", False, False, _gr("npy")),
    Layout("hdf5", "hdf5", ".h5", "gr.write", False, False, _gr("hdf5")),
    Layout("zarr", "zarr", ".zarr", "gr.write", False, True, _gr("zarr")),
    Layout(
        "hdf5-gzip", "hdf5", ".h5", "h5py", True, True, lambda p, a, d, q: write_h5py(p, a, "gzip")
    ),
    Layout(
        "hdf5-lzf", "hdf5", ".h5", "h5py", True, True, lambda p, a, d, q: write_h5py(p, a, "lzf")
    ),
    Layout(
        "hdf5-chunked",
        "hdf5",
        ".h5",
        "h5py",
        False,
        True,
        lambda p, a, d, q: write_h5py(p, a, None),
    ),
    Layout(
        "zarr-zstd",
        "zarr",
        ".zarr",
        "zarr",
        True,
        True,
        lambda p, a, d, q: write_zarr_direct(p, a, native=False),
    ),
    Layout(
        "zarr-native",
        "zarr",
        ".zarr",
        "zarr (defaults)",
        True,
        True,
        lambda p, a, d, q: write_zarr_direct(p, a, native=True),
    ),
    Layout(
        "arrayrecord",
        "arrayrecord",
        ".ar",
        "array_record",
        False,
        False,
        lambda p, a, d, q: write_array_record(p, a, d, _shards(d, q)),
    ),
)


@dataclasses.dataclass(frozen=True)
class Store:
    dataset: Dataset
    layout: Layout
    path: str
    nbytes: int

    @property
    def files(self) -> list[str]:
        from bench_common import files_under

        return files_under(self.path)


def _writer_fingerprint() -> str:
    """Hash of grain_replay's writer sources (and version)."""
    import hashlib

    pkg = os.path.dirname(os.path.abspath(gr.__file__))
    files = [os.path.join(pkg, "store", "layout.py")]
    writers = os.path.join(pkg, "writers")
    files += sorted(
        os.path.join(root, f)
        for root, _, names in os.walk(writers)
        for f in names
        if f.endswith(".py")
    )
    h = hashlib.sha1(gr.__version__.encode())
    for file in files:
        with open(file, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _manifest_path(data_dir: str) -> str:
    return os.path.join(data_dir, "manifest.json")


def _load_manifest(data_dir: str) -> dict[str, Any]:
    try:
        with open(_manifest_path(data_dir)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _save_manifest(data_dir: str, manifest: dict[str, Any]) -> None:
    tmp = _manifest_path(data_dir) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, _manifest_path(data_dir))


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def ensure_stores(
    datasets: list[Dataset],
    data_dir: str,
    quick: bool,
    log: Callable[[str], None],
    layouts: Sequence[str] | None = None,
) -> dict[str, dict[str, Store]]:
    """Every dataset in every layout (or those named) under ``data_dir``; reuses stores made
    with the same params.

    Returns:
      ``{dataset name: {layout name: Store}}``.
    """
    os.makedirs(data_dir, exist_ok=True)
    manifest = _load_manifest(data_dir)
    out: dict[str, dict[str, Store]] = {}
    wrote = False
    for ds in datasets:
        arrays: dict[str, np.ndarray] | None = None
        out[ds.name] = {}
        for layout in LAYOUTS:
            if layouts is not None and layout.name not in layouts:
                continue
            rel = os.path.join(ds.dir_name, layout.name + layout.suffix)
            path = os.path.join(data_dir, rel)
            params = {**ds.params(), "layout": layout.name, "quick": quick}
            if layout.written_by == "gr.write":
                # The package's default layouts change as it evolves: rewrite them then.
                params["writer"] = _writer_fingerprint()
            entry = manifest.get(rel)
            if entry is None or entry.get("params") != params or not os.path.exists(path):
                if arrays is None:
                    t0 = time.perf_counter()
                    arrays = make_arrays(ds)
                    log(f"  generated {ds.name} N={ds.n:,} in {time.perf_counter() - t0:.1f}s")
                _remove(path)
                partial = path + ".partial"
                _remove(partial)
                t0 = time.perf_counter()
                layout.write(partial, arrays, ds, quick)
                os.replace(partial, path)
                wrote = True
                dt = time.perf_counter() - t0
                entry = {"params": params, "write_s": dt, "bytes": store_bytes(path)}
                manifest[rel] = entry
                _save_manifest(data_dir, manifest)
                log(
                    f"  wrote {rel} ({entry['bytes'] / 1e6:,.0f} MB, {layout.written_by}) "
                    f"in {dt:.1f}s"
                )
            out[ds.name][layout.name] = Store(ds, layout, path, int(entry["bytes"]))
        del arrays
    if wrote:
        # One sync for everything (cheaper than fsyncing tens of thousands of chunk
        # files): page-cache drops in the cold section need clean pages.
        t0 = time.perf_counter()
        os.sync()
        log(f"  synced to disk in {time.perf_counter() - t0:.1f}s")
    return out


def load_arrays(store: Store) -> dict[str, np.ndarray]:
    """The dataset's leaves fully in RAM (anonymous memory), read from its ``.npy`` store."""
    return {
        k: np.load(os.path.join(store.path, k + ".npy"), allow_pickle=False)
        for k in store.dataset.keys
    }


def raw_leaf_offsets(store: Store) -> dict[str, tuple[str, int]]:
    """``{leaf: (file, byte offset of row 0)}`` for stores whose rows lie contiguously in a file.

    Works for ``.npy`` directories and contiguous (gr.write default) HDF5 files.
    """
    if store.layout.fmt == "npy":
        out = {}
        for k in store.dataset.keys:
            file = os.path.join(store.path, k + ".npy")
            out[k] = (file, int(np.load(file, mmap_mode="r").offset))
        return out
    if store.layout.name == "hdf5":
        import h5py

        with h5py.File(store.path, "r") as f:
            return {k: (store.path, int(f[k].id.get_offset())) for k in store.dataset.keys}
    raise ValueError(f"{store.path}: rows are not contiguous in a file")
