"""Minari datasets (HDF5 ``episode_k`` groups, or Arrow files per episode) as transition sources."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.datasets.minari.arrow import ArrowEpisodeHandle, arrow_layout, episode_files
from grain_replay.datasets.minari.episode_files import EpisodeFileHandle, episode_names
from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.rl.episodes import EpisodeIndex
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES
from grain_replay.sources.reading.readers import Handle
from grain_replay.store import layout as layout_lib
from grain_replay.store.formats import HDF5_SIGNATURE, import_h5py, shown_path
from grain_replay.store.layout import LeafSpec

__all__ = ["MinariDataSource"]

logger = logging.getLogger(__name__)

_MAIN_FILE = "main_data.hdf5"
_TUPLE_ITEM = re.compile(r"_index_(\d+)")
# Field -> row offset inside the episode's dataset (observations have one more row).
_FIELDS = (
    ("observations", "observations", 0),
    ("actions", "actions", 0),
    ("rewards", "rewards", 0),
    ("terminations", "terminations", 0),
    ("truncations", "truncations", 0),
    ("next_observations", "observations", 1),
)
_LEAF = {"type": "leaf"}


def _walk(obj: Any, key: str, loc: str) -> tuple[dict[str, Any], list[tuple[str, str, Any]]] | None:
    """Tree node and ``(key, location, dataset)`` leaves of a Minari space group.

    Minari writes a Dict space as a subgroup per key and a Tuple space as
    subgroups ``_index_0``, ``_index_1``, ...: they become dicts (keys sorted,
    as gymnasium orders Dict spaces) and tuples.
    """
    h5py = import_h5py()
    if isinstance(obj, h5py.Dataset):
        return dict(_LEAF), [(key, loc, obj)]
    names = list(obj.keys())
    if not names:
        return None
    items = sorted(int(m.group(1)) for n in names if (m := _TUPLE_ITEM.fullmatch(n)))
    is_tuple = items == list(range(len(names)))
    if is_tuple:
        pairs = [(str(i), f"_index_{i}") for i in items]
    else:
        pairs = [(n, n) for n in sorted(names)]
    children, leaves, keys = [], [], []
    for name, sub in pairs:
        got = _walk(obj[sub], f"{key}/{name}", f"{loc}/{sub}")
        if got is not None:
            keys.append(name)
            children.append(got[0])
            leaves.extend(got[1])
    if not children:
        return None
    if is_tuple and len(keys) == len(pairs):
        return {"type": "tuple", "children": children}, leaves
    return {"type": "dict", "keys": keys, "children": children}, leaves


def _resolve(path: str) -> tuple[str, str]:
    """``(format, path)``: ``("hdf5", main_data.hdf5)`` or ``("arrow", the data folder)``."""
    if os.path.isdir(path):
        for cand in (os.path.join(path, "data", _MAIN_FILE), os.path.join(path, _MAIN_FILE)):
            if os.path.isfile(cand):
                return "hdf5", cand
        for data in (os.path.join(path, "data"), path):
            meta = os.path.join(data, "metadata.json")
            fmt = _read_json(meta).get("data_format") if os.path.exists(meta) else None
            if fmt == "arrow":
                return "arrow", data
            if fmt not in (None, "hdf5"):
                raise InvalidStoreError(
                    f"{path}: the Minari dataset is stored as {fmt!r}; MinariDataSource reads "
                    "the 'hdf5' and 'arrow' formats. Fix: re-create it with "
                    "DataCollector(..., data_format='arrow') or 'hdf5'."
                )
        raise StoreNotFoundError(
            f"No Minari dataset at {shown_path(path)} (no data/{_MAIN_FILE}, no "
            "data/metadata.json of an "
            "Arrow dataset). Fix: pass the dataset folder (e.g. "
            "~/.minari/datasets/<namespace>/<name>-v0), its data folder or data/main_data.hdf5."
        )
    if not os.path.exists(path):
        raise StoreNotFoundError(f"No Minari dataset at {shown_path(path)}. Fix: check the path.")
    with open(path, "rb") as f:
        if f.read(8) != HDF5_SIGNATURE:
            raise InvalidStoreError(f"{path} is not an HDF5 file (no HDF5 signature).")
    return "hdf5", path


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def _spaces(meta: dict[str, Any]) -> dict[str, Any]:
    """``{"observations": space, "actions": space}`` from the metadata's JSON space strings."""
    out = {}
    for field, column in (("observation_space", "observations"), ("action_space", "actions")):
        raw = meta.get(field)
        try:
            out[column] = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            continue
    return out


def _image_spaces(spaces: dict[str, Any], tuple_item: str) -> dict[str, tuple[int, ...]]:
    """Locations of the spaces Minari JPEG-encodes (uint8 Box images >= 32x32 in 0..255)
    -> their shapes; a Tuple's item ``i`` is the location part ``tuple_item.format(i)``."""
    found: dict[str, tuple[int, ...]] = {}

    def visit(space: Any, loc: str) -> None:
        if not isinstance(space, dict):
            return
        shape = space.get("shape") or []
        if (
            space.get("type") == "Box" and space.get("dtype") == "uint8"
            and len(shape) in (2, 3) and shape[0] >= 32 and shape[1] >= 32
            and np.all(np.asarray(space.get("low", 0)) == 0)
            and np.all(np.asarray(space.get("high", 255)) == 255)
        ):  # fmt: skip
            found[loc] = tuple(int(d) for d in shape)
        subs = space.get("subspaces")
        if isinstance(subs, dict):
            for k, v in subs.items():
                visit(v, f"{loc}/{k}")
        elif isinstance(subs, list):
            for i, v in enumerate(subs):
                visit(v, f"{loc}/{tuple_item.format(i)}")

    for column, space in spaces.items():
        visit(space, column)
    return found


class MinariDataSource(ReplaySource):
    """A Minari dataset (HDF5 or Arrow format) as a random-access source of flat transitions.

    Reads Minari's files in place, without conversion. Record ``i`` is step
    ``t`` of episode ``e`` (episodes in numeric order, ``episode_10`` after
    ``episode_9``; steps of episode 0 first) with Minari's field names::

        {"observations": obs[t], "actions": a[t], "rewards": r[t],
         "terminations": term[t], "truncations": trunc[t],
         "next_observations": obs[t + 1]}

    Minari stores one more observation than actions per episode, so
    ``next_observations`` is always a real observation (also after a
    truncation). Dict observation/action spaces become nested dicts (keys
    sorted, as gymnasium orders them) and Tuple spaces tuples, mirroring
    Minari's ``_index_<i>`` subgroups. With ``infos=True`` the recorded infos
    are added as ``infos/...``: the info returned by the step (Minari's info
    row ``t + 1``).

    Image spaces (uint8 ``Box`` frames of at least 32x32 in 0..255), which
    ``minari.DataCollector`` JPEG-encodes by default, are decoded with Pillow
    (Minari's own decoder: bit-identical frames) in the process that reads the
    batch, once per distinct frame of a batch.

    HDF5: a batch's steps are grouped by episode; each episode's dataset is
    read whole with one h5py call (cached, bounded by ``cache_bytes``) or, when
    it is large, only the needed rows. One h5py file handle per process.
    Arrow (``data_format="arrow"``: ``data/<episode>/part-0.arrow``): every
    episode file is memory-mapped when the handle opens (no descriptor kept);
    numeric leaves are laid end to end in memory on first use while they fit
    ``cache_bytes`` together (a batch is then one numpy gather per leaf), else
    gathered from numpy views of the maps with one call per episode touched.

    Args:
      path: the dataset folder (holding ``data/main_data.hdf5`` or an Arrow
        dataset's ``data/metadata.json``), its ``data`` folder, or the
        ``main_data.hdf5`` file.
      keys: leaves (or groups) to read; default all.
      infos: add the recorded infos.
      cache_bytes: bound of the per-process cache of decoded episode data.

    Attributes:
      episodes: the :class:`EpisodeIndex` of the records.

    Raises:
      StoreNotFoundError: no Minari dataset at ``path``.
      InvalidStoreError: not a Minari dataset, no episodes, Minari's parquet
        format, string leaves, undecodable frames, or inconsistent episodes;
        each message names the fix.
      MissingDependencyError: pyarrow (Arrow format) or Pillow (JPEG frames)
        is not installed.

    Examples:
      >>> src = gr.MinariDataSource("~/.minari/datasets/mujoco/hopper/expert-v0")
      >>> src.read_batch([0, 1])["next_observations"].shape
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | str | None = None,
        *,
        infos: bool = False,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ):
        self._infos = bool(infos)
        self._cache_bytes = cache_bytes
        super().__init__(os.path.expanduser(os.fspath(path)), keys)

    def _open(self) -> Handle:
        if self._format == "arrow":
            return ArrowEpisodeHandle(
                self._path, len(self), self._num_episodes, self._layout, self._offsets,
                self._columns, self._jpeg, int(self._cache_bytes),
            )  # fmt: skip
        return EpisodeFileHandle(
            self._path, len(self), self._num_episodes, self._layout, self._offsets,
            self._cache_bytes, self._jpeg,
        )  # fmt: skip

    def _inspect(self) -> Layout:
        self._format, self._path = _resolve(self._path)
        data_dir = self._path if self._format == "arrow" else os.path.dirname(self._path)
        meta = _read_json(os.path.join(data_dir, "metadata.json"))
        spaces = _spaces(meta)
        encoded = bool(meta.get("jpeg_encoding", True))
        if self._format == "arrow":
            return self._arrow_layout(spaces, _image_spaces(spaces, "{}") if encoded else {})
        self._images = _image_spaces(spaces, "_index_{}") if encoded else {}
        h5py = import_h5py()
        try:
            with h5py.File(self._path, "r") as f:
                return self._layout_of(f)
        except OSError as e:
            raise InvalidStoreError(
                f"{self._path}: h5py cannot open the file ({e}). It may be truncated or "
                "corrupt. Fix: download or create the dataset again."
            ) from e

    def _layout_of(self, f: Any) -> Layout:
        names = episode_names(f)
        if not names:
            raise InvalidStoreError(
                f"{self._path}: the Minari file holds no episode_<k> group. Fix: add episodes "
                "with DataCollector before reading it."
            )
        first = f[names[0]]
        n = sum(int(f[k]["rewards"].shape[0]) for k in names)
        fields = list(_FIELDS)
        if self._infos and "infos" in first:
            fields.append(("infos", "infos", 1))
        spec: dict[str, LeafSpec] = {}
        locations: dict[str, str] = {}
        self._offsets: dict[str, int] = {}
        self._jpeg: list[str] = []
        top_keys, children = [], []
        for field, loc, offset in fields:
            if loc not in first:
                raise InvalidStoreError(
                    f"{self._path}: {names[0]} has no {loc!r}; a Minari episode holds "
                    "observations, actions, rewards, terminations and truncations. The file "
                    "is not a Minari dataset or is corrupt."
                )
            got = _walk(first[loc], field, loc)
            if got is None:
                continue
            node, leaves = got
            top_keys.append(field)
            children.append(node)
            for key, where, dset in leaves:
                image = self._images.get(where)
                if image is not None and tuple(dset.shape[1:]) != image:
                    # JPEG-encoded frames: variable-length uint8 rows, or a 2-D uint8 array
                    # when every frame happened to encode to the same number of bytes.
                    spec[key] = LeafSpec(np.dtype(np.uint8), image)
                    self._jpeg.append(key)
                else:
                    dtype = layout_lib.check_dtype(dset.dtype, key, self._path)
                    spec[key] = LeafSpec(dtype, tuple(dset.shape[1:]))
                locations[key] = where
                self._offsets[key] = offset
        self._num_episodes = len(names)
        treedef = {"type": "dict", "keys": top_keys, "children": children}
        return Layout(n, spec, treedef, locations)

    def _arrow_layout(self, spaces: dict[str, Any], images: dict[str, tuple[int, ...]]) -> Layout:
        files = episode_files(self._path)
        if not files or not all(files):
            raise InvalidStoreError(
                f"{self._path}: the Arrow-format Minari dataset holds no episode (folders "
                "<k>/ with .arrow files). Fix: add episodes with DataCollector before reading it."
            )
        fields = list(_FIELDS) + ([("infos", "infos", 1)] if self._infos else [])
        layout, self._offsets, self._columns, self._jpeg, _ = arrow_layout(
            self._path, files, fields, spaces, images
        )
        self._num_episodes = len(files)
        return layout

    @property
    def format(self) -> str:
        """The dataset's Minari storage format: ``"hdf5"`` or ``"arrow"``."""
        return self._format

    @property
    def episodes(self) -> EpisodeIndex:
        """The :class:`EpisodeIndex` of the records (one per Minari episode).

        An episode counts as terminated when its last ``terminations`` flag is set.
        """
        h = self._get_handle()
        assert isinstance(h, (EpisodeFileHandle, ArrowEpisodeHandle))
        if h.episodes is None:
            with self._lock:
                if h.episodes is None:
                    if isinstance(h, ArrowEpisodeHandle):
                        last = h.last_terminations().tolist()
                    else:
                        last = [
                            bool(g["terminations"][int(e - s) - 1]) if e > s else False
                            for g, s, e in zip(h.groups, h.starts, h.ends)
                        ]
                    lengths = h.ends - h.starts
                    keep = lengths > 0
                    h.episodes = EpisodeIndex.from_lengths(
                        lengths[keep], np.array(last, dtype=bool)[keep]
                    )
        return h.episodes

    def __repr__(self) -> str:
        return (
            f"MinariDataSource(path={self._path!r}, keys={self._keys!r}, "
            f"infos={self._infos}, num_records={len(self)})"
        )
