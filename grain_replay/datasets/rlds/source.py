"""RLDSDataSource: a TFDS-built RLDS dataset read in place, step by step, without TensorFlow."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.datasets.rlds.arrayrecord import RecordCache
from grain_replay.datasets.rlds.features import STEPS, Feature, read_dataset_json, read_features
from grain_replay.datasets.rlds.frames import SLOT_HEADER, FrameCache, open_frame_cache
from grain_replay.datasets.rlds.images import decoder_name
from grain_replay.datasets.rlds.index import Index, build_index, cache_dirs
from grain_replay.datasets.rlds.readers import Shards, make_reader
from grain_replay.errors import InvalidArgumentError, InvalidStoreError, StoreNotFoundError
from grain_replay.rl.episode_index import EpisodeIndex
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.reading.readers import Handle
from grain_replay.store.formats import is_url, shown_path
from grain_replay.store.layout import LeafSpec

__all__ = ["DEFAULT_FRAME_CACHE_BYTES", "RLDSDataSource", "dataset_shards"]

logger = logging.getLogger(__name__)

DEFAULT_FRAME_CACHE_BYTES = 16 * 2**30

_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"


def dataset_shards(root: str, split: str | None) -> tuple[str, list[str], str]:
    """``(split, shard paths in TFDS's read order, file format)`` from ``dataset_info.json``.

    Raises:
      StoreNotFoundError: no ``dataset_info.json``, or a shard it lists is missing.
      InvalidStoreError: the split is unknown, or the file format is not read here.
    """
    where, info = read_dataset_json(root, "dataset_info.json")
    splits = {s.get("name"): s for s in info.get("splits", [])}
    if split is None:
        split = "train" if "train" in splits or len(splits) != 1 else next(iter(splits))
    if split not in splits:
        raise InvalidArgumentError(
            f"{where}: the dataset has no split {split!r}; its splits are {sorted(splits)}. "
            "Fix: pass split= with one of them."
        )
    fmt = str(info.get("fileFormat") or "tfrecord")
    if fmt not in ("tfrecord", "array_record"):
        raise InvalidStoreError(
            f"{where}: the shards are {fmt!r} files; RLDSDataSource reads TFRecord and "
            "ArrayRecord shards. Fix: rebuild the dataset with file_format='tfrecord'."
        )
    entry = splits[split]
    lengths = [int(n) for n in entry.get("shardLengths", [])]
    template = entry.get("filepathTemplate") or _TEMPLATE
    n = len(lengths)
    paths = []
    for i in range(n):
        name = (
            template.replace("{DATASET}", str(info.get("name", "")))
            .replace("{SPLIT}", split)
            .replace("{FILEFORMAT}", fmt)
            .replace("{SHARD_X_OF_Y}", f"{i:05d}-of-{n:05d}")
            .replace("{SHARD_INDEX}", f"{i:05d}")
            .replace("{NUM_SHARDS}", f"{n:05d}")
        )
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise StoreNotFoundError(
                f"{shown_path(path)}: shard {i} of {n} of split {split!r} (listed in {where}) is "
                "missing. "
                "Fix: copy the whole dataset folder."
            )
        paths.append(path)
    return split, paths, fmt


class _RLDSHandle(Handle):
    def __init__(
        self,
        index: Index,
        features: Sequence[Feature],
        sizes: Sequence[int],
        fmt: str,
        record_cache_bytes: int,
    ):
        self.shards: Shards | RecordCache = (
            RecordCache(index.shards, record_cache_bytes)
            if fmt == "array_record"
            else Shards(index.shards, sizes)
        )
        self.readers = {f.key: make_reader(f, index, self.shards) for f in features}
        self.frames: list[FrameCache] = []

    def close(self) -> None:
        self.shards.close()
        for frames in self.frames:
            frames.close()


def _treedef(keys: Sequence[str]) -> dict[str, Any]:
    return tree_lib.treedef_from_keys({k: None for k in keys})


class RLDSDataSource(ReplaySource):
    """An RLDS dataset, as TFDS builds it, read in place as a grain source of steps.

    No TensorFlow: the TFRecord shards are framed and CRC32C-checked here, and
    each ``tf.train.Example`` (one episode) is parsed from its protobuf wire
    format once, into an index of where each step's values sit. Records are
    the steps of every episode, in TFDS's read order (shard by shard, records
    in file order). Leaves are keyed by the step features' RLDS paths
    (``observation/image``, ``action``, ``reward``, ``discount``, ``is_first``,
    ``is_last``, ``is_terminal``, ``language_instruction``, ...), with the
    dtypes and shapes ``features.json`` declares: images (JPEG/PNG) come
    decoded as ``uint8 (H, W, C)``, decoded in the process that reads the
    batch; text comes as numpy bytes ``S<width>`` (the widest value in the
    dataset); bools, ints and floats as declared (float64 features are
    stored as float32 by TFDS and cast back, as TFDS does). Episode-level
    features (``episode_metadata/<name>``) are leaves too, repeated on each
    step of their episode, but only when named in ``keys=``.

    A batch reads only the bytes of its steps (one ``pread`` per step and leaf
    at the indexed offsets); memory is the index (see :class:`~grain_replay.
    sources.rlds.index.Index`: about 12 bytes per step per image or text leaf,
    the decoded flags, 17 bytes per episode per float leaf) plus the batch
    being read, whatever the dataset's size. The index is built once per
    shard, in threads with a progress bar, and cached beside the dataset in
    ``.grain_replay_rlds/`` or, when the folder is read-only, in
    ``~/.cache/grain_replay/rlds/<hash>/`` (``$XDG_CACHE_HOME`` respected).

    Episodes come from the index (``episode_ends``, ``episode_terminated``:
    ``is_terminal`` on the last step), so ``gr.SequenceDataSource``, windows,
    n-step views, mixtures and prioritized replay work on it unchanged.

    Args:
      path: the dataset version folder (holding ``dataset_info.json``,
        ``features.json`` and the ``<name>-<split>.tfrecord-XXXXX-of-YYYYY`` shards).
      keys: leaves (or groups such as ``"observation"``) to read; default every
        step feature.
      split: the TFDS split (default ``"train"``).
      check_crc: check both CRC32Cs of every record while indexing.
      progress: show a progress bar while indexing several shards.
      record_cache_bytes: ArrayRecord shards only (TFDS's ``file_format="array_record"``,
        read with the array_record package): an ArrayRecord record is compressed whole,
        so each episode a batch touches is read once and kept in a per-process cache of
        this many bytes, shared by the leaves.
      frame_cache_bytes: disk for decoded frames (see :mod:`~grain_replay.datasets.rlds.
        frames`): each step-level image leaf whose frames fit in what is left of this
        budget gets a file beside the index; a step's images are decoded the first time
        any process reads it and read back from there after. 0 turns it off (every read
        decodes). The file is reserved when made and read with ``pread`` (no map: host
        RSS does not grow with it).

    Raises:
      StoreNotFoundError: no dataset at ``path``, or a shard missing.
      InvalidStoreError: a bad CRC or truncated record (file, byte offset), a
        feature type not read here (named), a record that does not match
        ``features.json``; on reads, an image that does not decode (file,
        episode, step, feature).

    Examples:
      >>> src = gr.RLDSDataSource("~/tensorflow_datasets/bridge/1.0.0",
      ...                         keys=["observation/image", "action", "is_last"])
      >>> batch = src.read_batch(np.arange(256))
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {**ReplaySource._PER_PROCESS, "_index": None}

    def __init__(
        self,
        path: str | os.PathLike[str],
        keys: Sequence[str] | str | None = None,
        *,
        split: str | None = None,
        check_crc: bool = True,
        progress: bool = True,
        record_cache_bytes: int = 256 * 2**20,
        frame_cache_bytes: int = DEFAULT_FRAME_CACHE_BYTES,
    ):
        path = os.path.expanduser(os.fspath(path))
        if is_url(path):
            raise InvalidArgumentError(
                f"{path}: RLDSDataSource reads datasets on the local file system. Fix: copy "
                "the dataset folder to a local disk first (e.g. gsutil -m cp -r)."
            )
        if record_cache_bytes < 0:
            raise InvalidArgumentError(f"record_cache_bytes must be >= 0, got {record_cache_bytes}")
        self._record_cache_bytes = int(record_cache_bytes)
        if frame_cache_bytes < 0:
            raise InvalidArgumentError(
                f"frame_cache_bytes must be >= 0 (0: no decoded-frame cache), got "
                f"{frame_cache_bytes}"
            )
        self._frame_cache_bytes = int(frame_cache_bytes)
        self._split_arg = split
        self._check_crc = bool(check_crc)
        self._progress = bool(progress)
        self._index: Index | None = None
        super().__init__(path, keys)

    # -- layout -----------------------------------------------------------------

    def _inspect(self) -> Layout:
        root = self._path
        if not os.path.isdir(root):
            raise StoreNotFoundError(f"No RLDS dataset at {shown_path(root)}. Fix: check the path.")
        self._features = read_features(root)
        self._split, self._shards, self._format = dataset_shards(root, self._split_arg)
        self._sizes = [os.path.getsize(p) for p in self._shards]
        chosen = self._chosen(self._features)
        # Every feature is indexed (one cache serves every keys=); only chosen ones are read.
        self._indexed = list(self._features)
        index = self._get_index()
        spec: dict[str, LeafSpec] = {}
        for f in self._features:
            if f.level != STEPS and f not in chosen:
                continue  # episode features: only when asked for
            dtype = f.dtype
            if f.kind == "text" and f in self._indexed:
                lens = index.arrays[f.key + "#len"]
                dtype = np.dtype(f"S{max(1, int(lens.max()) if lens.size else 1)}")
            spec[f.key] = LeafSpec(dtype, f.shape)
        treedef = _treedef(list(spec))
        keys = tree_lib.leaf_keys(treedef)  # nested dicts, keys sorted as TFDS sorts them
        return Layout(index.num_steps, {k: spec[k] for k in keys}, treedef, {k: k for k in keys})

    def _chosen(self, features: list[Feature]) -> list[Feature]:
        """The step features, and the episode features ``keys=`` names."""
        want = self._requested_keys or []
        return [
            f
            for f in features
            if f.level == STEPS
            or any(f.key == k or f.key.startswith(k.rstrip("/") + "/") for k in want)
        ]

    def _get_index(self) -> Index:
        return self._per_process("_index", self._make_index)

    def _make_index(self) -> Index:
        return build_index(
            self._path,
            self._shards,
            self._indexed,
            check_crc=self._check_crc,
            progress=self._progress,
            fmt=self._format,
        )

    def _open(self) -> Handle:
        index = self._index if self._index is not None else self._make_index()
        self._index = index
        feats = [f for f in self._indexed if f.key in self._layout.spec]
        handle = _RLDSHandle(index, feats, self._sizes, self._format, self._record_cache_bytes)
        try:
            self._attach_frames(handle, index, feats)
        except BaseException:
            handle.close()
            raise
        return handle

    def _attach_frames(self, handle: _RLDSHandle, index: Index, feats: list[Feature]) -> None:
        """Opens (or creates) the decoded-frame cache of each step-level image leaf that
        fits in what is left of ``frame_cache_bytes``."""
        left = self._frame_cache_bytes
        images = [f for f in feats if f.kind == "image" and f.level == STEPS]
        if not left or not images:
            return
        base = json.dumps(
            {
                "shards": [
                    [os.path.basename(p), st.st_size, st.st_mtime_ns]
                    for p, st in ((p, os.stat(p)) for p in self._shards)
                ],
                "split": self._split,
                "steps": index.num_steps,
                "decoders": decoder_name(),
            }
        )
        for f in images:
            frame_bytes = f.dtype.itemsize * f.size
            need = 4096 + index.num_steps * (SLOT_HEADER + frame_bytes)
            if need > left:
                logger.info(
                    "%s: leaf %r: its decoded frames take %s bytes, more than the %s left of "
                    "frame_cache_bytes; its images are decoded on every read. Fix: raise "
                    "frame_cache_bytes to cache them.",
                    self._path,
                    f.key,
                    f"{need:,}",
                    f"{left:,}",
                )
                continue
            signature = json.dumps([base, f.key, f.name, f.dtype.str, list(f.shape)])
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f.key)[:64]
            digest = hashlib.sha1(f.key.encode()).hexdigest()[:8]
            name = f"frames-{self._split}-{safe}-{digest}.bin"
            frames = open_frame_cache(
                cache_dirs(self._path), name, signature, index.num_steps, frame_bytes
            )
            if frames is None:
                continue
            left -= need
            handle.frames.append(frames)
            reader = handle.readers[f.key]
            reader.frames = frames  # type: ignore[attr-defined]

    # -- what the dataset says --------------------------------------------------

    @property
    def split(self) -> str:
        return self._split

    @property
    def shards(self) -> list[str]:
        """The shard files, in read order."""
        return list(self._shards)

    @property
    def features(self) -> list[Feature]:
        """Every feature of the dataset (step and episode level), as ``features.json`` says."""
        return list(self._features)

    @property
    def episode_ends(self) -> np.ndarray:
        """``(E,)`` int64, the exclusive end step of each episode, in record order."""
        return self._get_index().ends.copy()

    @property
    def episode_terminated(self) -> np.ndarray:
        """``(E,)`` bool, ``is_terminal`` on each episode's last step (False without it)."""
        index = self._get_index()
        values = index.arrays.get("is_terminal#val")
        if values is None or values.size != index.num_steps:
            return np.zeros(len(index.ends), bool)
        return values.reshape(-1)[index.ends - 1] != 0

    @property
    def episodes(self) -> EpisodeIndex:
        """The :class:`~grain_replay.rl.EpisodeIndex` of the steps, one per RLDS episode.

        Built from the dataset's index (no extra read): an episode counts as terminated when
        ``is_terminal`` is set on its last step, as :attr:`episode_terminated` says.
        """
        return EpisodeIndex(self.episode_ends, self.episode_terminated)

    def __repr__(self) -> str:
        return (
            f"RLDSDataSource(path={self._path!r}, split={self._split!r}, keys={self._keys!r}, "
            f"num_records={len(self)})"
        )
