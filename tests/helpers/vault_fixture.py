"""Writes flashbax Vaults as ``flashbax.vault.Vault`` (flashbax 0.1.3, VERSION 1.2) lays them out,
through tensorstore alone (no jax, no flashbax): for the default suite."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

TIME_AXIS_MAX_LENGTH = int(10e12)  # flashbax's upper bound of the time axis


def _leaves(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], np.ndarray]:
    if isinstance(tree, dict):
        out: dict[tuple[str, ...], np.ndarray] = {}
        for k, v in tree.items():
            out.update(_leaves(v, (*prefix, str(k))))
        return out
    return {prefix: np.asarray(tree)}


def _shapes(tree: Any, fn: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _shapes(v, fn) for k, v in tree.items()}
    return fn(np.asarray(tree))


def write_vault(
    path: str, experience: dict[str, Any], *, vault_index: int | None = None, buffer_time: int = 0
) -> str:
    """A Vault at ``path`` (its uid directory) of ``experience``'s ``(batch, time, ...)`` leaves.

    ``vault_index`` (default: the leaves' time length) is the committed length;
    ``buffer_time`` is the flashbax buffer's time axis recorded in metadata.json.
    """
    import tensorstore as ts

    os.makedirs(path, exist_ok=True)
    leaves = _leaves(experience)
    time = next(iter(leaves.values())).shape[1]
    buffer_time = buffer_time or time
    meta = {
        "version": 1.2,
        "structure_shape": _shapes(
            experience, lambda a: str((a.shape[0], buffer_time, *a.shape[2:]))
        ),
        "structure_dtype": _shapes(experience, lambda a: a.dtype.name),
    }
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(meta, f)
    base = f"file://{os.path.abspath(path)}"
    for parts, a in leaves.items():
        name = "".join(p + "." for p in parts)  # flashbax's _path_to_ds_name
        spec = {
            "driver": "zarr",
            "kvstore": {"driver": "ocdbt", "base": base, "path": name},
            "metadata": {"compressor": {"id": "gzip", "level": 5}},
        }
        store = ts.open(
            spec,
            shape=(a.shape[0], TIME_AXIS_MAX_LENGTH, *a.shape[2:]),
            dtype=a.dtype.name,
            create=True,
        ).result()
        if a.size:
            store[:, : a.shape[1]].write(a).result()
    index = ts.open(
        {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": base, "path": "vault_index"}},
        dtype=ts.int32,
        shape=(1,),
        create=True,
    ).result()
    index.write(np.array([time if vault_index is None else vault_index], np.int32)).result()
    return path
