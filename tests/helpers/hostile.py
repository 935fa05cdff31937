"""Hostile and malformed replay stores, built on the fly, and a sandboxed probe that opens them.

``build_corpus(root)`` writes every case under ``root`` and returns ``{name: Case}``;
``CASE_NAMES`` lists the same names without touching the disk (for pytest
parametrization). ``run_corpus(cases)`` opens and reads each case in a separate
Python process under an address-space limit, one case after another, and
returns what happened to each: the answer (accepted, or the exception's type,
classes and message), the time it took, the peak RSS, and whether the process
crashed or hung (it is then killed and a fresh one takes the remaining cases).

Run ``python tests/helpers/hostile.py --table`` for a Markdown table of the
whole corpus and its answers.

Also importable by spawned grain workers (the loader tests' helpers live here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import queue
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# Records in every base store; small so the corpus builds in well under a second.
N = 256
OBS_SHAPE = (4,)
# Address-space limit of the probe process: a giant allocation fails instead of swapping.
PROBE_ADDRESS_SPACE = 2 * 2**30
# Per-case answer time that counts as a hang (the contract asks for under a second).
HANG_AFTER_S = 3.0
HUGE = 2**60
# Inflated size of the deflate bomb: more than the peak-RSS bound the tests allow.
BOMB_BYTES = 96 << 20
# Peak RSS growth a probe may show (the corpus stores are a few KiB).
RSS_BOUND_MB = 64

# Expectations: "refuse" (a GrainReplayError naming the file and leaf), "external"
# (refuse unless allow_external=True), "bounded" (accepted or a GrainReplayError,
# but small and fast either way), "accept" (an intact control store).
EXPECTATIONS = ("refuse", "external", "bounded", "accept")


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile input: what to open, how, and what the answer must name."""

    name: str
    store: str  # the path handed to the opener
    culprit: str  # the file at fault (for the report)
    leaf: str | None  # the leaf key the message must name, when there is one
    expect: str
    what: str  # one line: what was done to the store
    opener: str = "open_source"  # or HDF5DataSource / NpyDataSource / ZarrDataSource
    marker: str | None = None  # a file that appears if the store ever runs code (pickle, import)
    pythonpath: str | None = None  # prepended to sys.path while probing (planted modules)


# -- base data ------------------------------------------------------------------------


def base_tree(n: int = N) -> dict[str, np.ndarray]:
    """``obs`` (n, 4) float32 and ``act`` (n,) int64: row i holds i everywhere."""
    return {
        "obs": np.repeat(np.arange(n, dtype=np.float32)[:, None], OBS_SHAPE[0], axis=1),
        "act": np.arange(n, dtype=np.int64),
    }


def outside_obs(n: int = N) -> np.ndarray:
    """The values of ``obs`` in files outside the stores (negated, so a leak is visible)."""
    return -base_tree(n)["obs"] - 1


class MarkerPayload:
    """Unpickling this creates ``path``: proof that a pickle was loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def pickle_payload(marker: str) -> bytes:
    return pickle.dumps(MarkerPayload(marker), protocol=2)


# -- low-level file surgery ------------------------------------------------------------


def truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def deflate_bomb(nbytes: int) -> bytes:
    """A zlib stream of ~nbytes/1000 bytes that inflates to ``nbytes`` zeros (16 MiB steps)."""
    import zlib

    step = 16 << 20
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(step)) + c.flush(zlib.Z_FULL_FLUSH)  # self-contained, repeatable
    k = max(1, nbytes // step)
    adler = ((k * step) % 65521) << 16 | 1  # adler32 of k*step zero bytes
    return b"\x78\xda" + block * k + c.flush() + adler.to_bytes(4, "big")


def npy_bytes(shape: tuple[int, ...], descr: str = "<f4", body: bytes = b"") -> bytes:
    """A ``.npy`` v1.0 file whose header says ``shape``/``descr``, followed by ``body``."""
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode("latin1")
    return npy_raw_header(header) + body


def npy_raw_header(header: bytes) -> bytes:
    """Magic, v1.0 and ``header`` (any bytes) padded to 64 with spaces and a newline."""
    pad = -(10 + len(header) + 1) % 64
    full = header + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(full).to_bytes(2, "little") + full


def npy_data_offset(path: str) -> int:
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


def _copy(src: str, dst: str) -> None:
    import shutil

    if os.path.isdir(src):
        shutil.copytree(src, dst, symlinks=True)
    else:
        shutil.copyfile(src, dst)


# -- metadata lies (the same set for every format) -------------------------------------


def _deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def _meta_variants() -> dict[str, tuple[Callable[[dict[str, Any]], str | bytes], str | None, str]]:
    """name -> (mutate(metadata dict) -> JSON text or bytes, leaf, description)."""

    def edit(fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], str]:
        def mutate(meta: dict[str, Any]) -> str:
            fn(meta)
            return json.dumps(meta)

        return mutate

    def ghost(m: dict[str, Any]) -> None:
        m["leaves"]["ghost"] = {"dtype": "<f4", "shape": []}
        m["treedef"]["keys"].append("ghost")
        m["treedef"]["children"].append({"type": "leaf"})
        m["checksums"] = None

    def deep(m: dict[str, Any]) -> str:
        text = json.dumps(m)
        return text.replace('"treedef": {', '"deep": ' + _deep_json(20_000) + ', "treedef": {', 1)

    def infinite(m: dict[str, Any]) -> str:
        m["num_records"] = float("inf")
        return json.dumps(m)  # json writes Infinity, which json.loads reads back

    def set_(path: list[str], value: Any) -> Callable[[dict[str, Any]], None]:
        def fn(m: dict[str, Any]) -> None:
            node = m
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = value

        return fn

    return {
        "num_records_too_large": (
            edit(set_(["num_records"], N + 1)), "obs", f"num_records {N + 1} > arrays' {N}",
        ),
        "num_records_2p60": (edit(set_(["num_records"], HUGE)), "obs", "num_records 2**60"),
        "shape_2p60": (
            edit(set_(["leaves", "obs", "shape"], [HUGE])), "obs", "leaf obs shape [2**60]",
        ),
        "leaf_missing": (edit(ghost), "ghost", "lists leaf 'ghost' that has no array"),
        "bad_dtype_string": (
            edit(set_(["leaves", "obs", "dtype"], "not-a-dtype")), "obs", "dtype 'not-a-dtype'",
        ),
        "object_dtype": (edit(set_(["leaves", "obs", "dtype"], "|O")), "obs", "dtype '|O'"),
        "negative_dims": (edit(set_(["leaves", "obs", "shape"], [-4])), "obs", "shape [-4]"),
        "dtype_lie": (
            edit(set_(["leaves", "obs", "dtype"], "<f8")), "obs", "dtype <f8 for float32 data",
        ),
        "non_json": (lambda m: b"\x80\x04\x95garbage\xff\xfe{", None, "binary, not JSON"),
        "deep_nesting": (deep, None, "20000 nested JSON lists"),
        "infinity": (infinite, None, "num_records: Infinity"),
        "future_version": (edit(set_(["version"], 99)), None, "format version 99"),
        "treedef_unknown_type": (
            edit(lambda m: m["treedef"]["children"][0].__setitem__("type", "bogus")), None,
            "treedef node type 'bogus'",
        ),
    }  # fmt: skip


META_VARIANTS = tuple(_meta_variants())

# -- corpus --------------------------------------------------------------------------------

H5_TRUNCATIONS = 20
H5_GZIP_TRUNCATIONS = 5
NPY_HEADER_TRUNCATIONS = 7
NPY_DATA_TRUNCATIONS = 4
ZARR_CHUNK_TRUNCATIONS = 5
ZARR_ZSTD_TRUNCATIONS = 3
ZARR_JSON_TRUNCATIONS = 3

CASE_NAMES: tuple[str, ...] = (
    # intact controls
    "control_hdf5", "control_hdf5_gzip", "control_npy", "control_npy_single", "control_zarr",
    "control_zarr_zstd", "control_npy_symlink_inside", "control_zarr_symlink_inside",
    # HDF5
    *(f"hdf5_truncated_{i:02d}" for i in range(H5_TRUNCATIONS)),
    *(f"hdf5_gzip_truncated_{i:02d}" for i in range(H5_GZIP_TRUNCATIONS)),
    "hdf5_wrong_magic", "hdf5_wrong_magic_direct", "hdf5_signature_then_garbage",
    "hdf5_gzip_chunk_garbage", "hdf5_gzip_chunk_bomb", "hdf5_foreign_leaves_different_lengths",
    "hdf5_foreign_string_dtype", "hdf5_foreign_shape_2p60", "hdf5_fifo",
    *(f"hdf5_meta_{v}" for v in META_VARIANTS),
    "hdf5_meta_not_text",
    "hdf5_external_link", "hdf5_external_link_foreign", "hdf5_virtual_dataset",
    "hdf5_external_storage",
    # .npy
    *(f"npy_header_truncated_{i:02d}" for i in range(NPY_HEADER_TRUNCATIONS)),
    *(f"npy_data_truncated_{i:02d}" for i in range(NPY_DATA_TRUNCATIONS)),
    "npy_foreign_data_truncated", "npy_single_data_truncated", "npy_wrong_magic",
    "npy_single_wrong_magic", "npy_bad_version", "npy_object_array_foreign",
    "npy_object_array_single", "npy_raw_pickle_foreign", "npy_raw_pickle_single",
    "npy_header_shape_2p60_single", "npy_header_shape_2p60_meta",
    "npy_header_shape_2p60_foreign", "npy_header_negative_shape_single",
    "npy_header_deep_unary", "npy_foreign_leaves_different_lengths", "npy_leaf_is_directory",
    "npy_fifo_leaf",
    *(f"npy_meta_{v}" for v in META_VARIANTS),
    "npy_meta_pickle",
    "npy_symlink_leaf_outside", "npy_symlink_dir_outside", "npy_symlink_meta_outside",
    "npy_symlink_foreign_outside",
    # Zarr
    *(f"zarr_chunk_truncated_{i:02d}" for i in range(ZARR_CHUNK_TRUNCATIONS)),
    *(f"zarr_zstd_chunk_truncated_{i:02d}" for i in range(ZARR_ZSTD_TRUNCATIONS)),
    "zarr_zstd_chunk_garbage",
    *(f"zarr_root_json_truncated_{i:02d}" for i in range(ZARR_JSON_TRUNCATIONS)),
    *(f"zarr_array_json_truncated_{i:02d}" for i in range(ZARR_JSON_TRUNCATIONS)),
    "zarr_root_json_garbage", "zarr_array_json_garbage",
    "zarr_foreign_leaves_different_lengths", "zarr_foreign_string_dtype",
    "zarr_foreign_shape_2p60", "zarr_foreign_chunk_shape_2p60", "zarr_shape_lie_2p60",
    "zarr_dtype_lie", "zarr_chunks_lie_smaller", "zarr_chunks_lie_bigger", "zarr_fifo_chunk",
    "zarr_fifo_root_json",
    *(f"zarr_meta_{v}" for v in META_VARIANTS),
    "zarr_symlink_chunk_outside", "zarr_symlink_array_outside",
    # metadata naming a module to import (a NamedTuple's "module")
    "hdf5_meta_namedtuple_imports_module", "npy_meta_namedtuple_imports_module",
    "zarr_meta_namedtuple_imports_module",
)  # fmt: skip


def build_corpus(root: str) -> dict[str, Case]:
    """Writes every case of ``CASE_NAMES`` under ``root`` (an empty directory)."""
    import grain_replay as gr

    root = os.path.abspath(root)
    cases: dict[str, Case] = {}

    def add(case: Case) -> None:
        assert case.name not in cases, case.name
        assert case.expect in EXPECTATIONS, case.expect
        cases[case.name] = case

    def fresh(name: str) -> str:
        d = os.path.join(root, name)
        os.makedirs(d)
        return d

    # Pristine stores every case copies from, and what lies outside the stores.
    pristine = fresh("_pristine")
    tree = base_tree()
    pr = {
        "hdf5": os.path.join(pristine, "store.h5"),
        "hdf5_gzip": os.path.join(pristine, "gzip.h5"),
        "npy": os.path.join(pristine, "store"),
        "npy_single": os.path.join(pristine, "single.npy"),
        "zarr": os.path.join(pristine, "store.zarr"),
        "zarr_zstd": os.path.join(pristine, "zstd.zarr"),
    }
    gr.write(pr["hdf5"], tree)
    gr.write(pr["hdf5_gzip"], tree, compression="gzip")
    gr.write(pr["npy"], tree, format="npy")
    np.save(pr["npy_single"], tree["obs"])
    gr.write(pr["zarr"], tree)
    gr.write(pr["zarr_zstd"], tree, compression="zstd")
    outside = fresh("_outside")
    out = {
        "hdf5": os.path.join(outside, "outside.h5"),
        "bin": os.path.join(outside, "outside.bin"),
        "npy": os.path.join(outside, "npy"),
        "zarr": os.path.join(outside, "outside.zarr"),
    }
    import h5py

    # Another layout than the stores': the outside obs sits at another file offset.
    with h5py.File(out["hdf5"], "w") as f:
        f.create_dataset("pad", data=np.zeros(3000, np.uint8))
        f.create_dataset("obs", data=outside_obs())
        f.create_dataset("act", data=tree["act"])
    with open(out["bin"], "wb") as f:
        f.write(outside_obs().tobytes())
    gr.write(out["npy"], {"obs": outside_obs(), "act": tree["act"]}, format="npy")
    gr.write(out["zarr"], {"obs": outside_obs(), "act": tree["act"]})

    def copy(kind: str, name: str) -> str:
        dst = os.path.join(fresh(name), os.path.basename(pr[kind]))
        _copy(pr[kind], dst)
        return dst

    # -- controls ----------------------------------------------------------------------
    for kind in ("hdf5", "hdf5_gzip", "npy", "npy_single", "zarr", "zarr_zstd"):
        p = copy(kind, f"control_{kind}")
        add(Case(f"control_{kind}", p, p, None, "accept", "intact store"))
    p = copy("npy", "control_npy_symlink_inside")
    os.rename(os.path.join(p, "obs.npy"), os.path.join(p, "obs_real.npy"))
    os.symlink("obs_real.npy", os.path.join(p, "obs.npy"))
    add(Case("control_npy_symlink_inside", p, p, None, "accept", "obs.npy -> obs_real.npy"))
    p = copy("zarr", "control_zarr_symlink_inside")
    chunk = os.path.join(p, "obs", "c", "0", "0")
    os.rename(chunk, os.path.join(p, "obs", "chunk_real"))
    os.symlink(os.path.join("..", "..", "chunk_real"), chunk)
    add(Case("control_zarr_symlink_inside", p, p, None, "accept", "chunk -> sibling in store"))

    _build_hdf5(add, copy, out, pr)
    _build_npy(add, copy, fresh, out, root)
    _build_zarr(add, copy, out)
    _build_imports(add, copy, fresh, root)
    missing = set(CASE_NAMES) ^ set(cases)
    assert not missing, f"CASE_NAMES and build_corpus disagree on {sorted(missing)}"
    return {name: cases[name] for name in CASE_NAMES}


def _h5_regions(path: str) -> dict[str, tuple[int, int]]:
    import h5py

    with h5py.File(path, "r") as f:
        spans = {}
        for k in ("obs", "act"):
            d = f[k]
            if d.chunks:
                info = d.id.get_chunk_info(0)
                spans[k] = (int(info.byte_offset), int(info.byte_offset + info.size))
            else:
                off = int(d.id.get_offset())
                spans[k] = (off, off + int(d.id.get_storage_size()))
    spans["file"] = (0, os.path.getsize(path))
    return spans


def _h5_truncation_points(path: str, count: int) -> list[tuple[int, str]]:
    """``count`` offsets: inside the superblock, the metadata, each dataset's data, the tail."""
    r = _h5_regions(path)
    size = r["file"][1]
    first_data = min(r["obs"][0], r["act"][0])
    pts = [(o, "superblock") for o in (0, 1, 4, 8, 9, 16, 24, 40, 56, 95)]
    step = (first_data - 96) // 5
    pts += [(96 + step * i + 3, "metadata") for i in range(5)]
    for k in ("act", "obs"):
        lo, hi = r[k]
        pts += [(lo + 1, f"{k} data"), ((lo + hi) // 2, f"{k} data")]
    pts.append((size - 1, "tail (last byte)"))
    pts = sorted(set(pts))[:count]
    while len(pts) < count:  # small files: pad with offsets near the end
        pts.append((size - 1 - len(pts), "tail"))
    return pts


def _build_hdf5(add: Any, copy: Any, out: dict[str, str], pr: dict[str, str]) -> None:
    import h5py

    for i, (off, region) in enumerate(_h5_truncation_points(pr["hdf5"], H5_TRUNCATIONS)):
        name = f"hdf5_truncated_{i:02d}"
        p = copy("hdf5", name)
        truncate(p, off)
        add(Case(name, p, p, None, "refuse", f"truncated at byte {off} ({region})"))
    r = _h5_regions(pr["hdf5_gzip"])
    gz_points = [
        (40, "superblock"),
        (200, "metadata"),
        ((r["obs"][0] + r["obs"][1]) // 2, "obs chunk"),
        ((r["act"][0] + r["act"][1]) // 2, "act chunk"),
        (r["file"][1] - 1, "tail (last byte)"),
    ]
    for i, (off, region) in enumerate(gz_points):
        name = f"hdf5_gzip_truncated_{i:02d}"
        p = copy("hdf5_gzip", name)
        truncate(p, off)
        add(Case(name, p, p, None, "refuse", f"gzip store truncated at byte {off} ({region})"))

    p = copy("hdf5", "hdf5_wrong_magic")
    overwrite(p, 0, b"GARBAGE!")
    add(Case("hdf5_wrong_magic", p, p, None, "refuse", "first 8 bytes 'GARBAGE!'"))
    p = copy("hdf5", "hdf5_wrong_magic_direct")
    overwrite(p, 0, b"\x89HDF\r\n\x1a\x00")
    add(
        Case(
            "hdf5_wrong_magic_direct", p, p, None, "refuse",
            "signature's last byte zeroed; HDF5DataSource", "HDF5DataSource",
        )
    )  # fmt: skip
    p = copy("hdf5", "hdf5_signature_then_garbage")
    with open(p, "r+b") as f:
        f.seek(8)
        f.write(np.random.default_rng(0).bytes(os.path.getsize(p) - 8))
    add(Case("hdf5_signature_then_garbage", p, p, None, "refuse", "signature + random bytes"))
    p = copy("hdf5_gzip", "hdf5_gzip_chunk_garbage")
    lo, hi = _h5_regions(p)["obs"]
    overwrite(p, lo, np.random.default_rng(1).bytes(hi - lo))
    add(Case("hdf5_gzip_chunk_garbage", p, p, "obs", "refuse", "gzip chunk of obs = random"))
    p = copy("hdf5_gzip", "hdf5_gzip_chunk_bomb")
    with h5py.File(p, "r+") as f:
        f["obs"].id.write_direct_chunk((0, 0), deflate_bomb(BOMB_BYTES))
    add(Case("hdf5_gzip_chunk_bomb", p, p, "obs", "refuse",
             f"obs gzip chunk = {BOMB_BYTES >> 20} MiB of zeros deflated to ~100 KiB "
             "(the chunk holds 4 KiB)"))  # fmt: skip

    def foreign(name: str, what: str, leaf: str | None, expect: str = "refuse") -> Any:
        path = os.path.join(os.path.dirname(copy("hdf5", name)), "foreign.h5")

        @contextlib.contextmanager
        def cm() -> Iterator[Any]:
            with h5py.File(path, "w") as f:
                yield f
            add(Case(name, path, path, leaf, expect, what))

        return cm()

    with foreign("hdf5_foreign_leaves_different_lengths", "obs 256 rows, act 255", "act") as f:
        f["obs"] = base_tree()["obs"]
        f["act"] = base_tree(N - 1)["act"]
    with foreign("hdf5_foreign_string_dtype", "vlen str dataset", "names") as f:
        f.create_dataset("names", data=np.array(["a", "b"] * 4, dtype=object),
                         dtype=h5py.string_dtype())  # fmt: skip
    with foreign(
        "hdf5_foreign_shape_2p60",
        "chunked dataset of shape (2**60,), nothing written",
        None,
        "bounded",
    ) as f:
        f.create_dataset("big", shape=(HUGE,), dtype=np.float32, chunks=(1024,))
    fifo_dir = os.path.dirname(copy("hdf5", "hdf5_fifo"))
    fifo = os.path.join(fifo_dir, "fifo.h5")
    os.mkfifo(fifo)
    add(Case("hdf5_fifo", fifo, fifo, None, "refuse", "store.h5 is a FIFO", "HDF5DataSource"))

    for v, (mutate, leaf, what) in _meta_variants().items():
        name = f"hdf5_meta_{v}"
        p = copy("hdf5", name)
        set_metadata(p, mutate)
        add(Case(name, p, p, leaf, "refuse", f"metadata attribute: {what}"))
    p = copy("hdf5", "hdf5_meta_not_text")
    with h5py.File(p, "r+") as f:
        f.attrs["grain_replay"] = np.arange(6)
    add(Case("hdf5_meta_not_text", p, p, None, "refuse", "metadata attribute is an int array"))

    # References out of the store: refused unless allow_external=True.
    p = copy("hdf5", "hdf5_external_link")
    with h5py.File(p, "r+") as f:
        del f["obs"]
        f["obs"] = h5py.ExternalLink(out["hdf5"], "/obs")
    add(Case("hdf5_external_link", p, p, "obs", "external", f"obs = ExternalLink({out['hdf5']})"))
    with foreign(
        "hdf5_external_link_foreign", "foreign file, obs = ExternalLink", "obs", "external"
    ) as f:
        f["act"] = base_tree()["act"]
        f["obs"] = h5py.ExternalLink(out["hdf5"], "/obs")
    p = copy("hdf5", "hdf5_virtual_dataset")
    with h5py.File(p, "r+") as f:
        del f["obs"]
        layout = h5py.VirtualLayout(shape=(N, *OBS_SHAPE), dtype=np.float32)
        layout[:] = h5py.VirtualSource(out["hdf5"], "obs", shape=(N, *OBS_SHAPE))
        f.create_virtual_dataset("obs", layout)
    add(Case("hdf5_virtual_dataset", p, p, "obs", "external", "obs = VDS over outside.h5"))
    p = copy("hdf5", "hdf5_external_storage")
    with h5py.File(p, "r+") as f:
        del f["obs"]
        f.create_dataset(
            "obs", shape=(N, *OBS_SHAPE), dtype=np.float32,
            external=[(out["bin"], 0, N * OBS_SHAPE[0] * 4)],
        )  # fmt: skip
    add(Case("hdf5_external_storage", p, p, "obs", "external", "obs raw data in outside.bin"))


def _build_npy(add: Any, copy: Any, fresh: Any, out: dict[str, str], root: str) -> None:
    marker = os.path.join(root, "PICKLE_WAS_LOADED")
    leaf_file = lambda p: os.path.join(p, "obs.npy")
    data_off = npy_data_offset(leaf_file(copy("npy", "_npy_probe")))
    size = os.path.getsize(leaf_file(copy("npy", "_npy_probe2")))
    for i, off in enumerate([0, 3, 6, 8, 9, 40, data_off - 1]):
        name = f"npy_header_truncated_{i:02d}"
        p = copy("npy", name)
        truncate(leaf_file(p), off)
        add(Case(name, p, leaf_file(p), "obs", "refuse", f"obs.npy truncated at {off} (header)"))
    for i, off in enumerate([data_off, data_off + 1, (data_off + size) // 2, size - 1]):
        name = f"npy_data_truncated_{i:02d}"
        p = copy("npy", name)
        truncate(leaf_file(p), off)
        add(Case(name, p, leaf_file(p), "obs", "refuse", f"obs.npy truncated at {off} (data)"))
    p = copy("npy", "npy_foreign_data_truncated")
    os.remove(os.path.join(p, "grain_replay.json"))
    truncate(leaf_file(p), (data_off + size) // 2)
    add(Case("npy_foreign_data_truncated", p, leaf_file(p), "obs", "refuse",
             "foreign dir, obs.npy truncated mid-data"))  # fmt: skip
    p = copy("npy_single", "npy_single_data_truncated")
    truncate(p, os.path.getsize(p) // 2)
    add(Case("npy_single_data_truncated", p, p, None, "refuse", "single .npy truncated mid-data"))

    p = copy("npy", "npy_wrong_magic")
    overwrite(leaf_file(p), 0, b"GARBAGE!")
    add(Case("npy_wrong_magic", p, leaf_file(p), "obs", "refuse", "obs.npy magic 'GARBAGE!'"))
    p = copy("npy_single", "npy_single_wrong_magic")
    overwrite(p, 0, b"\x93NUMPX")
    add(Case("npy_single_wrong_magic", p, p, None, "refuse", "magic '\\x93NUMPX'", "NpyDataSource"))
    p = copy("npy", "npy_bad_version")
    overwrite(leaf_file(p), 6, b"\x09\x09")
    add(Case("npy_bad_version", p, leaf_file(p), "obs", "refuse", ".npy version 9.9"))

    def foreign_npy(name: str) -> str:
        p = copy("npy", name)
        os.remove(os.path.join(p, "grain_replay.json"))
        return p

    objects = np.array([MarkerPayload(marker)] * N, dtype=object)
    p = foreign_npy("npy_object_array_foreign")
    np.save(leaf_file(p), objects, allow_pickle=True)
    add(Case("npy_object_array_foreign", p, leaf_file(p), "obs", "refuse",
             "obs.npy: object array whose pickle creates a marker", marker=marker))  # fmt: skip
    p = os.path.join(fresh("npy_object_array_single"), "objects.npy")
    np.save(p, objects, allow_pickle=True)
    add(Case("npy_object_array_single", p, p, None, "refuse",
             "single object-array .npy with a pickle payload", marker=marker))  # fmt: skip
    p = foreign_npy("npy_raw_pickle_foreign")
    with open(leaf_file(p), "wb") as f:
        f.write(pickle_payload(marker))
    add(Case("npy_raw_pickle_foreign", p, leaf_file(p), "obs", "refuse",
             "obs.npy is a raw pickle payload", marker=marker))  # fmt: skip
    p = os.path.join(fresh("npy_raw_pickle_single"), "payload.npy")
    with open(p, "wb") as f:
        f.write(pickle_payload(marker))
    add(Case("npy_raw_pickle_single", p, p, None, "refuse", "single .npy = raw pickle payload",
             "NpyDataSource", marker=marker))  # fmt: skip

    body = np.zeros(64, np.float32).tobytes()
    p = os.path.join(fresh("npy_header_shape_2p60_single"), "huge.npy")
    with open(p, "wb") as f:
        f.write(npy_bytes((HUGE,), "<f4", body))
    add(Case("npy_header_shape_2p60_single", p, p, None, "refuse",
             "header shape (2**60,), 256 data bytes"))  # fmt: skip
    p = copy("npy", "npy_header_shape_2p60_meta")
    for k, descr, shape in (("obs", "<f4", (HUGE, 4)), ("act", "<i8", (HUGE,))):
        with open(os.path.join(p, f"{k}.npy"), "wb") as f:
            f.write(npy_bytes(shape, descr, body))
    with open(os.path.join(p, "grain_replay.json")) as f:
        meta = json.loads(f.read())
    meta["num_records"], meta["checksums"] = HUGE, None
    with open(os.path.join(p, "grain_replay.json"), "w") as f:
        json.dump(meta, f)
    add(Case("npy_header_shape_2p60_meta", p, leaf_file(p), "obs", "refuse",
             "headers and metadata agree on 2**60 rows; 256 data bytes"))  # fmt: skip
    p = foreign_npy("npy_header_shape_2p60_foreign")
    with open(leaf_file(p), "wb") as f:
        f.write(npy_bytes((HUGE, 4), "<f4", body))
    add(Case("npy_header_shape_2p60_foreign", p, leaf_file(p), "obs", "refuse",
             "foreign dir, obs.npy header (2**60, 4)"))  # fmt: skip
    p = os.path.join(fresh("npy_header_negative_shape_single"), "neg.npy")
    with open(p, "wb") as f:
        f.write(npy_bytes((-5, 4), "<f4", body))
    add(Case("npy_header_negative_shape_single", p, p, None, "refuse", "header shape (-5, 4)"))
    p = os.path.join(fresh("npy_header_deep_unary"), "deep.npy")
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (" + b"-" * 5000 + b"1,), }"
    with open(p, "wb") as f:
        f.write(npy_raw_header(header) + body)
    add(Case("npy_header_deep_unary", p, p, None, "refuse", "header shape (-----...1,), 5000 '-'"))
    p = foreign_npy("npy_foreign_leaves_different_lengths")
    np.save(os.path.join(p, "act.npy"), base_tree(N - 1)["act"])
    add(Case("npy_foreign_leaves_different_lengths", p, os.path.join(p, "act.npy"), "act",
             "refuse", "foreign dir, act has 255 rows"))  # fmt: skip
    p = copy("npy", "npy_leaf_is_directory")
    os.remove(leaf_file(p))
    os.mkdir(leaf_file(p))
    add(Case("npy_leaf_is_directory", p, leaf_file(p), "obs", "refuse", "obs.npy is a directory"))
    p = foreign_npy("npy_fifo_leaf")
    os.remove(leaf_file(p))
    os.mkfifo(leaf_file(p))
    add(Case("npy_fifo_leaf", p, leaf_file(p), "obs", "refuse", "foreign dir, obs.npy is a FIFO"))

    for v, (mutate, leaf, what) in _meta_variants().items():
        name = f"npy_meta_{v}"
        p = copy("npy", name)
        set_metadata(p, mutate)
        meta_file = os.path.join(p, "grain_replay.json")
        add(Case(name, p, meta_file, leaf, "refuse", f"grain_replay.json: {what}"))
    p = copy("npy", "npy_meta_pickle")
    with open(os.path.join(p, "grain_replay.json"), "wb") as f:
        f.write(pickle_payload(marker))
    add(Case("npy_meta_pickle", p, os.path.join(p, "grain_replay.json"), None, "refuse",
             "grain_replay.json is a pickle payload", marker=marker))  # fmt: skip

    p = copy("npy", "npy_symlink_leaf_outside")
    os.remove(leaf_file(p))
    os.symlink(os.path.join(out["npy"], "obs.npy"), leaf_file(p))
    add(Case("npy_symlink_leaf_outside", p, leaf_file(p), "obs", "external",
             "obs.npy -> file outside the store"))  # fmt: skip
    p = os.path.join(fresh("npy_symlink_dir_outside"), "store")
    import grain_replay as gr

    gr.write(p, {"obs": {"vec": base_tree()["obs"]}, "act": base_tree()["act"]}, format="npy")
    os.remove(os.path.join(p, "obs", "vec.npy"))
    os.rmdir(os.path.join(p, "obs"))
    os.symlink(out["npy"], os.path.join(p, "obs"))
    os.symlink("obs.npy", os.path.join(out["npy"], "vec.npy"))
    add(Case("npy_symlink_dir_outside", p, os.path.join(p, "obs"), "obs/vec", "external",
             "directory obs/ -> directory outside the store"))  # fmt: skip
    p = copy("npy", "npy_symlink_meta_outside")
    meta_file = os.path.join(p, "grain_replay.json")
    outside_meta = os.path.join(os.path.dirname(p), "outside_meta.json")
    os.rename(meta_file, outside_meta)
    os.symlink(outside_meta, meta_file)
    add(Case("npy_symlink_meta_outside", p, meta_file, None, "external",
             "grain_replay.json -> file outside the store"))  # fmt: skip
    p = foreign_npy("npy_symlink_foreign_outside")
    os.remove(leaf_file(p))
    os.symlink(os.path.join(out["npy"], "obs.npy"), leaf_file(p))
    add(Case("npy_symlink_foreign_outside", p, leaf_file(p), "obs", "external",
             "foreign dir, obs.npy -> file outside the store"))  # fmt: skip


def set_metadata(path: str, mutate: Callable[[dict[str, Any]], str | bytes]) -> None:
    """Rewrites the grain_replay metadata of the HDF5 / .npy / Zarr store at ``path``."""
    if path.endswith(".h5"):
        import h5py

        with h5py.File(path, "r+") as f:
            text = mutate(json.loads(f.attrs["grain_replay"]))
            f.attrs["grain_replay"] = np.void(text) if isinstance(text, bytes) else text
            # A commit in progress keeps a second copy, which readers prefer.
            assert "grain_replay.next" not in f.attrs
    elif path.endswith(".zarr"):
        meta = _zarr_meta(path)
        text = mutate(json.loads(meta["attributes"]["grain_replay"]))
        meta["attributes"]["grain_replay"] = (
            text.decode("latin1") if isinstance(text, bytes) else text
        )
        _write_zarr_meta(path, meta)
    else:
        meta_file = os.path.join(path, "grain_replay.json")
        with open(meta_file) as f:
            text = mutate(json.load(f))
        with open(meta_file, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode())


def _build_imports(add: Any, copy: Any, fresh: Any, root: str) -> None:
    """Metadata whose NamedTuple names a module: opening the store must not import it."""
    planted = fresh("_planted")
    for fmt in ("hdf5", "npy", "zarr"):
        module = f"gr_planted_{fmt}"
        marker = os.path.join(root, f"CODE_RAN_{fmt}")
        with open(os.path.join(planted, module + ".py"), "w") as f:
            f.write(
                "import collections\n"
                f"open({marker!r}, 'w').close()  # runs on import\n"
                "Rec = collections.namedtuple('Rec', ['obs', 'act'])\n"
            )

        def namedtuple(meta: dict[str, Any], module: str = module) -> str:
            meta["treedef"] = {
                "type": "namedtuple", "name": "Rec", "module": module, "qualname": "Rec",
                "fields": ["obs", "act"], "children": [{"type": "leaf"}, {"type": "leaf"}],
            }  # fmt: skip
            return json.dumps(meta)

        name = f"{fmt}_meta_namedtuple_imports_module"
        p = copy(fmt, name)
        set_metadata(p, namedtuple)
        culprit = p if fmt != "npy" else os.path.join(p, "grain_replay.json")
        add(Case(name, p, culprit, None, "bounded",
                 f"treedef NamedTuple module {module!r}, a module on sys.path whose import "
                 "creates a marker", marker=marker, pythonpath=planted))  # fmt: skip


def _zarr_meta(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "zarr.json")) as f:
        return json.load(f)


def _write_zarr_meta(path: str, meta: dict[str, Any]) -> None:
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(meta, f)


def _build_zarr(add: Any, copy: Any, out: dict[str, str]) -> None:
    import zarr

    chunk = lambda p: os.path.join(p, "obs", "c", "0", "0")
    size = os.path.getsize(chunk(copy("zarr", "_zarr_probe")))
    used = N * OBS_SHAPE[0] * 4  # bytes of the rows in use; the rest is chunk padding
    for i, off in enumerate([0, 1, used // 2, used - 1, size // 2]):
        name = f"zarr_chunk_truncated_{i:02d}"
        p = copy("zarr", name)
        truncate(chunk(p), off)
        where = "in the rows in use" if off < used else "in the padding after them"
        add(Case(name, p, chunk(p), "obs", "refuse",
                 f"obs chunk c/0/0 ({size} B) truncated at {off}, {where}"))  # fmt: skip
    zsize = os.path.getsize(chunk(copy("zarr_zstd", "_zarr_zstd_probe")))
    for i, off in enumerate([0, 1, zsize // 2]):
        name = f"zarr_zstd_chunk_truncated_{i:02d}"
        p = copy("zarr_zstd", name)
        truncate(chunk(p), off)
        add(Case(name, p, chunk(p), "obs", "refuse", f"zstd chunk c/0/0 truncated at {off}"))
    p = copy("zarr_zstd", "zarr_zstd_chunk_garbage")
    overwrite(chunk(p), 0, np.random.default_rng(2).bytes(zsize))
    add(Case("zarr_zstd_chunk_garbage", p, chunk(p), "obs", "refuse", "zstd chunk = random"))
    for where, label in (("", "root"), ("obs", "array")):
        for i, frac in enumerate((0, 1, 2)):
            name = f"zarr_{label}_json_truncated_{i:02d}"
            p = copy("zarr", name)
            f = os.path.join(p, where, "zarr.json")
            off = {0: 0, 1: 1, 2: os.path.getsize(f) // 2}[frac]
            truncate(f, off)
            leaf = "obs" if where else None
            add(Case(name, p, f, leaf, "refuse", f"{where or '.'}/zarr.json truncated at {off}"))
        name = f"zarr_{label}_json_garbage"
        p = copy("zarr", name)
        f = os.path.join(p, where, "zarr.json")
        with open(f, "wb") as fh:
            fh.write(b"\x00\xff\xfe binary \x80")
        add(
            Case(name, p, f, "obs" if where else None, "refuse", f"{where or '.'}/zarr.json binary")
        )

    def foreign(name: str) -> str:
        p = copy("zarr", name)
        meta = _zarr_meta(p)
        meta["attributes"] = {}
        _write_zarr_meta(p, meta)
        return p

    p = foreign("zarr_foreign_leaves_different_lengths")
    meta = _zarr_meta(os.path.join(p, "act"))
    meta["shape"] = [N - 1]
    _write_zarr_meta(os.path.join(p, "act"), meta)
    add(Case("zarr_foreign_leaves_different_lengths", p, os.path.join(p, "act"), "act", "refuse",
             "foreign group, act shape [255]"))  # fmt: skip
    p = foreign("zarr_foreign_string_dtype")
    g = zarr.open_group(p, mode="a")
    g.create_array("names", shape=(N,), dtype=str)
    add(Case("zarr_foreign_string_dtype", p, os.path.join(p, "names"), "names", "refuse",
             "foreign group with a string array"))  # fmt: skip

    def single_array(name: str, shape: list[int], chunks: list[int]) -> str:
        p = foreign(name)
        import shutil

        shutil.rmtree(os.path.join(p, "act"))
        meta = _zarr_meta(os.path.join(p, "obs"))
        meta["shape"] = shape
        meta["chunk_grid"]["configuration"]["chunk_shape"] = chunks
        _write_zarr_meta(os.path.join(p, "obs"), meta)
        return p

    rows = _zarr_meta(os.path.join(p, "obs"))["chunk_grid"]["configuration"]["chunk_shape"][0]
    p = single_array("zarr_foreign_shape_2p60", [HUGE, 4], [rows, 4])
    add(Case("zarr_foreign_shape_2p60", p, os.path.join(p, "obs"), "obs", "bounded",
             "foreign group, obs shape [2**60, 4], one chunk file"))  # fmt: skip
    p = single_array("zarr_foreign_chunk_shape_2p60", [HUGE, 4], [HUGE, 4])
    add(Case("zarr_foreign_chunk_shape_2p60", p, os.path.join(p, "obs"), "obs", "refuse",
             "foreign group, obs shape and chunk_shape [2**60, 4]"))  # fmt: skip

    def lie(name: str, fn: Callable[[dict[str, Any]], None]) -> str:
        p = copy("zarr", name)
        meta = _zarr_meta(os.path.join(p, "obs"))
        fn(meta)
        _write_zarr_meta(os.path.join(p, "obs"), meta)
        return p

    p = lie("zarr_shape_lie_2p60", lambda m: m.__setitem__("shape", [HUGE, 4]))
    add(Case("zarr_shape_lie_2p60", p, os.path.join(p, "obs"), "obs", "bounded",
             "obs/zarr.json shape [2**60, 4] (metadata N=256)"))  # fmt: skip
    p = lie("zarr_dtype_lie", lambda m: m.__setitem__("data_type", "float64"))
    add(Case("zarr_dtype_lie", p, os.path.join(p, "obs"), "obs", "refuse",
             "obs/zarr.json data_type float64, chunk files hold float32"))  # fmt: skip

    def chunks_to(rows: int) -> Callable[[dict[str, Any]], None]:
        return lambda m: m["chunk_grid"]["configuration"].__setitem__("chunk_shape", [rows, 4])

    p = lie("zarr_chunks_lie_smaller", chunks_to(64))
    add(Case("zarr_chunks_lie_smaller", p, chunk(p), "obs", "refuse",
             f"obs chunk_shape [64, 4]; chunk files hold {rows} rows"))  # fmt: skip
    p = lie("zarr_chunks_lie_bigger", chunks_to(rows * 4))
    add(Case("zarr_chunks_lie_bigger", p, chunk(p), "obs", "refuse",
             f"obs chunk_shape [{rows * 4}, 4]; chunk files hold {rows} rows"))  # fmt: skip
    p = copy("zarr", "zarr_fifo_chunk")
    os.remove(chunk(p))
    os.mkfifo(chunk(p))
    add(Case("zarr_fifo_chunk", p, chunk(p), "obs", "refuse", "obs chunk c/0/0 is a FIFO"))
    p = copy("zarr", "zarr_fifo_root_json")
    os.remove(os.path.join(p, "zarr.json"))
    os.mkfifo(os.path.join(p, "zarr.json"))
    add(Case("zarr_fifo_root_json", p, os.path.join(p, "zarr.json"), None, "refuse",
             "root zarr.json is a FIFO"))  # fmt: skip

    for v, (mutate, leaf, what) in _meta_variants().items():
        name = f"zarr_meta_{v}"
        p = copy("zarr", name)
        set_metadata(p, mutate)
        add(Case(name, p, os.path.join(p, "zarr.json"), leaf, "refuse", f"group attribute: {what}"))

    p = copy("zarr", "zarr_symlink_chunk_outside")
    os.remove(chunk(p))
    os.symlink(chunk(out["zarr"]), chunk(p))
    add(Case("zarr_symlink_chunk_outside", p, chunk(p), "obs", "external",
             "obs chunk c/0/0 -> chunk file outside the store"))  # fmt: skip
    p = copy("zarr", "zarr_symlink_array_outside")
    import shutil

    shutil.rmtree(os.path.join(p, "obs"))
    os.symlink(os.path.join(out["zarr"], "obs"), os.path.join(p, "obs"))
    add(Case("zarr_symlink_array_outside", p, os.path.join(p, "obs"), "obs", "external",
             "array directory obs/ -> array outside the store"))  # fmt: skip


# -- the probe (runs in the sandboxed child) ----------------------------------------------


def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def probe(case: dict[str, Any], kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Opens ``case`` and reads a spread of records; reports what happened."""
    import grain_replay as gr

    if case["opener"] == "_selftest_segfault":  # the harness's own tests
        os.kill(os.getpid(), signal.SIGSEGV)
    if case["opener"] == "_selftest_hang":
        time.sleep(3600)
    opener = gr.open_source if case["opener"] == "open_source" else getattr(gr, case["opener"])
    if case.get("pythonpath"):
        sys.path.insert(0, case["pythonpath"])
    _peak_rss_reset()
    rss0 = _peak_rss_mb()
    result: dict[str, Any] = {"name": case["name"]}
    stage = "construct"
    t0 = time.perf_counter()
    try:
        src = opener(case["store"], **(kwargs or {}))
        stage = "read"
        n = len(src)
        if n:
            idx = np.unique(np.concatenate([np.arange(min(n, 512)), [n // 2, n - 1]]))
            batch = src.read_flat(idx)
            src[0]
            src[n - 1]
            result["spec"] = {k: f"{v.dtype.str}{list(v.shape)}" for k, v in src.spec.items()}
            head = "obs" if "obs" in batch else "" if "" in batch else None  # "" = root leaf
            if head is not None:
                result["obs_head"] = np.asarray(batch[head][:2]).reshape(-1)[:8].tolist()
        result["num_records"] = n
        src.close()
        result["outcome"] = "accepted"
    except BaseException as e:
        result.update(
            outcome="raised",
            stage=stage,
            error_type=type(e).__name__,
            error_classes=[c.__name__ for c in type(e).__mro__],
            is_grain_replay_error=isinstance(e, gr.GrainReplayError),
            message=str(e)[:2000],
        )
    result["elapsed_s"] = time.perf_counter() - t0
    result["peak_rss_growth_mb"] = max(0.0, _peak_rss_mb() - rss0)
    marker = case.get("marker")
    result["marker_exists"] = bool(marker and os.path.exists(marker))
    if case.get("pythonpath"):
        sys.path.remove(case["pythonpath"])
    return result


def _warm_up() -> None:
    import grain_replay as gr

    with tempfile.TemporaryDirectory() as d:
        t = base_tree(8)
        for name in ("w.h5", "w.zarr", "w_npy"):
            gr.write(os.path.join(d, name), t, format=None if "." in name else "npy")
            src = gr.open_source(os.path.join(d, name))
            src.read_batch([0, 7])
            src.close()


def _runner_main(cases_file: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (PROBE_ADDRESS_SPACE, PROBE_ADDRESS_SPACE))
    with open(cases_file) as f:
        todo = json.load(f)
    _warm_up()
    for item in todo:
        print("START " + item["case"]["name"], flush=True)
        result = probe(item["case"], item.get("kwargs"))
        print("RESULT " + json.dumps(result), flush=True)


# -- the orchestrator (runs in the test process) -------------------------------------------


def run_corpus(
    cases: list[Case],
    *,
    kwargs: dict[str, Any] | None = None,
    hang_after_s: float = HANG_AFTER_S,
    start_timeout_s: float = 60.0,
    shards: int = 1,
) -> dict[str, dict[str, Any]]:
    """Probes every case in sandboxed child processes; a crash or hang costs one case only.

    With ``shards > 1`` the cases are dealt round-robin to that many children
    running at once, so that hangs (each costing ``hang_after_s``) overlap.
    """
    if shards > 1:
        parts: list[dict[str, dict[str, Any]]] = [{} for _ in range(shards)]
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                parts[i] = run_corpus(
                    cases[i::shards], kwargs=kwargs, hang_after_s=hang_after_s,
                    start_timeout_s=start_timeout_s,
                )  # fmt: skip
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(shards)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return {k: v for part in parts for k, v in part.items()}
    results: dict[str, dict[str, Any]] = {}
    remaining = list(cases)
    with tempfile.TemporaryDirectory() as tmp:
        while remaining:
            cases_file = os.path.join(tmp, "cases.json")
            with open(cases_file, "w") as f:
                json.dump([{"case": dataclasses.asdict(c), "kwargs": kwargs} for c in remaining], f)
            current, rc, stderr = _run_one_child(cases_file, results, hang_after_s, start_timeout_s)
            if current is not None:
                hung = rc is None
                results[current] = {
                    "name": current,
                    "outcome": "hang" if hung else "crash",
                    "returncode": rc,
                    "elapsed_s": hang_after_s if hung else None,
                    "message": (
                        f"no answer within {hang_after_s} s; the probe was killed"
                        if hung
                        else f"probe died (return code {rc}); stderr tail: {stderr[-1500:]}"
                    ),
                    "is_grain_replay_error": False,
                    "marker_exists": False,
                }
            left = [c for c in remaining if c.name not in results]
            if current is None and len(left) == len(remaining):
                raise RuntimeError(f"probe child made no progress (rc={rc}):\n{stderr[-3000:]}")
            remaining = left
    return results


def _run_one_child(
    cases_file: str, results: dict[str, Any], hang_after_s: float, start_timeout_s: float
) -> tuple[str | None, int | None, str]:
    """Runs one probe child until it finishes, crashes or hangs.

    Returns:
      ``(case in flight when it died or hung, return code or None if killed for
      hanging, stderr tail)``; the case is None when the child finished.
    """
    env = dict(os.environ, MALLOC_ARENA_MAX="2", JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--run", cases_file],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current: str | None = None
        timeout = start_timeout_s
        rc: int | None
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                proc.kill()
                proc.wait()
                rc = None
                break
            if line is None:
                rc = proc.wait()
                break
            if line.startswith("START "):
                current, timeout = line[6:].strip(), hang_after_s
            elif line.startswith("RESULT "):
                res = json.loads(line[7:])
                results[res["name"]] = res
                current = None
        if proc.stdout is not None:
            proc.stdout.close()
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    return current, rc, stderr


# -- grain worker helpers (importable by spawned workers) ---------------------------------


def identity(batch: Any) -> Any:
    return batch


# -- report ----------------------------------------------------------------------------------


def format_table(cases: dict[str, Case], results: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| case | what was done | expect | answer | message excerpt | time (s) | peak RSS +MiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, case in cases.items():
        r = results[name]
        if r["outcome"] == "raised":
            answer = r["error_type"] + (" (GrainReplayError)" if r["is_grain_replay_error"] else "")
            answer += f" at {r['stage']}"
        else:
            answer = r["outcome"]
        msg = (r.get("message") or "").replace(case.store, "<store>").replace("\n", " ")
        msg = msg.replace("|", "\\|")[:110]
        t = r.get("elapsed_s")
        rows.append(
            f"| {name} | {case.what} | {case.expect} | {answer} | {msg} | "
            f"{'-' if t is None else f'{t:.3f}'} | {r.get('peak_rss_growth_mb', 0):.0f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        _runner_main(sys.argv[2])
    elif len(sys.argv) >= 2 and sys.argv[1] == "--table":
        with tempfile.TemporaryDirectory() as d:
            corpus = build_corpus(d)
            t0 = time.perf_counter()
            res = run_corpus(list(corpus.values()), shards=4)
            print(format_table(corpus, res))
            print(f"\n{len(corpus)} cases probed in {time.perf_counter() - t0:.1f} s")
    else:
        sys.exit(f"usage: {sys.argv[0]} --table | --run CASES.json")
