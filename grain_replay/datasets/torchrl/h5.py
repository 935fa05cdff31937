"""torchrl's ``H5StorageCheckpointer`` file (``checkpoint.h5``) as TED records, read in place.

The checkpointer (torchrl's ``TED2Flat`` -> ``TED2Nested`` -> ``H5Split`` save hooks, then
tensordict's ``PersistentTensorDict.from_dict``) writes one HDF5 group per trajectory,
``traj_<i>`` (``i`` zero-padded to ``ceil(log10(count))`` digits), oldest first (a full
ring is rolled so that the oldest row comes first), plus four opaque scalars at the
root: ``_len`` (the filled length), ``shift``, ``is_full`` and ``_storage_shape``. In a
group of ``L`` steps, each key of the TED ``next`` tensordict that is also a root key
(``observation``) is stored once with ``L + 1`` rows (the observation of each step, then
the last ``next`` one); the done and reward keys (``done``, ``terminated``, ``truncated``,
``reward``: torchrl's defaults) have ``L`` rows and are the ``next`` ones; every other key
(``action``, nested ``collector/traj_ids``) has ``L`` rows. A not yet full buffer's last
group is its unfilled rows (``_len`` leaves them out).

Records are the steps in that order, with the leaves ``ReplayBuffer.loads`` restores:
``observation`` and ``next/observation`` (rows ``[0, L)`` and ``[1, L + 1)`` of the
group), ``next/done`` … ``next/reward``, ``done`` / ``terminated`` / ``truncated`` at the
root (all False: the checkpointer assumes so and does not store them), ``action``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.store.formats import shown_path

__all__ = [
    "DONE_KEYS", "REWARD_KEYS", "H5Checkpoint", "H5Leaf", "TrajIndex", "find_h5", "open_h5",
    "read_h5", "scan",
]  # fmt: skip

# torchrl's DEFAULT_DONE_KEYS and the default reward_keys of TED2Flat.
DONE_KEYS = ("done", "terminated", "truncated")
REWARD_KEYS = ("reward",)
_FIX = (
    "Fix: dump the buffer again with rb.dumps(path), with H5StorageCheckpointer or with the "
    "default checkpointer (LazyMemmapStorage's .memmap files, also read in place)."
)


@dataclasses.dataclass(frozen=True)
class H5Leaf:
    """One leaf of the records: a dataset of every trajectory group, or zeros."""

    dataset: str  # path inside a traj_* group; "" for the root done flags (zeros)
    dtype: np.dtype
    shape: tuple[int, ...]  # per record
    first: int = 0  # 1 for next/<key> of a key stored with L + 1 rows
    problem: str | None = None  # why it cannot be read (raised if selected)


@dataclasses.dataclass(frozen=True)
class H5Checkpoint:
    """What ``checkpoint.h5`` holds: its leaves and the filled length (no per-step data)."""

    file: str
    leaves: dict[str, H5Leaf]
    length: int
    start: int = 0  # the groups are oldest first already


@dataclasses.dataclass(frozen=True)
class TrajIndex:
    """Where each trajectory's rows sit: first record of each group, and per leaf the byte
    offset of each group's dataset (None where a dataset is chunked or filtered)."""

    groups: list[str]
    starts: np.ndarray  # (groups + 1,) int64, records
    offsets: dict[str, np.ndarray | None]  # dataset -> (groups,) int64 byte offsets


def open_h5(file: str) -> Any:
    """The file opened read-only with h5py, or the error naming it and the fix."""
    import h5py

    try:
        return h5py.File(file, "r")
    except FileNotFoundError as e:
        raise StoreNotFoundError(f"{shown_path(file)}: no such H5StorageCheckpointer file.") from e
    except OSError as e:
        raise InvalidStoreError(f"{file}: not a readable HDF5 file ({e}). {_FIX}") from e


def _scalar(f: Any, name: str, file: str) -> Any:
    if name not in f:
        raise InvalidStoreError(
            f"{file}: no {name!r} at the root, so it was not written by torchrl's "
            f"H5StorageCheckpointer. {_FIX}"
        )
    return np.asarray(f[name][()])


def _groups(f: Any, file: str) -> list[str]:
    import h5py

    names = []
    for name in f:
        if name.startswith("traj_") and name[5:].isdigit() and isinstance(f[name], h5py.Group):
            names.append(name)
    if not names:
        raise InvalidStoreError(f"{file}: no traj_* group (no trajectory). {_FIX}")
    return sorted(names, key=lambda n: int(n[5:]))


def _datasets(group: Any) -> dict[str, Any]:
    import h5py

    out: dict[str, Any] = {}
    group.visititems(lambda name, obj: out.__setitem__(name, obj) if isinstance(
        obj, h5py.Dataset) else None)  # fmt: skip
    return out


def read_h5(file: str) -> H5Checkpoint:
    """The leaves and filled length of an ``H5StorageCheckpointer`` file.

    Raises:
      InvalidStoreError: not such a file, a storage of several dimensions, or groups
        that do not agree, naming the file, the group and the leaf.
    """
    with open_h5(file) as f:
        length = int(_scalar(f, "_len", file))
        if "_storage_shape" in f:
            shape = np.atleast_1d(np.asarray(f["_storage_shape"][()])).tolist()
            if len(shape) != 1:
                raise InvalidStoreError(
                    f"{file}: the storage's shape is {shape}; grain_replay reads storages of "
                    "one batch dimension (ndim=1), whose rows are the records. Fix: dump a "
                    "storage made with ndim=1, or reshape the data."
                )
        groups = _groups(f, file)
        first = groups[0]
        sets = _datasets(f[first])
        if "done" not in sets:
            raise InvalidStoreError(
                f"{file}: group {first!r} has no 'done' dataset, which gives each trajectory's "
                f"length (torchrl's done_key). {_FIX}"
            )
        steps = sets["done"].shape[0]
        leaves: dict[str, H5Leaf] = {}
        for name in sorted(sets):
            ds = sets[name]
            rows = ds.shape[0] if ds.shape else -1
            dtype, shape = ds.dtype, tuple(ds.shape[1:])
            problem = None
            if dtype.kind not in "biufc":
                problem = (
                    f"{file}: leaf {name!r} ({first}/{name}) has dtype {dtype}, which "
                    "grain_replay does not read. Fix: leave it out with keys=[...]."
                )
            if rows == steps + 1:  # the observation of each step, then the last next one
                leaves[name] = H5Leaf(name, dtype, shape, 0, problem)
                leaves[f"next/{name}"] = H5Leaf(name, dtype, shape, 1, problem)
            elif rows == steps and name in DONE_KEYS + REWARD_KEYS:
                leaves[f"next/{name}"] = H5Leaf(name, dtype, shape, 0, problem)
                if name in DONE_KEYS:  # torchrl restores the root flags as False
                    leaves[name] = H5Leaf("", dtype, shape, 0, problem)
            elif rows == steps:
                leaves[name] = H5Leaf(name, dtype, shape, 0, problem)
            else:
                raise InvalidStoreError(
                    f"{file}: {first}/{name} has {rows} rows, but the group has {steps} steps "
                    f"(its 'done' rows): a leaf has {steps} or {steps + 1} rows. {_FIX}"
                )
        checkpoint = H5Checkpoint(file, leaves, length)
        scan(f, checkpoint, offsets=False)  # every group agrees with the first
    return checkpoint


def scan(
    f: Any, checkpoint: H5Checkpoint, *, offsets: bool = True, only: set[str] | None = None
) -> TrajIndex:
    """The :class:`TrajIndex` of the open file ``f`` (one pass over the groups), for the
    datasets ``only`` (default: every leaf's).

    Raises:
      InvalidStoreError: a group lacks a leaf's dataset or disagrees on its dtype,
        per-record shape or number of rows, naming the group and the leaf.
    """
    file = checkpoint.file
    groups = _groups(f, file)
    specs = {
        leaf.dataset: leaf
        for leaf in checkpoint.leaves.values()
        if leaf.dataset and (only is None or leaf.dataset in only)
    }
    names = sorted(specs)
    plus = {leaf.dataset for leaf in checkpoint.leaves.values() if leaf.first}
    lengths = np.empty(len(groups), np.int64)
    for g, group in enumerate(groups):
        node = f[group]
        if "done" not in node:
            raise InvalidStoreError(f"{file}: group {group!r} has no 'done' dataset. {_FIX}")
        lengths[g] = node["done"].shape[0]
    length, total = checkpoint.length, int(lengths.sum())
    if not 0 <= length <= total:
        raise InvalidStoreError(
            f"{file}: '_len' says {length} records but the trajectories hold {total}. {_FIX}"
        )
    where: dict[str, list[int] | None] = {n: [] for n in names} if offsets else {}
    done = 0
    for group, steps in zip(groups, lengths.tolist()):
        node = f[group]
        for name in names:
            if name not in node:
                raise InvalidStoreError(
                    f"{file}: group {group!r} has no dataset {name!r}, which {groups[0]!r} "
                    f"has. {_FIX}"
                )
            ds = node[name]
            spec = specs[name]
            # The unfilled rows of a buffer that is not full get no extra observation.
            want = (steps, steps + 1) if name in plus else (steps,)
            if ds.dtype != spec.dtype or tuple(ds.shape[1:]) != spec.shape or (
                ds.shape[0] not in want
            ) or (name in plus and done < length and ds.shape[0] != steps + 1):  # fmt: skip
                raise InvalidStoreError(
                    f"{file}: {group}/{name} is {ds.dtype} {ds.shape}, but the leaf is "
                    f"{spec.dtype} (rows, *{spec.shape}) with {want[-1]} rows in this group "
                    f"({steps} steps). {_FIX}"
                )
            rows = where.get(name)
            if rows is not None:
                at = _contiguous_offset(ds)
                if at is None:
                    where[name] = None
                else:
                    rows.append(at)
        done += steps
    starts = np.zeros(len(groups) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    return TrajIndex(
        groups,
        starts,
        {n: None if v is None else np.asarray(v, np.int64) for n, v in where.items()},
    )


def _contiguous_offset(ds: Any) -> int | None:
    """The byte offset of a contiguous, unfiltered dataset's data, else None."""
    import h5py

    plist = ds.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_nfilters():
        return None
    at = ds.id.get_offset()
    if at is None:  # no storage allocated: an empty dataset
        return 0 if ds.size == 0 else None
    return int(at)


def find_h5(path: str) -> str | None:
    """``checkpoint.h5`` in ``path`` or its ``storage/``, as ``ReplayBuffer.dumps`` puts it, or
    ``path`` itself, an ``.h5`` file (``TensorStorage.dumps("x.h5")``)."""
    if path.endswith(".h5") and os.path.isfile(path):
        return path
    for d in (path, os.path.join(path, "storage")):
        file = os.path.join(d, "checkpoint.h5")
        if os.path.isfile(file):
            return file
    return None
