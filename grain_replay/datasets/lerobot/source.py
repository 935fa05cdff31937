"""LeRobotDataSource: a LeRobot dataset directory as a grain source of frames or sequences."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.datasets.lerobot.handle import FrameHandle
from grain_replay.datasets.lerobot.meta import (
    IMAGE,
    STRING,
    VIDEO,
    camera_shape,
    read_meta,
)
from grain_replay.errors import ArgumentTypeError, InvalidArgumentError, InvalidStoreError
from grain_replay.rl.episodes import EpisodeIndex
from grain_replay.rl.sequence_spec import frame_offset
from grain_replay.sources.base import Layout, ReplaySource
from grain_replay.sources.reading.cache import DEFAULT_CACHE_BYTES
from grain_replay.sources.reading.readers import Handle, read_windows_as_rows
from grain_replay.store.layout import LeafSpec

__all__ = ["LeRobotDataSource", "DEFAULT_TOLERANCE_S", "DEFAULT_FRAME_CACHE_BYTES"]

# LeRobotDataset's default: a video frame matches a timestamp within 0.1 ms.
DEFAULT_TOLERANCE_S = 1e-4
DEFAULT_FRAME_CACHE_BYTES = 64 * 2**20


def _leaf_spec(key: str, ft: Mapping[str, Any], where: str) -> LeafSpec:
    shape = tuple(int(s) for s in ft.get("shape", ()))
    try:
        dtype = np.dtype(ft["dtype"])
    except (TypeError, KeyError) as e:
        raise InvalidStoreError(
            f"{where}: feature {key!r} has dtype {ft.get('dtype')!r}, which is not a numpy "
            "dtype. Fix: leave it out with keys=[...]."
        ) from e
    # LeRobot stores shape-(1,) features as scalar columns and returns them as scalars.
    return LeafSpec(dtype, () if shape == (1,) else shape)


def _seconds(delta: Any, path: Any) -> dict[str, list[float]]:
    """``delta_timestamps`` as ``{key: [float seconds]}``, or ArgumentTypeError naming the fix."""
    try:
        if not isinstance(delta, Mapping) or any(
            isinstance(v, (str, bytes)) for v in delta.values()
        ):
            raise TypeError(type(delta).__name__)
        return {str(k): [float(x) for x in v] for k, v in delta.items()}
    except (TypeError, ValueError) as e:
        raise ArgumentTypeError(
            f"{os.fspath(path)}: delta_timestamps must map feature names to lists of seconds, "
            f"got {delta!r}. Fix: e.g. delta_timestamps={{'action': [0.0, 0.1, 0.2]}}."
        ) from e


class LeRobotDataSource(ReplaySource):
    """A LeRobot dataset directory (v3.0, or v2.1/v2.0) read in place as a grain source.

    Records are frames, numbered as ``LeRobotDataset`` numbers them. A record
    is a flat dict keyed by LeRobot's own feature names, in info.json order:
    numeric features (``"observation.state"``, ``"action"``, ``"timestamp"``,
    ``"frame_index"``, ``"episode_index"``, ``"index"``, ``"task_index"``, ...)
    with their info.json dtype and shape (shape ``(1,)`` features are scalars,
    as LeRobot returns them), and every camera (``video`` or ``image``
    feature) as a uint8 ``(H, W, 3)`` RGB frame. LeRobot hands out the same frame as float32
    ``(3, H, W)`` in [0, 1]; the two are related exactly by::

        lerobot_frame == torch.from_numpy(frame).permute(2, 0, 1).float() / 255

    so a model trained on LeRobot's tensors gets them back with
    ``jnp.moveaxis(frame, -1, -3) / 255``. The task of a frame is its
    ``task_index``; the task strings are ``src.tasks[task_index]``.

    Numeric features are parquet columns: each data file's columns are decoded
    once per process into numpy blocks (whole files, or row groups of large
    files) kept in a byte-bounded cache, and a batch is one gather per feature.
    Camera frames are decoded with PyAV in the process that reads the batch:
    the batch's frames are grouped by video file and decoded in one sorted
    forward pass per file (seeking only past a keyframe interval); a frame is
    the one nearest ``from_timestamp + timestamp``, within ``tolerance_s`` as
    in ``LeRobotDataset``. Image features (PNG bytes in parquet, LeRobot's
    ``use_videos=False``) are decoded with PyAV frame by frame. Decoded frames
    are kept in a second bounded cache. Pickles small; opens one handle per
    file per process.

    With ``delta_timestamps`` (LeRobot's ``{key: [seconds, ...]}``), a record
    is what ``LeRobotDataset.__getitem__`` returns with the same argument:
    each listed key gets a leading time axis (frames at ``t + delta``, clamped
    to the episode, i.e. edge-padded) and a ``"<key>_is_pad"`` bool mask that
    is True where ``t + delta`` falls outside the episode. The frame source is
    then ``src.frames``.

    Args:
      path: the dataset's root folder (holding ``meta/info.json``).
      delta_timestamps: optional ``{feature: [seconds, ...]}``; each value a
        multiple of ``1 / fps`` (within ``tolerance_s``).
      keys: features to read; default all. Camera keys are decoded only when
        selected.
      tolerance_s: largest distance between a frame's timestamp and the video
        frame returned for it.
      cache_bytes: bound of the per-process cache of decoded numeric columns.
      frame_cache_bytes: bound of the per-process cache of decoded frames.

    Attributes:
      fps: frames per second (info.json).
      tasks: the task strings, indexed by ``task_index``.
      stats: ``meta/stats.json`` as ``{feature: {"mean": array, ...}}``.
      episodes: the :class:`EpisodeIndex` of the frames.

    Raises:
      StoreNotFoundError: no dataset at ``path``, or a metadata file missing.
      InvalidStoreError: an unsupported codebase_version (the message names
        LeRobot's conversion script) or inconsistent metadata; on reads, a
        missing or undecodable video or image, or a frame with no video frame
        at its timestamp (:class:`FrameTimestampError`), each naming the file,
        the camera and the episode or frame.
      InvalidArgumentError: a ``delta_timestamps`` value that is not a multiple
        of ``1 / fps`` or a key that names no feature read; a bad option.

    Examples:
      >>> src = gr.LeRobotDataSource("~/.cache/huggingface/lerobot/lerobot/pusht")
      >>> batch = src.read_batch(np.arange(256))
      >>> batch["observation.image"].shape, src.tasks[batch["task_index"][0]]
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        delta_timestamps: Mapping[str, Sequence[float]] | None = None,
        *,
        keys: Sequence[str] | str | None = None,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        frame_cache_bytes: int = DEFAULT_FRAME_CACHE_BYTES,
    ):
        if not tolerance_s > 0:
            raise InvalidArgumentError(f"tolerance_s must be positive, got {tolerance_s}")
        for name, value in (("cache_bytes", cache_bytes), ("frame_cache_bytes", frame_cache_bytes)):
            if value < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {value}")
        self._tolerance_s = float(tolerance_s)
        self._cache_bytes = cache_bytes
        self._frame_cache_bytes = int(frame_cache_bytes)
        self._delta = None if delta_timestamps is None else _seconds(delta_timestamps, path)
        self._frames: LeRobotDataSource | None = None
        self._seq: Any = None
        super().__init__(os.path.expanduser(os.fspath(path)), keys)

    # -- layout -----------------------------------------------------------------

    def _inspect(self) -> Layout:
        if self._delta is not None:
            return self._inspect_sequences(self._delta)
        self._meta = meta = read_meta(self._path)
        where = os.path.join(self._path, "meta", "info.json")
        spec: dict[str, LeafSpec] = {}
        self._image_keys: list[str] = []
        for key, ft in meta.features.items():
            kind = ft.get("dtype")
            if kind == VIDEO:
                spec[key] = LeafSpec(np.dtype(np.uint8), meta.cameras[key].shape)
            elif kind == IMAGE:
                spec[key] = LeafSpec(np.dtype(np.uint8), camera_shape(key, ft, where))
                self._image_keys.append(key)
            elif kind != STRING:
                spec[key] = _leaf_spec(key, ft, where)
        if "timestamp" not in spec:
            raise InvalidStoreError(f"{where}: no 'timestamp' feature; LeRobot writes one.")
        cams = set(meta.cameras) | set(self._image_keys)
        self._numeric_spec = {k: s for k, s in spec.items() if k not in cams}
        treedef = {
            "type": "dict",
            "keys": list(spec),
            "children": [{"type": "leaf"} for _ in spec],
        }
        return Layout(meta.num_frames, spec, treedef, {k: k for k in spec})

    def _inspect_sequences(self, delta: dict[str, list[float]]) -> Layout:
        from grain_replay.rl.sequence import PAD_SUFFIX, SequenceDataSource

        frames = LeRobotDataSource(
            self._path, keys=self._requested_keys, tolerance_s=self._tolerance_s,
            cache_bytes=self._cache_bytes, frame_cache_bytes=self._frame_cache_bytes,
        )  # fmt: skip
        offsets = self._offsets(delta, frames)
        self._meta = frames._meta
        self._frames = frames
        self._seq = SequenceDataSource(
            frames, offsets, fps=frames.fps, pad="edge", episodes=frames.episodes
        )
        # LeRobot's record: every feature, the delta keys with a time axis and a mask.
        seq_spec = self._seq.spec
        spec: dict[str, LeafSpec] = {}
        for key, leaf in frames.spec.items():
            if key in delta:
                spec[key] = seq_spec[key]
                spec[key + PAD_SUFFIX] = seq_spec[key + PAD_SUFFIX]
            else:
                spec[key] = leaf
        treedef = {"type": "dict", "keys": list(spec), "children": [{"type": "leaf"} for _ in spec]}
        return Layout(len(frames), spec, treedef, {k: k for k in spec})

    def _offsets(
        self, delta: Mapping[str, list[float]], frames: LeRobotDataSource
    ) -> dict[str, list[int]]:
        """``delta_timestamps`` in whole frames, converted once (LeRobot's ``round(dt * fps)``,
        each within this source's ``tolerance_s`` of a frame)."""
        unknown = [k for k in delta if k not in frames.spec]
        if unknown:
            raise InvalidArgumentError(
                f"{self._path}: delta_timestamps names {unknown}, which are not features read "
                f"from the dataset. Features: {frames.keys}. Fix: pick keys from that list."
            )
        fps = frames.fps
        got = {k: [(d, *frame_offset(d, fps)) for d in v] for k, v in delta.items()}
        off = {k: [d for d, _, miss in v if miss > self._tolerance_s] for k, v in got.items()}
        off = {k: v for k, v in off.items() if v}
        if off:
            raise InvalidArgumentError(
                f"{self._path}: delta_timestamps {off} are not multiples of 1/{fps} s (within "
                f"tolerance_s={self._tolerance_s}). Fix: use multiples of 1/fps, e.g. "
                f"{[round(i / fps, 6) for i in range(-2, 1)]}."
            )
        return {k: [steps for _, steps, _ in v] for k, v in got.items()}

    def _set_layout(self, full: Layout) -> None:
        if self._delta is None:
            super()._set_layout(full)
            return
        # The keys were chosen on the frame source; the masks are added leaves.
        self._layout = full
        self._keys = list(full.spec)
        self._build = tree_lib.compile_unflatten(full.treedef)

    def _open(self) -> Handle:
        if self._seq is not None:
            return Handle()  # the reads go through the sequence view
        return FrameHandle(
            self._meta, self._layout.spec, self._numeric_spec, self._image_keys,
            self._cache_bytes, self._frame_cache_bytes, self._tolerance_s,
        )  # fmt: skip

    # -- what the dataset says --------------------------------------------------

    @property
    def fps(self) -> float:
        """Frames per second (``info.json``'s ``fps``)."""
        return self._meta.fps

    @property
    def version(self) -> str:
        """The dataset's ``codebase_version``, e.g. ``"v3.0"``."""
        return self._meta.version

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        """``info.json``'s feature entries (dtype, shape, names, info), by feature name."""
        return {k: dict(v) for k, v in self._meta.features.items()}

    @property
    def camera_keys(self) -> list[str]:
        """The camera features read (videos and images), in info.json order."""
        frames = self.frames
        cams = set(self._meta.cameras) | set(frames._image_keys)
        return [k for k in frames.spec if k in cams]

    @property
    def tasks(self) -> tuple[str, ...]:
        """Task strings, indexed by the ``task_index`` leaf."""
        return self._meta.tasks

    @property
    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        """``meta/stats.json`` as numpy arrays: ``{feature: {"mean": ..., "std": ..., ...}}``.

        Camera statistics are LeRobot's, over float ``(C, H, W)`` frames in
        [0, 1] (shape ``(C, 1, 1)``); multiply by 255 and move the channel axis
        last to use them on this source's uint8 ``(H, W, C)`` frames.
        """
        return {k: {s: v.copy() for s, v in d.items()} for k, d in self._meta.stats.items()}

    @property
    def episodes(self) -> EpisodeIndex:
        """The :class:`EpisodeIndex` of the frames, one episode per LeRobot episode.

        LeRobot does not record how an episode ended: every episode counts as
        truncated (``terminated`` False) unless the dataset has a ``next.done``
        feature, whose value on an episode's last frame is then used.
        """
        meta = self._meta
        lengths = meta.ends - meta.starts
        terminated = np.zeros(len(lengths), dtype=bool)
        frames = self.frames
        if "next.done" in frames._numeric_spec and "next.done" in frames.spec:
            terminated = frames.read_leaf("next.done", meta.ends - 1).reshape(-1) != 0
        return EpisodeIndex.from_lengths(lengths, terminated)

    @property
    def frames(self) -> LeRobotDataSource:
        """The frame source (this source itself without ``delta_timestamps``)."""
        return self if self._frames is None else self._frames

    @property
    def delta_timestamps(self) -> dict[str, list[float]] | None:
        return None if self._delta is None else {k: list(v) for k, v in self._delta.items()}

    # -- reads ------------------------------------------------------------------

    def __getitem__(self, index: int) -> Any:
        if self._seq is None:
            return super().__getitem__(index)
        flat = self.read_flat([self._check_index(index)])
        return self._build({k: v[0] for k, v in flat.items()})

    def read_leaf(self, key: str, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        if self._seq is None:
            return super().read_leaf(key, indices)
        if key not in self._layout.spec:
            raise KeyError(f"{self._path}: no leaf {key!r}; leaves: {self._keys}")
        return self.read_flat(indices)[key]

    def read_windows(
        self, key: str, starts: Sequence[int] | np.ndarray, length: int, *, check: bool = True
    ) -> np.ndarray:
        if self._seq is None:
            return super().read_windows(key, starts, length, check=check)
        # Records are sequences read through the view: a window is read as its rows.
        return read_windows_as_rows(self.read_leaf, key, starts, length)

    def read_flat(
        self, indices: Sequence[int] | np.ndarray, *, check: bool = True
    ) -> dict[str, np.ndarray]:
        if self._seq is None or self._frames is None:
            return super().read_flat(indices, check=check)
        idx = self._check_indices(indices)
        # With edge padding every frame is an anchor, in frame order.
        got, _ = tree_lib.flatten(self._seq.read_batch(idx))
        frames = self._frames
        return {k: got[k] if k in got else frames.read_leaf(k, idx) for k in self._keys}

    def close(self) -> None:
        super().close()
        if self._frames is not None:
            self._frames.close()

    def __repr__(self) -> str:
        delta = "" if self._delta is None else f", delta_timestamps={self._delta!r}"
        return (
            f"LeRobotDataSource(path={self._path!r}, keys={self._keys!r}{delta}, "
            f"num_records={len(self)})"
        )
