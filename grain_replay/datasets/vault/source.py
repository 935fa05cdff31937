"""flashbax Vaults (Zarr v2 arrays in an OCDBT database) as a source, read through tensorstore."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES, ChunkCache
from grain_replay.sources.reading.readers import ArrayReader, Handle, LeafReader
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import VAULT_MANIFEST, import_tensorstore, shown_path

__all__ = ["VaultDataSource"]

logger = logging.getLogger(__name__)

METADATA_FILE = "metadata.json"
INDEX_ARRAY = "vault_index"
# Per-step flag leaves, tried in order: what flashbax users (OG-MARL) name them.
_TERMINATED = ("terminals", "terminated", "terminations", "terminal")
_TRUNCATED = ("truncations", "truncated", "timeouts", "timeout")
_DONE = ("done", "dones")


def find_vault(path: str) -> str:
    """The Vault directory: ``path`` itself, or the one uid directory inside it.

    ``Vault(vault_name, rel_dir=..., vault_uid=...)`` writes
    ``rel_dir/vault_name/vault_uid/``; OG-MARL ships ``<scenario>.vlt/<uid>/``.
    """

    def is_one(d: str) -> bool:
        return os.path.isfile(os.path.join(d, VAULT_MANIFEST)) and os.path.isfile(
            os.path.join(d, METADATA_FILE)
        )

    if is_one(path):
        return path
    if not os.path.isdir(path):
        raise StoreNotFoundError(
            f"No flashbax Vault at {shown_path(path)}. Fix: pass the directory "
            "Vault(vault_name=..., "
            "vault_uid=...) wrote (it holds metadata.json and manifest.ocdbt)."
        )
    found = sorted(e.path for e in os.scandir(path) if e.is_dir() and is_one(e.path))
    if len(found) == 1:
        return found[0]
    if not found:
        raise StoreNotFoundError(
            f"No flashbax Vault at {path}: neither it nor a directory inside holds "
            f"{METADATA_FILE} and {VAULT_MANIFEST}. Fix: pass the Vault's uid directory."
        )
    raise InvalidStoreError(
        f"{path} holds {len(found)} Vaults ({[os.path.basename(f) for f in found]}). Fix: "
        "pass one of them (its uid directory)."
    )


def _leaf_names(structure: Any, prefix: tuple[str, ...] = ()) -> dict[str, str]:
    """Leaf key (``nest/r``) -> flashbax's datastore name (``nest.r.``) for the metadata tree."""
    out: dict[str, str] = {}
    if isinstance(structure, dict):
        for k, v in structure.items():
            out.update(_leaf_names(v, (*prefix, str(k))))
    elif isinstance(structure, list):
        for i, v in enumerate(structure):
            out.update(_leaf_names(v, (*prefix, str(i))))
    else:
        out["/".join(prefix)] = "".join(p + "." for p in prefix)
    return out


def _spec(base: str, name: str) -> dict[str, Any]:
    return {
        "driver": "zarr",
        "kvstore": {"driver": "ocdbt", "base": f"file://{base}", "path": name},
        "open": True,
    }


class _TensorStoreReader(LeafReader):
    """Rows of one leaf read from the Vault per batch (the leaf does not fit the cache)."""

    def __init__(self, store: Any, time: int):
        self._store = store
        self._time = time

    def take(self, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return np.zeros((0, *self._store.shape[2:]), self._store.dtype.numpy_dtype)
        rows, steps = np.divmod(idx, self._time)
        return np.asarray(self._store.vindex[rows, steps].read().result())


class _VaultHandle(Handle):
    def __init__(self, source: VaultDataSource):
        base = source._vault
        batch, time = source._shape
        self.readers = {}
        self.mapped_files = {}
        # Leaves this source decoded before, in this process or in the parent it was
        # forked from: tensorstore cannot be used after a fork, a decoded array can.
        decoded = source._decoded
        cache = ChunkCache(source._cache_bytes)
        for key in source._keys:
            cache.register(key, len(source) * _row_bytes(source._layout.spec[key]))
        for key in source._keys:
            spec = source._layout.spec[key]
            if key in decoded:
                self.readers[key] = ArrayReader(decoded[key])
                continue
            store = import_tensorstore().open(_spec(base, source._layout.locations[key])).result()
            dense = cache.dense(key, (len(source), *spec.shape), spec.dtype, 1)
            if dense is None:
                if not source._warned:
                    source._warned = True
                    logger.warning(
                        "%s: the Vault's leaves decode to more than the %s-byte cache; each "
                        "batch is read through tensorstore (slower). Fix: raise cache_bytes=, "
                        "select fewer leaves with keys=[...], or `grain-replay convert` it once.",
                        base,
                        f"{cache.max_bytes:,}",
                    )
                self.readers[key] = _TensorStoreReader(store, time)
                continue
            rows, done = dense
            if not done[0] and rows.size:
                # One read of the committed slab, batch row by batch row, time in order.
                rows.reshape(batch, time, *spec.shape)[...] = store[:, :time].read().result()
            done[0] = True
            rows.flags.writeable = False
            decoded[key] = rows
            self.readers[key] = ArrayReader(rows)


def _row_bytes(spec: layout_lib.LeafSpec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


class VaultDataSource(ReplaySource):
    """Random-access grain source over a flashbax Vault, read through tensorstore.

    ``path`` is the directory ``flashbax.vault.Vault`` wrote
    (``rel_dir/vault_name/vault_uid``, holding ``metadata.json`` and the OCDBT
    database) or the ``vault_name`` directory when it holds one Vault, as
    OG-MARL ships them. Leaves are the experience tree's leaves (``nest/r``),
    each a ``(batch, time, ...)`` array of which the first ``vault_index``
    time steps are committed.

    Record order: batch row by batch row, time in order within each row:
    record ``b * T + t`` is step ``t`` of batch row ``b`` (``T`` the committed
    ``vault_index``), so each row's episodes stay contiguous. :meth:`episode_bounds`
    gives the episodes from the terminal/truncation leaves (any agent's flag
    ends the step's episode) and from the end of every batch row, and the
    episode views (``gr.SequenceDataSource``, ...) use it.

    The committed slab of each leaf is read once per process into the decoded
    cache (``cache_bytes``; by default what fits, up to 1/32 of the memory) and
    batches are gathers from it; leaves that do not fit are read per batch
    through tensorstore (slower; a warning says so once). tensorstore cannot be
    used in a forked child: a fork reads the leaves its parent decoded, and
    grain's workers, which are spawned, open the Vault themselves.

    Needs the ``vault`` extra (``pip install 'grain-replay[vault]'``: tensorstore).

    Args:
      path: the Vault directory.
      keys: leaves (or groups) to read; default all.
      cache_bytes: budget of the decoded leaves of each process.

    Examples:
      >>> src = gr.VaultDataSource("vaults/smac_3m/Good")
      >>> src.read_batch([0, 1])["observations"].shape
    """

    # _decoded is left out of pickles (no array data travels) but kept across a fork.
    _PER_PROCESS: ClassVar[dict[str, Any]] = {
        **ReplaySource._PER_PROCESS,
        "_warned": False,
        "_decoded": {},
    }

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        allow_external: bool = False,
    ):
        ChunkCache(cache_bytes)  # refuses a negative budget here, not in a worker
        self._cache_bytes = cache_bytes
        self._warned = False
        self._decoded: dict[str, np.ndarray] = {}
        super().__init__(path, keys, allow_external=allow_external)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._decoded = {}  # not the pickled class default: each process its own

    def close(self) -> None:
        """Releases the handle and the decoded leaves of this process."""
        super().close()
        self._decoded = {}

    @property
    def batch_size(self) -> int:
        """The Vault's batch rows ``B``."""
        return self._shape[0]

    @property
    def vault_index(self) -> int:
        """The committed time steps ``T`` of each batch row."""
        return self._shape[1]

    def _open(self) -> Handle:
        return _VaultHandle(self)

    def _inspect(self) -> Layout:
        ts = import_tensorstore()
        vault = find_vault(self._path)
        meta_file = os.path.join(vault, METADATA_FILE)
        try:
            with open(meta_file, encoding="utf-8") as f:
                meta = json.load(f)
            structure = meta["structure_shape"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidStoreError(
                f"{meta_file}: not a flashbax Vault's metadata ({type(e).__name__}: {e}). Fix: "
                "pass a directory flashbax.vault.Vault wrote."
            ) from e
        names = _leaf_names(structure)
        try:
            index = ts.open(_spec(vault, INDEX_ARRAY)).result()
            time = int(np.asarray(index.read().result()).reshape(-1)[0])
        except (ValueError, RuntimeError) as e:
            raise InvalidStoreError(
                f"{vault}: the Vault's {INDEX_ARRAY!r} (its committed length) is unreadable "
                f"({e}). Fix: check that the Vault was written completely."
            ) from e
        keys = layout_lib.foreign_keys(names, self._requested_keys)
        spec: dict[str, layout_lib.LeafSpec] = {}
        batches: dict[str, int] = {}
        for k in keys:
            try:
                store = ts.open(_spec(vault, names[k])).result()
            except (ValueError, RuntimeError) as e:
                raise InvalidStoreError(
                    f"{vault}: leaf {k!r} (datastore {names[k]!r}) does not open ({e}). The "
                    "Vault is incomplete or corrupt. Fix: write it again, or leave the leaf "
                    "out with keys=[...]."
                ) from e
            if store.rank < 2 or store.shape[1] < time:
                raise InvalidStoreError(
                    f"{vault}: leaf {k!r} has shape {list(store.shape)}; a Vault leaf is "
                    f"(batch, time, ...) with at least vault_index={time} time steps. Fix: "
                    "write the Vault again."
                )
            dtype = layout_lib.check_dtype(np.dtype(store.dtype.numpy_dtype), k, vault)
            spec[k] = layout_lib.LeafSpec(dtype, tuple(int(d) for d in store.shape[2:]))
            batches[k] = int(store.shape[0])
        batch = layout_lib.common_length(vault, batches)
        self._vault = vault
        self._shape = (batch, time)
        treedef = tree_lib.treedef_from_keys(keys)
        ordered = tree_lib.leaf_keys(treedef)
        return Layout(
            batch * time, {k: spec[k] for k in ordered}, treedef, {k: names[k] for k in ordered}
        )

    def episode_bounds(self) -> tuple[np.ndarray, np.ndarray, bool] | None:
        """``(ends, terminated, open_last)`` of the Vault's episodes, or None without flag leaves.

        Episodes end where a terminal, truncation or done leaf is set on a step
        (any of its values: one per agent in multi-agent Vaults), and at the end
        of every batch row, which is never continued by the next row; a row's
        unflagged tail is an unfinished episode (not terminated). Flag leaves
        are read whether or not ``keys=`` selected them.
        """
        ts = import_tensorstore()
        names = _leaf_names(_structure(self._vault))
        batch, time = self._shape
        flags = {
            group: [k for k in names if k.rsplit("/", 1)[-1] in group]
            for group in (_TERMINATED, _TRUNCATED, _DONE)
        }
        if not any(flags.values()) or time == 0:
            return None

        def any_set(keys: list[str]) -> np.ndarray:
            out = np.zeros((batch, time), bool)
            for k in keys:
                a = np.asarray(
                    ts.open(_spec(self._vault, names[k])).result()[:, :time].read().result()
                )
                out |= a.reshape(batch, time, -1).any(axis=-1)
            return out

        term = any_set(flags[_TERMINATED])
        end = term | any_set(flags[_TRUNCATED]) | any_set(flags[_DONE])
        if not flags[_TERMINATED]:  # done without a terminal flag: done less truncated
            term = any_set(flags[_DONE]) & ~any_set(flags[_TRUNCATED])
        flagged = end.reshape(-1).copy()
        end[:, -1] = True  # a batch row ends its last episode
        where = np.flatnonzero(end.reshape(-1))
        return where + 1, term.reshape(-1)[where], not bool(flagged[-1])


def _structure(vault: str) -> Any:
    with open(os.path.join(vault, METADATA_FILE), encoding="utf-8") as f:
        return json.load(f)["structure_shape"]
