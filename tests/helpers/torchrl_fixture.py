"""Writes torchrl buffer dumps exactly as ``ReplayBuffer.dumps`` lays them out (torch 2.13,
torchrl 0.14.1, tensordict 0.14): no torch needed, for the default suite."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

TORCH_DTYPES = {
    np.dtype("float64"): "torch.float64",
    np.dtype("float32"): "torch.float32",
    np.dtype("float16"): "torch.float16",
    np.dtype("int64"): "torch.int64",
    np.dtype("int32"): "torch.int32",
    np.dtype("int16"): "torch.int16",
    np.dtype("int8"): "torch.int8",
    np.dtype("uint8"): "torch.uint8",
    np.dtype("bool"): "torch.bool",
}


def _torch_dtype(a: np.ndarray) -> str:
    if a.dtype.name == "bfloat16":
        return "torch.bfloat16"
    return TORCH_DTYPES[a.dtype]


def write_dump(
    path: str,
    tree: dict[str, Any],
    *,
    capacity: int | None = None,
    cursor: int | None = None,
    write_count: int | None = None,
    pytree: bool = False,
) -> str:
    """A ReplayBuffer dump of ``tree`` (leaves with a rows axis) in a storage of ``capacity``.

    Rows are written in storage order: row ``i`` of each leaf is storage slot ``i``;
    slots past the filled rows are zero, as LazyMemmapStorage leaves them. ``cursor``
    and ``write_count`` go to ``writer/metadata.json`` (a round-robin writer's).
    """
    leaves = _flatten(tree)
    n = len(next(iter(leaves.values())))
    capacity = n if capacity is None else capacity
    storage = os.path.join(path, "storage")
    os.makedirs(storage, exist_ok=True)
    metadata: dict[str, Any] = {}
    if pytree:
        for key, a in leaves.items():
            name = "_-single-tensor-_" if key == "" else key
            file = os.path.join(storage, name + ".memmap")
            os.makedirs(os.path.dirname(file), exist_ok=True)
            _memmap(file, a, capacity)
            metadata[name.replace("/", ".")] = {
                "dtype": _torch_dtype(a),
                "shape": [capacity, *a.shape[1:]],
            }
    else:
        _write_td(storage, _nest(leaves), capacity)
    with open(os.path.join(storage, "storage_metadata.json"), "w") as f:
        json.dump({"metadata": metadata, "is_pytree": pytree, "len": n}, f)
    os.makedirs(os.path.join(path, "writer"), exist_ok=True)
    with open(os.path.join(path, "writer", "metadata.json"), "w") as f:
        json.dump(
            {"cursor": n % capacity if cursor is None else cursor, "write_count": write_count or n},
            f,
        )
    with open(os.path.join(path, "buffer_metadata.json"), "w") as f:
        json.dump({"batch_size": None, "consume_after_n_samples": None}, f)
    with open(os.path.join(path, "prefetch.pkl"), "wb") as f:
        f.write(b"\x80\x04 never unpickled: a reader that loads this fails")
    return path


def _memmap(file: str, a: np.ndarray, capacity: int) -> None:
    full = np.zeros((capacity, *a.shape[1:]), a.dtype)
    full[: len(a)] = a
    full.tofile(file)


def _write_td(directory: str, node: dict[str, Any], capacity: int) -> None:
    meta: dict[str, Any] = {}
    for name, value in node.items():
        if isinstance(value, dict):
            os.makedirs(os.path.join(directory, name), exist_ok=True)
            _write_td(os.path.join(directory, name), value, capacity)
            meta[name] = {"type": "TensorDict"}
        else:
            _memmap(os.path.join(directory, name + ".memmap"), value, capacity)
            meta[name] = {
                "device": "cpu",
                "shape": [capacity, *value.shape[1:]],
                "dtype": _torch_dtype(value),
                "is_nested": False,
            }
    meta["shape"] = [capacity]
    meta["device"] = "cpu"
    meta["_type"] = "<class 'tensordict._td.TensorDict'>"
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(meta, f)


def _flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    if isinstance(tree, dict):
        out: dict[str, np.ndarray] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: np.asarray(tree)}


def _nest(leaves: dict[str, np.ndarray]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for key, a in leaves.items():
        node = root
        parts = key.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = a
    return root


# -- H5StorageCheckpointer ---------------------------------------------------------------

DONE_KEYS = ("done", "terminated", "truncated")
REWARD_KEYS = ("reward",)


def write_h5_checkpoint(
    path: str,
    storage: dict[str, Any],
    *,
    length: int,
    shift: int | None = None,
    h5_kwargs: dict[str, Any] | None = None,
) -> str:
    """``ReplayBuffer.dumps(path)`` with ``H5StorageCheckpointer``: ``path/storage/checkpoint.h5``.

    ``storage`` is the TED storage in storage order (every leaf ``capacity`` rows, ``next``
    a nested dict), ``length`` the filled rows and ``shift`` the last written slot plus one
    (default ``length``). Ports torchrl 0.14's ``TED2Flat`` -> ``TED2Nested`` -> ``H5Split``
    save hooks and tensordict's ``PersistentTensorDict.from_dict`` (checked against
    files torchrl wrote; see tests/helpers/formats_peer.py).

    ``h5_kwargs`` go to ``create_dataset`` (as the checkpointer's ``h5_kwargs``). What a
    reader should give is :func:`h5_records`.
    """
    import h5py

    leaves = _flatten(storage)
    capacity = len(leaves["next/done"])
    shift = length if shift is None else shift
    is_full = length == capacity
    # TED2Flat: the rows oldest first, each trajectory's observations then its last next one.
    done = np.asarray(leaves["next/done"]).reshape(capacity).copy()
    if is_full:
        done = np.roll(done, -shift)
        done[-1] = True
    else:
        done[shift - 1] = True
    roll = (lambda a: np.roll(a, -shift, axis=0)) if is_full else (lambda a: a)
    nxt = {k[5:] for k in leaves if k.startswith("next/")}
    special = set(DONE_KEYS + REWARD_KEYS)
    expand = nxt - special
    total = {k for k in leaves if not k.startswith("next/")} | nxt
    idx = np.arange(capacity) + np.concatenate([[0], np.cumsum(done)[:-1]])
    idx_done = (np.arange(capacity) + np.cumsum(done))[done]
    flat: dict[str, np.ndarray] = {}
    for key in sorted(total):
        entry = roll(np.asarray(leaves[f"next/{key}"] if key in special else leaves[key]))
        if key in expand:
            out = np.zeros((capacity + int(done.sum()), *entry.shape[1:]), entry.dtype)
            out[idx] = entry
            out[idx_done] = roll(np.asarray(leaves[f"next/{key}"]))[done]
            flat[key] = out
        else:
            flat[key] = entry
    # TED2Nested: cut at the end flags; the unfilled rows of a buffer not full are one more.
    ends = np.asarray(flat["done"]).reshape(capacity).copy()
    if not is_full:
        ends[shift - 1] = True
    ends[-1] = True
    stops = np.flatnonzero(ends) + 1
    lengths = np.diff(np.concatenate([[0], stops]))
    plus = (np.ones_like(lengths) if is_full else (np.cumsum(lengths) % capacity != 0)).astype(int)
    file = os.path.join(path, "storage", "checkpoint.h5")
    os.makedirs(os.path.dirname(file), exist_ok=True)
    digits = int(np.ceil(np.log10(len(lengths))))
    kwargs = dict(h5_kwargs or {})
    with h5py.File(file, "w") as f:
        for key, a in flat.items():
            cut = np.cumsum(lengths + plus if key in expand else lengths)[:-1]
            for t, part in enumerate(np.split(a, cut)):
                f.create_dataset(f"traj_{str(t).zfill(digits)}/{key}", data=part, **kwargs)
        for name, value in (
            ("is_full", is_full),
            ("shift", shift),
            ("_storage_shape", (capacity,)),
            ("_len", length),
        ):
            v = np.array(value)
            f.create_dataset(name, data=v.astype(h5py.opaque_dtype(v.dtype)))
    _write_side_files(path, shift % capacity, length)
    return path


def h5_records(storage: dict[str, Any], *, length: int, shift: int | None = None) -> dict:
    """The records a reader of :func:`write_h5_checkpoint`'s file gives: torchrl's ``loads``
    storage, oldest first, with the root done flags False (the checkpointer does not keep them)."""
    leaves = _flatten(storage)
    capacity = len(leaves["next/done"])
    shift = length if shift is None else shift
    order = (np.arange(capacity) + shift) % capacity if length == capacity else np.arange(length)
    out = {k: np.asarray(v)[order] for k, v in leaves.items()}
    for k in DONE_KEYS:
        if f"next/{k}" in out:
            out[k] = np.zeros_like(out[f"next/{k}"])
    return dict(sorted(out.items()))


def _write_side_files(path: str, cursor: int, write_count: int) -> None:
    os.makedirs(os.path.join(path, "writer"), exist_ok=True)
    with open(os.path.join(path, "writer", "metadata.json"), "w") as f:
        json.dump({"cursor": cursor, "write_count": write_count}, f)
    with open(os.path.join(path, "buffer_metadata.json"), "w") as f:
        json.dump({"batch_size": None, "consume_after_n_samples": None}, f)
    with open(os.path.join(path, "prefetch.pkl"), "wb") as f:
        f.write(b"\x80\x04 never unpickled: a reader that loads this fails")
