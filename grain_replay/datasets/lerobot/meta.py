"""What a LeRobot dataset directory holds: info.json, episodes, tasks, stats (v3.0 and v2.1)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.datasets.lerobot.meta_files import (
    load_json,
    load_jsonl,
    parquet_files,
    pyarrow_parquet,
    table_columns,
)
from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.store.formats import shown_path

__all__ = ["Camera", "DataFile", "LeRobotMeta", "camera_shape", "read_meta", "pyarrow_parquet"]

INFO_PATH = os.path.join("meta", "info.json")
STATS_PATH = os.path.join("meta", "stats.json")
SUPPORTED = ("v3.0", "v2.1", "v2.0")
# Feature dtypes that are not parquet columns read as numbers.
VIDEO, IMAGE, STRING = "video", "image", "string"


@dataclasses.dataclass(frozen=True)
class DataFile:
    """One parquet file of frames: its path (relative to the root) and row groups."""

    path: str
    row_group_rows: tuple[int, ...]

    @property
    def num_rows(self) -> int:
        return sum(self.row_group_rows)


@dataclasses.dataclass(frozen=True)
class Camera:
    """Where each episode's frames of one camera live.

    Attributes:
      key: the feature name, e.g. ``"observation.images.top"``.
      shape: ``(H, W, C)`` as info.json declares it.
      files: the video files (paths relative to the dataset root), each once.
      file_of_episode: per episode, its entry in ``files``.
      from_timestamp: per episode, the time in the file where the episode starts.
    """

    key: str
    shape: tuple[int, int, int]
    files: tuple[str, ...]
    file_of_episode: np.ndarray
    from_timestamp: np.ndarray

    @classmethod
    def of_episodes(
        cls, key: str, shape: tuple[int, int, int], paths: list[str], from_ts: np.ndarray
    ) -> Camera:
        """A camera from one path per episode (stored once per file: pickles stay small)."""
        names: dict[str, int] = {}
        ids = np.array([names.setdefault(p, len(names)) for p in paths], dtype=np.int32)
        return cls(key, shape, tuple(names), ids, from_ts)


@dataclasses.dataclass(frozen=True)
class LeRobotMeta:
    """A LeRobot dataset's metadata, normalized over the format versions.

    Frames are numbered as LeRobot numbers them: the rows of the data files in
    path order. Episode ``e`` holds frames ``[starts[e], ends[e])``.
    """

    root: str
    version: str
    fps: float
    features: dict[str, dict[str, Any]]
    data_files: tuple[DataFile, ...]
    episode_index: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    cameras: dict[str, Camera]
    tasks: tuple[str, ...]
    stats: dict[str, dict[str, np.ndarray]]

    @property
    def num_frames(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0


def _info(root: str) -> dict[str, Any]:
    path = os.path.join(root, INFO_PATH)
    if not os.path.isdir(root):
        raise StoreNotFoundError(
            f"No LeRobot dataset at {shown_path(root)}: not a directory. Fix: pass the dataset's "
            "root "
            "folder (the one holding meta/info.json)."
        )
    try:
        info = load_json(path)
    except FileNotFoundError as e:
        raise StoreNotFoundError(
            f"No LeRobot dataset at {shown_path(root)}: {path} is missing. Fix: pass the "
            "dataset's root "
            "folder (the one holding meta/info.json), e.g. ~/.cache/huggingface/lerobot/<repo_id>."
        ) from e
    missing = [k for k in ("codebase_version", "fps", "features") if k not in info]
    if missing:
        raise InvalidStoreError(f"{path}: lacks {missing}; it is not a LeRobot info.json.")
    return dict(info)


def _check_version(info: Mapping[str, Any], path: str) -> str:
    version = str(info["codebase_version"])
    if version not in SUPPORTED:
        raise InvalidStoreError(
            f"{path}: codebase_version {version!r} is not supported; LeRobotDataSource reads "
            f"{list(SUPPORTED)}. Fix: convert the dataset with LeRobot's "
            "lerobot/datasets/v30/convert_dataset_v21_to_v30.py (v2.x to v3.0), or for v1.x "
            "first with LeRobot's v2 conversion script."
        )
    return version


def _data_files(root: str, rel_paths: list[str]) -> tuple[DataFile, ...]:
    pq = pyarrow_parquet()
    files = []
    for rel in rel_paths:
        path = os.path.join(root, rel)
        try:
            md = pq.read_metadata(path)
        except (OSError, ValueError) as e:
            raise InvalidStoreError(
                f"{path}: not a readable parquet file ({e}). Fix: download or re-create it."
            ) from e
        rows = tuple(int(md.row_group(g).num_rows) for g in range(md.num_row_groups))
        files.append(DataFile(rel, rows))
    return tuple(files)


def _tasks_v3(root: str) -> tuple[str, ...]:
    path = os.path.join(root, "meta", "tasks.parquet")
    if not os.path.isfile(path):
        raise StoreNotFoundError(
            f"{shown_path(path)}: missing. A LeRobot v3.0 dataset lists its task strings there. "
            "Fix: "
            "download the dataset's meta/ folder again."
        )
    cols = table_columns([path], None)
    index = cols.get("task_index")
    names = next(
        (v for k, v in cols.items() if k != "task_index" and v and isinstance(v[0], str)), None
    )
    if index is None or names is None:
        raise InvalidStoreError(
            f"{path}: expected a task_index column and a column of task strings, got "
            f"{sorted(cols)}."
        )
    return _ordered_tasks(index, names, path)


def _ordered_tasks(index: list[Any], names: list[Any], path: str) -> tuple[str, ...]:
    by_index = dict(zip((int(i) for i in index), names))
    if sorted(by_index) != list(range(len(by_index))):
        raise InvalidStoreError(
            f"{path}: task indices {sorted(by_index)} are not 0..{len(by_index) - 1}."
        )
    return tuple(str(by_index[i]) for i in range(len(by_index)))


def _stats(root: str) -> dict[str, dict[str, np.ndarray]]:
    path = os.path.join(root, STATS_PATH)
    if not os.path.isfile(path):
        return {}
    raw = load_json(path)
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, entry in raw.items():
        if isinstance(entry, dict):
            out[key] = {name: np.asarray(value) for name, value in entry.items()}
    return out


def _video_features(features: Mapping[str, Any]) -> list[str]:
    return [k for k, ft in features.items() if ft.get("dtype") == VIDEO]


def camera_shape(key: str, ft: Mapping[str, Any], path: str) -> tuple[int, int, int]:
    shape = tuple(int(s) for s in ft.get("shape", ()))
    names = list(ft.get("names") or [])
    if len(shape) != 3:
        raise InvalidStoreError(
            f"{path}: camera feature {key!r} has shape {shape}, not (H, W, C). Fix: correct "
            "meta/info.json."
        )
    if names[:1] == ["channels"]:  # (C, H, W) as some converted datasets declare it
        return shape[1], shape[2], shape[0]
    return shape[0], shape[1], shape[2]


def _episodes_v3(root: str, info: Mapping[str, Any], cams: list[str]) -> dict[str, np.ndarray]:
    paths = [os.path.join(root, p) for p in parquet_files(root, "meta/episodes/*/*.parquet")]
    if not paths:
        raise StoreNotFoundError(
            f"{shown_path(os.path.join(root, 'meta', 'episodes'))}: no chunk-*/file-*.parquet. A "
            "LeRobot "
            "v3.0 dataset lists its episodes there. Fix: download the dataset's meta/ folder "
            "again."
        )
    want = ["episode_index", "dataset_from_index", "dataset_to_index"]
    for cam in cams:
        want += [f"videos/{cam}/{c}" for c in ("chunk_index", "file_index", "from_timestamp")]
    pq = pyarrow_parquet()
    have = set(pq.read_schema(paths[0]).names)
    lacking = [c for c in want if c not in have]
    if lacking:
        raise InvalidStoreError(
            f"{paths[0]}: the episode table lacks the columns {lacking}. The dataset is not a "
            "complete LeRobot v3.0 dataset (was LeRobotDataset.finalize() called after "
            "recording?). Fix: re-create or download it again."
        )
    cols = table_columns(paths, want)
    return {k: np.asarray(v) for k, v in cols.items()}


def _episodes_v21(root: str, info: Mapping[str, Any]) -> dict[str, np.ndarray]:
    path = os.path.join(root, "meta", "episodes.jsonl")
    rows = load_jsonl(path)
    try:
        rows.sort(key=lambda r: int(r["episode_index"]))
        index = np.array([int(r["episode_index"]) for r in rows], dtype=np.int64)
        lengths = np.array([int(r["length"]) for r in rows], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidStoreError(
            f"{path}: every line needs an integer episode_index and length ({e!r})."
        ) from e
    ends = np.cumsum(lengths)
    return {
        "episode_index": index,
        "dataset_from_index": ends - lengths,
        "dataset_to_index": ends,
    }


def read_meta(root: str) -> LeRobotMeta:
    """Reads and checks a LeRobot dataset's metadata (no frame data is read).

    Raises:
      StoreNotFoundError: no dataset at ``root``, or a metadata file is missing.
      InvalidStoreError: an unsupported version or inconsistent metadata.
    """
    info = _info(root)
    info_path = os.path.join(root, INFO_PATH)
    version = _check_version(info, info_path)
    features = {str(k): dict(v) for k, v in info["features"].items()}
    fps = info["fps"]
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0:
        raise InvalidStoreError(f"{info_path}: fps must be a positive number, got {fps!r}.")
    cams = _video_features(features)
    chunks_size = int(info.get("chunks_size", 1000))
    if version == "v3.0":
        ep = _episodes_v3(root, info, cams)
        tasks = _tasks_v3(root)
        data_rel = parquet_files(root, "data/*/*.parquet")
    else:
        ep = _episodes_v21(root, info)
        tasks_path = os.path.join(root, "meta", "tasks.jsonl")
        task_rows = load_jsonl(tasks_path)
        if any("task_index" not in r or "task" not in r for r in task_rows):
            raise InvalidStoreError(f"{tasks_path}: every line needs task_index and task.")
        tasks = _ordered_tasks(
            [r["task_index"] for r in task_rows], [r["task"] for r in task_rows], tasks_path
        )
        template = str(info.get("data_path", ""))
        data_rel = [
            template.format(episode_chunk=int(e) // chunks_size, episode_index=int(e))
            for e in ep["episode_index"]
        ]
        for rel in data_rel:
            if not os.path.isfile(os.path.join(root, rel)):
                raise StoreNotFoundError(
                    f"{shown_path(os.path.join(root, rel))}: missing, but meta/episodes.jsonl "
                    "lists its "
                    "episode. Fix: download the dataset's data/ folder again."
                )
    if not data_rel:
        raise StoreNotFoundError(
            f"{shown_path(os.path.join(root, 'data'))}: no parquet files. Fix: download the "
            "dataset's data/ "
            "folder (LeRobot writes data/chunk-*/file-*.parquet)."
        )
    order = np.argsort(ep["dataset_from_index"], kind="stable")
    ep = {k: v[order] for k, v in ep.items()}
    starts = ep["dataset_from_index"].astype(np.int64)
    ends = ep["dataset_to_index"].astype(np.int64)
    data_files = _data_files(root, data_rel)
    total = sum(f.num_rows for f in data_files)
    contiguous = len(starts) and starts[0] == 0 and np.array_equal(starts[1:], ends[:-1])
    if not contiguous or ends[-1] != total or np.any(ends <= starts):
        raise InvalidStoreError(
            f"{root}: the episodes' frame ranges (dataset_from_index/dataset_to_index) do not "
            f"tile the {total} frames of the data files. The dataset is incomplete or was "
            "changed while written. Fix: download or re-create it."
        )
    cameras = {}
    video_template = str(info.get("video_path") or "")
    for cam in cams:
        if version == "v3.0":
            paths = [
                video_template.format(video_key=cam, chunk_index=int(c), file_index=int(f))
                for c, f in zip(ep[f"videos/{cam}/chunk_index"], ep[f"videos/{cam}/file_index"])
            ]
            from_ts = ep[f"videos/{cam}/from_timestamp"].astype(np.float64)
        else:
            paths = [
                video_template.format(
                    video_key=cam, episode_chunk=int(e) // chunks_size, episode_index=int(e)
                )
                for e in ep["episode_index"]
            ]
            from_ts = np.zeros(len(paths))
        shape = camera_shape(cam, features[cam], info_path)
        cameras[cam] = Camera.of_episodes(cam, shape, paths, from_ts)
    return LeRobotMeta(
        root=root,
        version=version,
        fps=int(fps) if float(fps).is_integer() else fps,
        features=features,
        data_files=data_files,
        episode_index=ep["episode_index"].astype(np.int64),
        starts=starts,
        ends=ends,
        cameras=cameras,
        tasks=tasks,
        stats=_stats(root),
    )
