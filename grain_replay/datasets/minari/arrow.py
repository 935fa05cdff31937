"""Minari datasets in Arrow format (``data/<episode>/part-0.arrow``), read zero-copy from maps."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError
from grain_replay.sources.base import Layout
from grain_replay.sources.reading.jpeg import decode_jpegs
from grain_replay.sources.reading.readers import Handle, LeafReader
from grain_replay.sources.reading.runs import runs
from grain_replay.store.layout import LeafSpec
from grain_replay.store.optional import import_optional

__all__ = ["ArrowEpisodeHandle", "arrow_layout", "episode_files"]

_LEAF = {"type": "leaf"}


def pyarrow() -> Any:
    """``pyarrow`` with ``pyarrow.ipc`` loaded, or MissingDependencyError with the install hint."""
    hint = (
        "Reading Minari datasets in Arrow format needs pyarrow. Fix: pip install "
        "'grain-replay[rl]' (or pip install pyarrow)."
    )
    import_optional("pyarrow.ipc", hint)
    return import_optional("pyarrow", hint)


def episode_files(data_dir: str) -> list[list[str]]:
    """Per episode (numeric folder names in order), its ``.arrow`` files."""
    ids = sorted(int(n) for n in os.listdir(data_dir) if n.isdigit())
    out = []
    for i in ids:
        folder = os.path.join(data_dir, str(i))
        out.append(
            sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".arrow"))
        )
    return out


def read_table(files: Sequence[str]) -> Any:
    """One episode's table from its Arrow IPC files, memory-mapped (no descriptor kept)."""
    pa = pyarrow()
    tables = []
    for file in files:
        with open(file, "rb") as f:
            # The map outlives the descriptor; the table's buffers point into it.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            tables.append(pa.ipc.open_file(pa.py_buffer(mm)).read_all())
        except (pa.ArrowInvalid, OSError) as e:
            raise InvalidStoreError(
                f"{file}: not a readable Arrow IPC file ({e}). The dataset is truncated or "
                "corrupt. Fix: download or collect it again."
            ) from e
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _combined(column: Any) -> Any:
    """A ChunkedArray as one Array (zero-copy for one chunk, the usual case)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _children(array: Any) -> dict[str, Any]:
    names = [array.type.field(i).name for i in range(array.type.num_fields)]
    return dict(zip(names, array.flatten()))


def _space_at(space: Any, name: str) -> Any:
    subs = space.get("subspaces") if isinstance(space, dict) else None
    if isinstance(subs, dict):
        return subs.get(name)
    if isinstance(subs, list) and name.isdigit() and int(name) < len(subs):
        return subs[int(name)]
    return None


def arrow_layout(
    data_dir: str,
    files: list[list[str]],
    fields: Sequence[tuple[str, str, int]],
    spaces: dict[str, Any],
    images: dict[str, tuple[int, ...]],
) -> tuple[Layout, dict[str, int], dict[str, tuple[str, ...]], list[str], np.ndarray]:
    """Layout of an Arrow-format Minari dataset, from its first episode and every length.

    Args:
      data_dir: the ``data`` folder.
      files: :func:`episode_files`.
      fields: ``(leaf name, column, row offset)`` of each top-level field.
      spaces: column -> the (deserialized JSON) space, for shapes and Dict/Tuple.
      images: column paths (``observations/rgb``) of JPEG-encoded image spaces -> shape.

    Returns:
      ``(layout, offsets, column paths, JPEG leaf keys, steps per episode)``.
    """
    pa = pyarrow()
    first = read_table(files[0])
    # Every episode is mapped once (no copy) for its length.
    rows = [first.num_rows] + [read_table(f).num_rows for f in files[1:]]
    lengths = np.array(rows, dtype=np.int64) - 1
    spec: dict[str, LeafSpec] = {}
    offsets: dict[str, int] = {}
    columns: dict[str, tuple[str, ...]] = {}
    jpeg: list[str] = []
    top_keys, children = [], []

    def visit(array: Any, key: str, path: tuple[str, ...], space: Any, offset: int) -> Any:
        t = array.type
        loc = "/".join(path)
        if pa.types.is_struct(t):
            items = _children(array)
            names = sorted(items)
            # Minari records an info array's shape in its field's metadata.
            shapes = {}
            for i in range(t.num_fields):
                meta = t.field(i).metadata or {}
                if b"shape" in meta:
                    dims = [int(d) for d in meta[b"shape"].split(b",") if d.strip()]
                    shapes[t.field(i).name] = {"shape": dims}
            numbered = all(n.isdigit() for n in names) and sorted(map(int, names)) == list(
                range(len(names))
            )
            # Minari writes a Tuple space as a struct of fields "0", "1", ...
            if isinstance(space, dict) and space.get("type"):
                is_tuple = space["type"] == "Tuple"
            else:
                is_tuple = bool(names) and numbered
            if is_tuple:
                names = [str(i) for i in range(len(items))]
            nodes = [
                visit(items[n], f"{key}/{n}", (*path, n), _space_at(space, n) or shapes.get(n),
                      offset)
                for n in names
            ]  # fmt: skip
            if is_tuple:
                return {"type": "tuple", "children": nodes}
            return {"type": "dict", "keys": names, "children": nodes}
        if loc in images and (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
            spec[key] = LeafSpec(np.dtype(np.uint8), images[loc])
            jpeg.append(key)
        elif pa.types.is_fixed_size_list(t) and _numeric(t.value_type):
            size = t.list_size
            shape = tuple(space.get("shape") or ()) if isinstance(space, dict) else ()
            if int(np.prod(shape, dtype=np.int64)) != size:
                shape = (size,)
            spec[key] = LeafSpec(np.dtype(t.value_type.to_pandas_dtype()), shape)
        elif _numeric(t):
            spec[key] = LeafSpec(np.dtype(t.to_pandas_dtype()), ())
        else:
            raise InvalidStoreError(
                f"{data_dir}: leaf {key!r} is an Arrow column of type {t}, which grain_replay does "
                "not read (strings, text spaces, variable-length lists). Fix: for an info, read "
                "with infos=False; else record the data as a numeric space."
            )
        offsets[key] = offset
        columns[key] = path
        return dict(_LEAF)

    for name, column, offset in fields:
        if column not in first.column_names:
            if column == "infos":
                continue
            raise InvalidStoreError(
                f"{files[0][0]}: the Arrow table has no {column!r} column (columns: "
                f"{first.column_names}); a Minari episode holds observations, actions, rewards, "
                "terminations and truncations. The folder is not a Minari dataset or is corrupt."
            )
        node = visit(_combined(first.column(column)), name, (column,), spaces.get(column), offset)
        if node.get("type") in ("dict", "tuple") and not node["children"]:
            continue
        top_keys.append(name)
        children.append(node)
    treedef = {"type": "dict", "keys": top_keys, "children": children}
    total = int(lengths.sum())
    locations = {k: "/".join(v) for k, v in columns.items()}
    return Layout(total, spec, treedef, locations), offsets, columns, jpeg, lengths


def _numeric(t: Any) -> bool:
    pa = pyarrow()
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


class _ArrowLeafReader(LeafReader):
    """Rows of one numeric leaf: per episode touched, one numpy gather from the mapped column."""

    def __init__(self, handle: ArrowEpisodeHandle, key: str, offset: int, spec: LeafSpec):
        self._h = handle
        self._key = key
        self._offset = offset
        self._spec = spec

    def take(self, indices: np.ndarray) -> np.ndarray:
        h = self._h
        dense = h.dense(self._key)
        if dense is not None:
            # Step i of episode e is row i + e of the episodes' rows laid end to end
            # (each earlier episode has one row more than steps).
            episode = np.searchsorted(h.ends, indices, side="right")
            return np.take(dense, indices + episode + self._offset, axis=0)
        out = np.empty((len(indices), *self._spec.shape), dtype=self._spec.dtype)
        for ep, sel, local in h.by_episode(indices, self._offset):
            out[sel] = np.take(h.column(self._key, ep), local, axis=0)
        return out


class _ArrowJpegReader(_ArrowLeafReader):
    """Rows of a JPEG-encoded image leaf: each distinct requested frame decoded once."""

    def take(self, indices: np.ndarray) -> np.ndarray:
        h = self._h
        shape = tuple(self._spec.shape)
        out = np.empty((len(indices), *shape), dtype=np.uint8)
        for ep, sel, local in h.by_episode(indices, self._offset):
            blobs = h.column(self._key, ep)
            rows, inverse = np.unique(local, return_inverse=True)
            frames = decode_jpegs(
                [blobs[int(r)].as_buffer() for r in rows], shape, h.where(ep), self._key
            )
            out[sel] = frames[inverse.reshape(-1)]
        return out


class ArrowEpisodeHandle(Handle):
    """An open Arrow-format Minari dataset: episode tables mapped on first use, readers.

    Each episode file is memory-mapped when the handle opens (its length is
    checked against the source's) and its descriptor closed at once, so a
    dataset of many episodes holds no descriptor. Numeric columns are numpy
    views of the maps (booleans, bit-packed in Arrow, are unpacked once per
    episode).
    """

    def __init__(
        self,
        data_dir: str,
        num_steps: int,
        num_episodes: int,
        layout: Layout,
        offsets: dict[str, int],
        columns: dict[str, tuple[str, ...]],
        jpeg: Sequence[str],
        dense_bytes: int = 0,
    ):
        self.path = data_dir
        self.files = episode_files(data_dir)
        # Every episode's table is mapped here (no copy): its length, and it is read later.
        self._tables: dict[int, Any] = {e: read_table(f) for e, f in enumerate(self.files)}
        lengths = np.array([t.num_rows - 1 for t in self._tables.values()], dtype=np.int64)
        if len(lengths) != num_episodes or int(lengths.sum()) != num_steps:
            raise InvalidStoreError(
                f"{data_dir}: the dataset changed since the source was made ({len(lengths)} "
                f"episodes, {int(lengths.sum())} steps now; {num_episodes} and {num_steps} "
                "before). Fix: create the source again, or call refresh()."
            )
        self.ends = np.cumsum(lengths)
        self.starts = self.ends - lengths
        self._columns = columns
        self._spec = layout.spec
        # Numeric leaves laid end to end in memory while they fit dense_bytes together.
        self._dense: dict[str, np.ndarray | None] = {}
        self._dense_left = int(dense_bytes)
        self._arrays: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self.episodes: Any = None
        self.readers: dict[str, LeafReader] = {
            key: (_ArrowJpegReader if key in jpeg else _ArrowLeafReader)(
                self, key, offsets[key], layout.spec[key]
            )
            for key in layout.spec
        }

    def where(self, ep: int) -> str:
        return os.path.join(self.path, str(ep))

    def by_episode(
        self, indices: np.ndarray, offset: int
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(episode, positions in indices, rows in that episode's table)`` per episode."""
        if len(indices) == 0:
            return []
        episode = np.searchsorted(self.ends, indices, side="right")
        local = indices - self.starts[episode] + offset
        return [(ep, pos, local[pos]) for ep, pos in runs(episode)]

    def _table(self, ep: int) -> Any:
        return self._tables[ep]

    def column(self, key: str, ep: int) -> Any:
        """Leaf ``key`` of episode ``ep``: a numpy array of all its rows (JPEG: the binary
        Arrow array)."""
        got = self._arrays.get((key, ep))
        if got is not None:
            return got
        with self._lock:
            got = self._arrays.get((key, ep))
            if got is not None:
                return got
            path = self._columns[key]
            array = _combined(self._table(ep).column(path[0]))
            for name in path[1:]:
                array = _children(array)[name]
            spec = self._spec[key]
            pa = pyarrow()
            if pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type):
                got = array
            else:
                flat = array.flatten() if pa.types.is_fixed_size_list(array.type) else array
                values = flat.to_numpy(zero_copy_only=False)
                try:
                    got = values.reshape(len(array), *spec.shape).astype(spec.dtype, copy=False)
                except ValueError as e:
                    raise InvalidStoreError(
                        f"{self.where(ep)}: leaf {key!r} of episode {ep} has {values.size} values "
                        f"for {len(array)} rows of shape {spec.shape} (as in episode 0). Fix: "
                        "leave the leaf out with keys=[...]."
                    ) from e
            self._arrays[(key, ep)] = got
            return got

    def dense(self, key: str) -> np.ndarray | None:
        """Leaf ``key``'s rows of every episode in one array (a batch is then one gather), or
        None when it does not fit what is left of ``dense_bytes``."""
        if key in self._dense:
            return self._dense[key]
        spec = self._spec[key]
        rows = int(self.ends[-1]) + len(self.ends) if len(self.ends) else 0
        nbytes = rows * spec.dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64))
        got = None
        if nbytes <= self._dense_left:
            parts = [self.column(key, ep) for ep in range(len(self.ends))]
            with self._lock:
                if key not in self._dense:
                    self._dense_left -= nbytes
                    self._dense[key] = np.concatenate(parts) if parts else None
                    # The per-episode arrays are not needed any more.
                    for ep in range(len(self.ends)):
                        self._arrays.pop((key, ep), None)
                got = self._dense[key]
        else:
            self._dense[key] = None
        return got

    def last_terminations(self) -> np.ndarray:
        """Per episode, whether its last step terminated."""
        out = np.zeros(len(self.ends), dtype=bool)
        for ep in range(len(self.ends)):
            steps = int(self.ends[ep] - self.starts[ep])
            if steps:
                term = _combined(self._table(ep).column("terminations"))
                out[ep] = bool(term[steps - 1].as_py())
        return out

    def close(self) -> None:
        self.readers = {}
        self._dense = {}
        self._arrays = {}
        self._tables = {}
