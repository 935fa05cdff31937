"""On-disk metadata of a replay store: format version, N, keys, dtypes, shapes, treedef."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError, InvalidTreeError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_ATTR",
    "METADATA_FILE",
    "LeafSpec",
    "StoreMetadata",
    "disk_name",
    "prepare_leaves",
    "check_dtype",
    "common_length",
    "foreign_keys",
    "new_store_id",
]

FORMAT_NAME = "grain_replay"
FORMAT_VERSION = 1
# HDF5 root attribute / Zarr group attribute holding the metadata JSON.
METADATA_ATTR = "grain_replay"
# HDF5 only: the metadata while the main attribute is being grown (see writers).
METADATA_ATTR_NEXT = "grain_replay.next"
# File holding the metadata JSON in a `.npy` directory store.
METADATA_FILE = "grain_replay.json"
# On-disk name of the leaf of a tree that is a single array.
_ROOT_DISK_NAME = "data"


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Per-record dtype and shape of one leaf (without the leading N)."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def __repr__(self) -> str:
        return f"LeafSpec(dtype={self.dtype.str!r}, shape={self.shape})"


def disk_name(key: str) -> str:
    """The dataset / array / file path of leaf ``key`` (the root leaf is ``data``)."""
    return key if key != tree_lib.ROOT_KEY else _ROOT_DISK_NAME


def new_store_id() -> str:
    """A store's id, random, made once when a writer creates the store."""
    return uuid.uuid4().hex


@dataclasses.dataclass(frozen=True)
class StoreMetadata:
    """What a writer commits last: a store without it is foreign or unfinished.

    ``store_id`` (random hex, :func:`new_store_id`) names the store whatever its path:
    made when a writer creates it, kept as it grows, is reopened, moved or copied; a
    replay checkpoint records it. None: a store made before stores had ids (or a
    segment of a many-writer store, whose id is its ``replay_store.json``'s).
    """

    num_records: int
    leaves: dict[str, LeafSpec]
    treedef: dict[str, Any]
    checksums: dict[str, Any] | None = None
    version: int = FORMAT_VERSION
    store_id: str | None = None

    def check_like(self, theirs: StoreMetadata, *, where: str, other: str, place: str) -> None:
        """Refuses a tree unlike another writer's: ``self`` the appended tree's metadata,
        ``theirs`` writer ``other``'s; ``place`` says what another store is ("path", "URL").

        Raises:
          InvalidTreeError: the leaves or the structure differ, naming both.
        """
        if theirs.leaves == self.leaves and theirs.treedef == self.treedef:
            return

        def shown(leaves: dict[str, LeafSpec]) -> dict[str, str]:
            return {k: f"{v.dtype}{list(v.shape)}" for k, v in leaves.items()}

        raise InvalidTreeError(
            f"{where}: the appended tree has leaves {shown(self.leaves)} but writer "
            f"{other!r} of this store wrote {shown(theirs.leaves)}. Fix: append trees with "
            f"the store's structure, dtypes and shapes, or use another store {place}."
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "version": self.version,
                "num_records": self.num_records,
                "leaves": {
                    k: {"dtype": v.dtype.str, "shape": list(v.shape)}
                    for k, v in self.leaves.items()
                },
                "treedef": self.treedef,
                "checksums": self.checksums,
                **({} if self.store_id is None else {"store_id": self.store_id}),
            },
            sort_keys=False,
        )

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str) -> StoreMetadata:
        """Parses metadata written by :meth:`to_json`.

        Raises:
          InvalidStoreError: the text is not valid metadata, naming ``where``.
        """
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
                got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
                raise ValueError(f"format is {got!r}, expected {FORMAT_NAME!r}")
            version = _json_int(raw["version"], "version")
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"format version {version} is newer than this grain_replay "
                    f"(reads up to {FORMAT_VERSION}); upgrade grain_replay"
                )
            n = _json_int(raw["num_records"], "num_records")
            if not isinstance(raw["leaves"], dict):
                raise ValueError("leaves is not a mapping")
            leaves = {}
            for k, v in raw["leaves"].items():
                try:
                    if not isinstance(v["shape"], list):
                        raise ValueError(f"shape {v['shape']!r} is not a list")
                    shape = tuple(_json_int(s, "a dimension") for s in v["shape"])
                    dtype = np.dtype(v["dtype"])
                except InvalidStoreError:
                    raise
                except Exception as e:
                    raise ValueError(f"leaf {k!r}: {type(e).__name__}: {e}") from e
                leaves[str(k)] = LeafSpec(check_dtype(dtype, k, where), shape)
            treedef = raw["treedef"]
            if tree_lib.leaf_keys(treedef) != list(leaves):
                raise ValueError("the tree structure does not match the leaf list")
            checksums = raw.get("checksums")
            store_id = raw.get("store_id")
            if store_id is not None and not isinstance(store_id, str):
                raise ValueError(f"store_id {store_id!r} is not a string")
        except InvalidStoreError as e:
            if str(e).startswith(where):
                raise
            raise InvalidStoreError(f"{where}: {e}") from e
        except (
            ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError,
        ) as e:  # fmt: skip
            raise InvalidStoreError(
                f"{where}: grain_replay metadata is malformed ({e}). The store may be "
                "corrupt; rewrite it, or delete the metadata to open it as a foreign store."
            ) from e
        return cls(n, leaves, treedef, checksums, version, store_id)


def _json_int(value: Any, name: str) -> int:
    """A non-negative JSON integer (not a bool, float or string)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def check_dtype(dtype: np.dtype, key: str, where: str) -> np.dtype:
    """Refuses dtypes that cannot be stored or memory-mapped without pickle."""
    if dtype.hasobject or dtype.kind in "OUSV":
        raise InvalidStoreError(
            f"{where}: leaf {key!r} has dtype {dtype}, which grain_replay does not read "
            "(object, string and void dtypes are refused). Fix: store numeric arrays, e.g. "
            "encode strings as integer ids."
        )
    return dtype


def prepare_leaves(tree: Any, *, where: str) -> tuple[dict[str, np.ndarray], dict[str, Any], int]:
    """Validates a tree to write and fetches every leaf to host once.

    Returns:
      ``({key: numpy array}, treedef, num_records)``.

    Raises:
      InvalidTreeError: not a pytree, empty, a scalar or object/string leaf, or
        leaves whose leading dimensions differ (all of them are named).
    """
    return check_leaves(tree, where=where)


def check_leaves(
    tree: Any, *, where: str, keep: Callable[[Any], bool] | None = None
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """:func:`prepare_leaves`, except that leaves ``keep`` accepts (device arrays whose
    copy to host the caller starts itself) are checked from their ``dtype``, ``ndim``
    and ``shape`` and returned as they are, without a copy."""
    leaves, treedef = tree_lib.flatten(tree, where=where)
    if not leaves:
        raise InvalidTreeError(
            f"{where}: the tree has no leaves. Fix: pass at least one array, e.g. "
            "{'obs': obs, 'action': action}."
        )
    arrays: dict[str, Any] = {}
    for key, leaf in leaves.items():
        # np.asarray on a jax.Array fetches it to host in one transfer.
        arr = leaf if keep is not None and keep(leaf) else np.asarray(leaf)
        name = key or "<root>"
        if (
            arr.dtype.kind == "V"
            and not arr.dtype.fields
            and arr.dtype.name != f"void{8 * arr.itemsize}"
        ):
            raise InvalidTreeError(
                f"{where}: leaf {name!r} has dtype {arr.dtype}, which HDF5, .npy and Zarr "
                "readers do not round-trip. Fix: cast it, e.g. leaf.astype(np.float32), or "
                "store its bits with leaf.view(np.uint16)."
            )
        if arr.dtype.hasobject or arr.dtype.kind in "OUSV":
            raise InvalidTreeError(
                f"{where}: leaf {name!r} has dtype {arr.dtype}; only numeric and bool arrays "
                "can be stored (object and string dtypes need pickle to read back). Fix: "
                "encode it as numbers, e.g. np.array(strings, dtype='S') -> integer ids."
            )
        if arr.ndim == 0:
            raise InvalidTreeError(
                f"{where}: leaf {name!r} is a scalar; every leaf needs a leading records axis. "
                "Fix: pass an array of shape (N, ...)."
            )
        arrays[key] = arr
    n = common_length(
        where,
        {k or "<root>": a.shape[0] for k, a in arrays.items()},
        error=InvalidTreeError,
        fix="slice or pad the leaves to the same length",
    )
    return arrays, treedef, n


def common_length(
    where: str,
    lengths: dict[str, int],
    *,
    error: type[Exception] = InvalidStoreError,
    fix: str | None = None,
) -> int:
    """The shared leading dimension, or an error naming the leaves to fix.

    With a majority length (held by more than half of the leaves) the error names
    the leaves that differ from it; with none, it names every leaf with its length,
    so the user is never pointed at the wrong one.
    """
    values = list(lengths.values())
    if len(set(values)) <= 1:
        return values[0]
    counts = {n: values.count(n) for n in set(values)}
    majority = max(counts, key=lambda n: counts[n])
    if 2 * counts[majority] > len(values):
        bad = "; ".join(
            f"Leaf {k!r} has {n} records but expected {majority}"
            for k, n in lengths.items()
            if n != majority
        )
        ok = [k for k, n in lengths.items() if n == majority]
    else:
        bad = "no length is shared by most leaves: " + ", ".join(
            f"{k!r} has {n}" for k, n in lengths.items()
        )
        longest = max(counts, key=lambda n: (counts[n], n))
        ok = [k for k, n in lengths.items() if n == longest]
    if fix is None:
        fix = f"select leaves of one length with keys={ok!r}"
    raise error(f"{where}: leaves must share the leading (records) dimension. {bad}. Fix: {fix}.")


def foreign_keys(found: Iterable[str], wanted: Sequence[str] | None) -> list[str]:
    """Leaf keys of a foreign store, naturally sorted, narrowed to ``wanted`` if given.

    Narrowing before the length check lets ``keys=`` pick leaves of one length
    out of a file that mixes lengths (D4RL's ``infos``, say).
    """
    keys = sorted(found, key=tree_lib.natural_key)
    if wanted is None:
        return keys
    return [
        k for k in keys if any(k == w or k.startswith(w.rstrip("/") + "/") for w in wanted)
    ] or keys
