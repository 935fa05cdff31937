"""Per-leaf reads from a wrapped source, and helpers for the derived sources (tree structure,
their best-effort ``.npz`` caches beside a local store)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import ArgumentTypeError, InvalidStoreError
from grain_replay.sources.base import Layout, ReplaySource, select_keys
from grain_replay.sources.capabilities import Closeable, HasSpec, HasTreedef
from grain_replay.sources.reading.readers import window_rows
from grain_replay.sources.reading.windows import fix_windows
from grain_replay.sources.surface import BatchSource, SourceSurface
from grain_replay.store.filesync import atomic_replace
from grain_replay.store.layout import LeafSpec

__all__ = ["LeafAccess", "subtree", "with_entries", "describe"]


def describe(source: Any) -> str:
    """A short name of ``source`` for error messages: its path, else its type."""
    path = getattr(source, "path", None)
    return str(path) if path else type(source).__name__


class LeafAccess:
    """Reads chosen leaves of a source at chosen rows, one vectorized read per leaf.

    This is the one way a view or ``compute_stats`` reads leaves of a source.
    Every leaf of a grain_replay source at the same rows is one ``read_flat``
    (one bounds check). Otherwise a :class:`ReplaySource` is read through its
    per-process leaf readers, so each leaf gets exactly the rows it needs. Any
    other object with ``spec``, ``__len__`` and ``read_batch`` is read with a
    single ``read_batch`` over the union of the requested rows. Picklable
    whenever the source is.
    """

    def __init__(self, source: Any):
        self.source = source
        spec = source.spec if isinstance(source, HasSpec) else None
        if spec is None or not isinstance(source, BatchSource):
            raise ArgumentTypeError(
                f"{type(source).__name__} is not a replay source: it needs `spec`, `__len__` "
                "and `read_batch`. Fix: pass a grain_replay source such as gr.open_source(path)."
            )
        self.spec: dict[str, LeafSpec] = dict(spec)
        self.treedef: dict[str, Any] = (
            source.treedef
            if isinstance(source, HasTreedef) and isinstance(source.treedef, dict)
            else tree_lib.treedef_from_keys(self.spec)
        )
        self.where = describe(source)

    def select(self, keys: Sequence[str] | str | None) -> tuple[list[str], dict[str, Any]]:
        """The leaf keys and pruned structure selected by ``keys`` (leaves or group prefixes)."""
        layout = Layout(0, self.spec, self.treedef, {k: k for k in self.spec})
        chosen = select_keys(layout, keys, self.where)
        return list(chosen.spec), chosen.treedef

    def leaves_under(self, key: str) -> list[str]:
        """Leaf keys equal to ``key`` or inside the group ``key``, in tree order."""
        prefix = key.rstrip("/") + "/"
        return [k for k in self.spec if k == key or k.startswith(prefix)]

    def take(self, requests: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``{key: rows}`` -> ``{key: leaf[rows]}``; rows are in range, any shape.

        The result of each leaf has shape ``rows.shape + leaf_shape``.
        """
        if not requests:
            return {}
        src = self.source
        if isinstance(src, SourceSurface) and len(requests) == len(self.spec):
            first = next(iter(requests.values()))
            if all(rows is first for rows in requests.values()) and set(requests) == set(self.spec):
                got = src.read_flat(first.reshape(-1))
                return {k: got[k].reshape(first.shape + got[k].shape[1:]) for k in requests}
        if isinstance(src, ReplaySource):
            out = {}
            for key, rows in requests.items():
                flat = src.read_leaf(key, rows.reshape(-1))
                out[key] = flat.reshape(rows.shape + flat.shape[1:])
            return out
        # One read_batch over every distinct row array, split afterwards.
        arrays: dict[int, np.ndarray] = {}
        for rows in requests.values():
            arrays.setdefault(id(rows), rows)
        order = list(arrays)
        bounds = np.cumsum([0] + [arrays[a].size for a in order])
        allrows = np.concatenate([arrays[a].reshape(-1) for a in order]).astype(np.int64)
        leaves, _ = tree_lib.flatten(src.read_batch(allrows))
        out = {}
        for key, rows in requests.items():
            j = order.index(id(rows))
            flat = np.asarray(leaves[key])[bounds[j] : bounds[j + 1]]
            out[key] = flat.reshape(rows.shape + flat.shape[1:])
        return out

    def take_into(self, requests: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """``{key: (rows, out)}``: writes ``leaf[rows]`` into ``out`` (shape ``rows.shape +
        leaf_shape``, the leaf's dtype); rows are in range.

        A grain_replay source gathers straight into ``out`` (its ``read_into``: an
        image leaf decodes or reads its cached frames into it, no batch allocated and
        copied), one call for the leaves that share their rows; an ``out`` that is not
        C-contiguous, or any other source, is read as :meth:`take` and copied in.
        """
        src = self.source
        direct: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}
        copied: dict[str, np.ndarray] = {}
        for key, (rows, out) in requests.items():
            if (
                isinstance(src, ReplaySource)
                and type(out) is np.ndarray
                and out.flags.c_contiguous
                and out.dtype == self.spec[key].dtype
            ):
                flat = out.reshape(rows.size, *self.spec[key].shape)  # a view: contiguous
                direct.setdefault(id(rows), (rows.reshape(-1), {}))[1][key] = flat
            else:
                copied[key] = rows
        for rows, outs in direct.values():
            src.read_into(rows, outs, check=False)
        for key, got in self.take(copied).items():
            requests[key][1][...] = got

    def take_windows(self, key: str, starts: np.ndarray, length: int) -> np.ndarray:
        """``leaf[start : start + length]`` per start, ``(len(starts), length, ...)``.

        ``starts`` are int64 in ``[0, N - length]``. A grain_replay source
        reads them with one ``read_windows``; any other as the rows.
        """
        src = self.source
        if isinstance(src, ReplaySource):
            return src.read_windows(key, starts, length, check=False)
        rows = window_rows(starts, length).reshape(len(starts), length)
        return self.take({key: rows})[key]

    def take_windows_flat(
        self, windows: Mapping[str, tuple[np.ndarray, int]]
    ) -> dict[str, np.ndarray]:
        """``{key: (starts, length)}`` -> ``{key: take_windows(key, starts, length)}``.

        A grain_replay source reads them all in one ``read_windows_flat`` (one
        handle and truncation check for the batch); any other as the rows, in
        one :meth:`take`.
        """
        if not windows:
            return {}
        src = self.source
        if isinstance(src, ReplaySource):
            return src.read_windows_flat(windows, check=False)
        rows = {
            key: window_rows(starts, length).reshape(len(starts), length)
            for key, (starts, length) in windows.items()
        }
        return self.take(rows)

    def take_windows_fixed(
        self, windows: Mapping[str, tuple[np.ndarray, int, np.ndarray | None, np.ndarray | None]]
    ) -> dict[str, np.ndarray]:
        """``{key: (starts, length, near, at)}`` -> :meth:`take_windows_flat` of the
        ``(starts, length)``, where window ``near[i]`` takes at its position ``j`` the row
        ``starts[near[i]] + at[i, j]`` (``near``/``at`` None: none).

        A grain_replay source reads each leaf's windows and fix-up in one pass (one
        compiled copy on a memory-mapped leaf, with numba); any other reads the windows
        as :meth:`take_windows_flat` does and fixes them up in numpy.
        """
        if not windows:
            return {}
        src = self.source
        if isinstance(src, ReplaySource):
            return src.read_windows_fixed(windows)
        got = self.take_windows_flat({k: (w[0], w[1]) for k, w in windows.items()})
        for key, (_, _, near, at) in windows.items():
            fix_windows(got[key], near, at)
        return got

    def handle(self) -> Any:
        """The source's open handle in this process (None: none, or not a grain_replay source)."""
        return getattr(self.source, "open_handle", None)

    def opens(self) -> int:
        """How many handles the source opened (0 for a source that does not say)."""
        return int(getattr(self.source, "handle_opens", 0))

    def close(self) -> None:
        if isinstance(self.source, Closeable):
            self.source.close()


def local_path(source: Any) -> str | None:
    """The source's path if it is on the local file system, else None."""
    path = getattr(source, "path", None)
    if not isinstance(path, str) or "://" in path or not os.path.exists(path):
        return None
    return path


def save_cache(file: str, arrays: Mapping[str, Any], what: str, logger: logging.Logger) -> None:
    """Writes ``arrays`` to the ``.npz`` ``file`` by an atomic rename, if the file system lets us.

    A cache is an optimisation: an ``OSError`` (read-only store, full disk) is
    logged at info level on ``logger`` as "cannot write the ``what``" and the
    partial file is removed; nothing is raised.
    """
    try:
        # Not fsync'ed: a crash at worst loses the cache, which is rebuilt.
        with atomic_replace(file, durable=False) as f:
            np.savez(f, **arrays)
    except OSError as e:
        logger.info("%s: cannot write the %s (%s); continuing without", file, what, e)


def subtree(treedef: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The node of ``treedef`` at the ``/``-joined path ``key``."""
    node: Mapping[str, Any] = treedef
    for part in [p for p in key.split("/") if p] if key else []:
        names = tree_lib.child_names(node)
        if part not in names:
            raise KeyError(key)
        node = node["children"][names.index(part)]
    return dict(node)


def with_entries(
    treedef: Mapping[str, Any], entries: Sequence[tuple[str, dict[str, Any]]], where: str
) -> dict[str, Any]:
    """``treedef`` (a dict at the root) with top-level ``entries`` appended.

    Raises:
      InvalidStoreError: the root is not a dict, or an entry's name is taken.
    """
    if not entries:
        return dict(treedef)
    names = [n for n, _ in entries]
    if treedef.get("type") != "dict":
        raise InvalidStoreError(
            f"{where}: the records are a {treedef.get('type')}, but adding the leaves {names} "
            "needs a dict at the root. Fix: store the tree as a dict, e.g. "
            "{'obs': ..., 'action': ...}."
        )
    taken = [n for n in names if n in treedef["keys"]]
    if taken:
        raise InvalidStoreError(
            f"{where}: the store already has {taken}, which this source adds. Fix: leave them "
            "out with keys=[...] or pick other names for the added leaves."
        )
    return {
        "type": "dict",
        "keys": [*treedef["keys"], *names],
        "children": [*treedef["children"], *(c for _, c in entries)],
    }
