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
