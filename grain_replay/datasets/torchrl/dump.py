"""The on-disk layout of a torchrl buffer dump, read from its JSON files (no torch, no pickle)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.store.formats import shown_path

__all__ = ["DumpLeaf", "TorchRLDump", "find_storage_dir", "numpy_dtype", "read_dump"]

STORAGE_METADATA = "storage_metadata.json"
TD_METADATA = "meta.json"
WRITER_METADATA = os.path.join("writer", "metadata.json")
# torchrl's name for the one tensor of a buffer that holds a bare tensor.
SINGLE_TENSOR = "_-single-tensor-_"

_PLAIN = {
    "torch.float64": "<f8",
    "torch.float32": "<f4",
    "torch.float16": "<f2",
    "torch.int64": "<i8",
    "torch.int32": "<i4",
    "torch.int16": "<i2",
    "torch.int8": "i1",
    "torch.uint64": "<u8",
    "torch.uint32": "<u4",
    "torch.uint16": "<u2",
    "torch.uint8": "u1",
    "torch.bool": "?",
    "torch.complex64": "<c8",
    "torch.complex128": "<c16",
}
# torch dtypes numpy has only through ml_dtypes (a dependency of jax).
_ML_DTYPES = {
    "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
    "torch.float8_e4m3fnuz": "float8_e4m3fnuz",
    "torch.float8_e5m2fnuz": "float8_e5m2fnuz",
}


def numpy_dtype(torch_dtype: str, where: str, key: str) -> np.dtype:
    """The numpy dtype of a torch dtype string (``"torch.float32"``), little-endian as torch writes.

    Raises:
      InvalidStoreError: a dtype numpy cannot hold, naming the leaf and the fix.
    """
    if torch_dtype in _PLAIN:
        return np.dtype(_PLAIN[torch_dtype])
    if torch_dtype in _ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError as e:
            raise InvalidStoreError(
                f"{where}: leaf {key!r} is {torch_dtype}, which numpy reads only through the "
                "ml_dtypes package. Fix: pip install ml_dtypes (it comes with jax)."
            ) from e
        return np.dtype(getattr(ml_dtypes, _ML_DTYPES[torch_dtype]))
    raise InvalidStoreError(
        f"{where}: leaf {key!r} has dtype {torch_dtype!r}, which grain_replay does not read "
        f"(known: {sorted([*_PLAIN, *_ML_DTYPES])}). Fix: store it as one of those (e.g. "
        "tensor.float() before extending the buffer), or leave it out with keys=[...]."
    )


@dataclasses.dataclass(frozen=True)
class DumpLeaf:
    """One tensor of the dump: its ``.memmap`` file, dtype and full shape (capacity first)."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    # Why the leaf cannot be read (an unknown dtype, a jagged tensor, a scalar):
    # raised when the leaf is selected, so keys=[...] can leave it out.
    problem: str | None = None


@dataclasses.dataclass(frozen=True)
class TorchRLDump:
    """What a dump says: its leaves, the filled length, the capacity and the oldest row."""

    storage_dir: str
    leaves: dict[str, DumpLeaf]
    length: int
    capacity: int
    # Storage row of the oldest record: where the round-robin writer's cursor is once
    # the buffer has wrapped; 0 while it has not.
    start: int


def find_storage_dir(path: str) -> str | None:
    """The directory holding ``storage_metadata.json``: ``path`` or its ``storage/``."""
    for d in (path, os.path.join(path, "storage")):
        if os.path.isfile(os.path.join(d, STORAGE_METADATA)):
            return d
    return None


def _load_json(file: str, what: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise StoreNotFoundError(f"{shown_path(file)}: the torchrl dump has no {what}.") from e
    except (OSError, ValueError) as e:
        raise InvalidStoreError(
            f"{file}: the torchrl dump's {what} is unreadable ({e}). Fix: dump the buffer "
            "again with ReplayBuffer.dumps(path)."
        ) from e


def read_dump(path: str) -> TorchRLDump:
    """Reads a dump made by ``ReplayBuffer.dumps(path)`` / ``TensorStorage.dumps(path)``.

    TensorDict storages are a ``meta.json`` per (nested) TensorDict with one
    ``<key>.memmap`` per tensor; pytree storages list their tensors in
    ``storage_metadata.json``. Nothing pickled (``prefetch.pkl``, non-tensor
    data) is read.
    """
    storage = find_storage_dir(path)
    if storage is None:
        raise StoreNotFoundError(
            f"No torchrl buffer dump at {shown_path(path)}: neither it nor its storage/ holds "
            f"{STORAGE_METADATA}. Fix: pass the directory given to ReplayBuffer.dumps(path)."
        )
    meta = _load_json(os.path.join(storage, STORAGE_METADATA), STORAGE_METADATA)
    if not isinstance(meta, dict) or not isinstance(meta.get("len"), int):
        raise InvalidStoreError(
            f"{os.path.join(storage, STORAGE_METADATA)}: no integer 'len' (the filled length). "
            "Fix: dump the buffer again with ReplayBuffer.dumps(path)."
        )
    if meta.get("is_pytree"):
        leaves = _pytree_leaves(storage, meta.get("metadata") or {})
        capacities = {k: leaf.shape[0] for k, leaf in leaves.items() if leaf.shape}
    else:
        td_meta = _load_json(os.path.join(storage, TD_METADATA), TD_METADATA)
        batch = td_meta.get("shape") if isinstance(td_meta, dict) else None
        if not isinstance(batch, list) or len(batch) != 1:
            raise InvalidStoreError(
                f"{os.path.join(storage, TD_METADATA)}: the storage's batch shape is {batch}; "
                "grain_replay reads storages of one batch dimension (ndim=1), whose rows are "
                "the records. Fix: dump a storage made with ndim=1, or reshape the data."
            )
        leaves = {}
        _td_leaves(storage, td_meta, "", leaves)
        capacities = {k: batch[0] for k in leaves}
    for key, leaf in list(leaves.items()):
        if not leaf.shape and leaf.problem is None:
            leaves[key] = dataclasses.replace(
                leaf,
                problem=f"{leaf.file}: leaf {key!r} is a scalar; every leaf needs a records "
                "axis. Fix: leave it out with keys=[...].",
            )
    capacity = min((c for k, c in capacities.items() if leaves[k].problem is None), default=0)
    length = int(meta["len"])
    if not 0 <= length <= capacity and leaves:
        raise InvalidStoreError(
            f"{storage}: storage_metadata.json says len={length} but the leaves hold "
            f"{capacity} rows. Fix: dump the buffer again."
        )
    return TorchRLDump(storage, leaves, length, capacity, _oldest(path, storage, length, capacity))


def _oldest(path: str, storage: str, length: int, capacity: int) -> int:
    """The storage row of the oldest record of a wrapped round-robin buffer, else 0."""
    root = os.path.dirname(storage) if os.path.basename(storage) == "storage" else path
    file = os.path.join(root, WRITER_METADATA)
    if not os.path.isfile(file) or length < capacity or capacity == 0:
        return 0
    writer = _load_json(file, "writer metadata")
    cursor, count = writer.get("cursor"), writer.get("write_count")
    if not isinstance(cursor, int) or not isinstance(count, int) or count <= capacity:
        return 0  # not a round-robin writer, or it has not wrapped
    return cursor % capacity


def _pytree_leaves(storage: str, metadata: dict[str, Any]) -> dict[str, DumpLeaf]:
    leaves: dict[str, DumpLeaf] = {}
    for name, md in metadata.items():
        where = os.path.join(storage, STORAGE_METADATA)
        if not isinstance(md, dict) or "dtype" not in md or "shape" not in md:
            raise InvalidStoreError(
                f"{where}: tensor {name!r} has no dtype and shape. Fix: dump the buffer again."
            )
        # torchrl joins the pytree path with dots and writes the file under slashes,
        # except that names with dots of their own stay as they are.
        nested = name.replace(".", "/")
        if name == SINGLE_TENSOR:
            key, file = "", os.path.join(storage, SINGLE_TENSOR + ".memmap")
        elif os.path.isfile(os.path.join(storage, nested + ".memmap")):
            key, file = nested.replace("_<dot>_", "."), os.path.join(storage, nested + ".memmap")
        else:
            key, file = name, os.path.join(storage, name + ".memmap")
        leaves[key] = _leaf(file, md["dtype"], md["shape"], where, key)
    return leaves


def _leaf(file: str, dtype: Any, shape: Any, where: str, key: str) -> DumpLeaf:
    """The leaf, or one that carries why it cannot be read (raised if it is selected)."""
    dims = tuple(int(d) for d in shape)
    try:
        return DumpLeaf(file, numpy_dtype(str(dtype), where, key), dims)
    except InvalidStoreError as e:
        return DumpLeaf(file, np.dtype(np.uint8), dims, str(e))


def _encoded(key: str) -> str:
    """tensordict's file-system name of a key (its robust encoding)."""
    if not key:
        return "%"
    if key in (".", ".."):
        return "%2E" * len(key)
    unsafe = set('/<>:"|?*\\ \0%') | {chr(i) for i in range(32)} | {chr(127)}
    return "".join(f"%{ord(c):02X}" if c in unsafe else c for c in key)


def _td_leaves(directory: str, meta: dict[str, Any], prefix: str, out: dict[str, DumpLeaf]) -> None:
    where = os.path.join(directory, TD_METADATA)
    for name, entry in meta.items():
        if not isinstance(entry, dict):
            continue  # the TensorDict's own shape, device, type
        key = f"{prefix}{name}"
        kind = entry.get("type")
        if kind is not None:
            if str(kind).startswith("NonTensor"):
                continue  # non-tensor data (strings, pickles) is not a leaf
            sub = _existing(directory, name, is_dir=True)
            if sub is None:
                raise StoreNotFoundError(
                    f"{where}: nested TensorDict {key!r} has no directory "
                    f"{os.path.join(directory, _encoded(name))}. Fix: dump the buffer again."
                )
            _td_leaves(sub, _load_json(os.path.join(sub, TD_METADATA), TD_METADATA), key + "/", out)
            continue
        dtype, shape = entry.get("dtype"), entry.get("shape")
        if not isinstance(dtype, str) or not isinstance(shape, list):
            continue  # tensordict skips such entries too
        if entry.get("is_nested"):
            out[key] = DumpLeaf(
                os.path.join(directory, _encoded(name) + ".memmap"),
                np.dtype(np.uint8),
                tuple(shape),
                f"{where}: leaf {key!r} is a nested (jagged) tensor, which has no fixed "
                "per-record shape. Fix: pad it to one shape, or leave it out with keys=[...].",
            )
            continue
        file = _existing(
            directory, name + ".memmap", is_dir=False, encoded=_encoded(name) + ".memmap"
        )
        if file is None:
            if np.prod(shape) == 0:
                file = os.path.join(directory, _encoded(name) + ".memmap")  # empty: no file
            else:
                raise StoreNotFoundError(
                    f"{where}: leaf {key!r} has no file {_encoded(name)}.memmap. Fix: dump the "
                    "buffer again."
                )
        out[key] = _leaf(file, dtype, shape, where, key)


def _existing(directory: str, name: str, *, is_dir: bool, encoded: str | None = None) -> str | None:
    """The encoded name if it exists, else tensordict's legacy raw name (one safe component)."""
    check = os.path.isdir if is_dir else os.path.isfile
    first = os.path.join(directory, encoded if encoded is not None else _encoded(name))
    if check(first):
        return first
    if "/" not in name and "\\" not in name and name not in ("", ".", ".."):
        legacy = os.path.join(directory, name)
        if check(legacy):
            return legacy
    return None
