"""Small LeRobot datasets written to the published v3.0 (and v2.1) layout with pyarrow and PyAV.

The layout follows lerobot 0.4.x (``lerobot/datasets/utils.py``): ``meta/info.json``,
``meta/stats.json``, ``meta/tasks.parquet``, ``meta/episodes/chunk-000/file-000.parquet``,
``data/chunk-000/file-NNN.parquet`` (one row group per episode) and
``videos/<camera>/chunk-000/file-NNN.mp4`` (episodes back to back in a file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

STATE_DIM = 3
ACTION_DIM = 2
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
TASKS = ("pick the cube", "push the T")


def frame_color(index: int) -> int:
    """The flat gray level frame ``index`` (global) is drawn with; far apart between neighbors."""
    return (index * 53 + 17) % 200 + 28


def frame_image(index: int, h: int, w: int, channel_shift: int = 0) -> np.ndarray:
    """A frame that survives lossy coding recognizably: flat color per channel."""
    base = frame_color(index)
    img = np.empty((h, w, 3), np.uint8)
    for c in range(3):
        img[..., c] = (base + 40 * c + channel_shift) % 256
    return img


def encode_video(
    path: str, frames: Sequence[np.ndarray], fps: int, codec: str = "libx264", gop: int = 2
) -> None:
    import av

    os.makedirs(os.path.dirname(path), exist_ok=True)
    h, w, _ = frames[0].shape
    options = {"g": str(gop), "crf": "18"} if codec == "libx264" else {"g": str(gop)}
    with av.open(path, "w") as out:
        stream = out.add_stream(codec, rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i, img in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def encode_png(img: np.ndarray) -> bytes:
    """PNG bytes of a uint8 (H, W, 3) image (PyAV's encoder: no PIL needed)."""
    import av

    ctx = av.CodecContext.create("png", "w")
    ctx.width, ctx.height, ctx.pix_fmt = img.shape[1], img.shape[0], "rgb24"
    packets = ctx.encode(av.VideoFrame.from_ndarray(img, format="rgb24")) + ctx.encode(None)
    return b"".join(bytes(p) for p in packets)


def write_dataset(
    root: str,
    lengths: Sequence[int] = (5, 7, 4),
    *,
    fps: int = 10,
    cameras: dict[str, tuple[int, int]] | None = None,
    image_cameras: dict[str, tuple[int, int]] | None = None,
    episodes_per_file: int | None = None,
    codec: str = "libx264",
    seed: int = 0,
) -> dict[str, Any]:
    """Writes a v3.0 dataset; returns the frames' expected numeric columns and images."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cameras = {} if cameras is None else cameras
    image_cameras = {} if image_cameras is None else image_cameras
    rng = np.random.default_rng(seed)
    n = int(sum(lengths))
    starts = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
    episode = np.repeat(np.arange(len(lengths)), lengths).astype(np.int64)
    frame_index = (np.arange(n) - starts[episode]).astype(np.int64)
    cols = {
        "observation.state": rng.standard_normal((n, STATE_DIM)).astype(np.float32),
        "action": rng.standard_normal((n, ACTION_DIM)).astype(np.float32),
        "next.reward": rng.standard_normal(n).astype(np.float32),
        "timestamp": (frame_index / fps).astype(np.float32),
        "frame_index": frame_index,
        "episode_index": episode,
        "index": np.arange(n, dtype=np.int64),
        "task_index": (episode % len(TASKS)).astype(np.int64),
    }
    features: dict[str, Any] = {}
    for cam, (h, w) in cameras.items():
        features[cam] = {
            "dtype": "video",
            "shape": [h, w, 3],
            "names": ["height", "width", "channels"],
            "info": {"video.fps": fps, "video.codec": codec, "video.pix_fmt": "yuv420p"},
        }
    for cam, (h, w) in image_cameras.items():
        features[cam] = {
            "dtype": "image",
            "shape": [h, w, 3],
            "names": ["height", "width", "channel"],
        }
    features["observation.state"] = {
        "dtype": "float32", "shape": [STATE_DIM], "names": [f"s{i}" for i in range(STATE_DIM)]
    }  # fmt: skip
    features["action"] = {"dtype": "float32", "shape": [ACTION_DIM], "names": ["x", "y"]}
    features["next.reward"] = {"dtype": "float32", "shape": [1], "names": None}
    for k in ("timestamp",):
        features[k] = {"dtype": "float32", "shape": [1], "names": None}
    for k in ("frame_index", "episode_index", "index", "task_index"):
        features[k] = {"dtype": "int64", "shape": [1], "names": None}

    images: dict[str, np.ndarray] = {}
    for shift, cam in enumerate(image_cameras):
        h, w = image_cameras[cam]
        images[cam] = np.stack([frame_image(i, h, w, 11 * shift + 3) for i in range(n)])
        images[cam][:, : h // 2, : w // 2] //= 2
    per_file = episodes_per_file or len(lengths)
    file_of = np.arange(len(lengths)) // per_file
    # Data files, one row group per episode (as LeRobot's ParquetWriter writes them).
    for f in np.unique(file_of):
        path = os.path.join(root, DATA_PATH.format(chunk_index=0, file_index=int(f)))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        writer = None
        for e in np.flatnonzero(file_of == f):
            rows = slice(int(starts[e]), int(starts[e] + lengths[e]))
            arrays = {}
            for k, v in cols.items():
                v = v[rows]
                if v.ndim == 2:
                    arrays[k] = pa.FixedSizeListArray.from_arrays(
                        pa.array(v.reshape(-1)), v.shape[1]
                    )
                else:
                    arrays[k] = pa.array(v)
            for cam in image_cameras:
                arrays[cam] = pa.StructArray.from_arrays(
                    [
                        pa.array([encode_png(img) for img in images[cam][rows]], pa.binary()),
                        pa.array([None] * (rows.stop - rows.start), pa.string()),
                    ],
                    names=["bytes", "path"],
                )
            table = pa.table(arrays)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema, compression="snappy")
            writer.write_table(table)
        assert writer is not None
        writer.close()

    episodes: dict[str, list[Any]] = {
        "episode_index": list(range(len(lengths))),
        "tasks": [[TASKS[e % len(TASKS)]] for e in range(len(lengths))],
        "length": [int(x) for x in lengths],
        "data/chunk_index": [0] * len(lengths),
        "data/file_index": [int(f) for f in file_of],
        "dataset_from_index": [int(s) for s in starts],
        "dataset_to_index": [int(s + x) for s, x in zip(starts, lengths)],
    }
    for shift, (cam, (h, w)) in enumerate(cameras.items()):
        imgs = np.stack([frame_image(i, h, w, 7 * shift) for i in range(n)])
        images[cam] = imgs
        from_ts = []
        for f in np.unique(file_of):
            eps = np.flatnonzero(file_of == f)
            first = int(starts[eps[0]])
            last = int(starts[eps[-1]] + lengths[eps[-1]])
            path = os.path.join(
                root, VIDEO_PATH.format(video_key=cam, chunk_index=0, file_index=int(f))
            )
            encode_video(path, list(imgs[first:last]), fps, codec)
            from_ts += [(int(starts[e]) - first) / fps for e in eps]
        episodes[f"videos/{cam}/chunk_index"] = [0] * len(lengths)
        episodes[f"videos/{cam}/file_index"] = [int(f) for f in file_of]
        episodes[f"videos/{cam}/from_timestamp"] = from_ts
        episodes[f"videos/{cam}/to_timestamp"] = [t + x / fps for t, x in zip(from_ts, lengths)]
    episodes["meta/episodes/chunk_index"] = [0] * len(lengths)
    episodes["meta/episodes/file_index"] = [0] * len(lengths)
    path = os.path.join(root, "meta/episodes/chunk-000/file-000.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table(episodes), path)
    pq.write_table(
        pa.table({"task_index": list(range(len(TASKS))), "__index_level_0__": list(TASKS)}),
        os.path.join(root, "meta/tasks.parquet"),
    )
    stats = {
        k: {
            "mean": np.mean(v, axis=0).tolist(),
            "std": np.std(v, axis=0).tolist(),
            "min": np.min(v, axis=0).tolist(),
            "max": np.max(v, axis=0).tolist(),
            "count": [n],
        }
        for k, v in cols.items()
        if k in ("observation.state", "action")
    }
    with open(os.path.join(root, "meta/stats.json"), "w") as fh:
        json.dump(stats, fh)
    info = {
        "codebase_version": "v3.0",
        "robot_type": "toy",
        "total_episodes": len(lengths),
        "total_frames": n,
        "total_tasks": len(TASKS),
        "chunks_size": 1000,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "fps": fps,
        "splits": {"train": f"0:{len(lengths)}"},
        "data_path": DATA_PATH,
        "video_path": VIDEO_PATH if cameras else None,
        "features": features,
    }
    with open(os.path.join(root, "meta/info.json"), "w") as fh:
        json.dump(info, fh, indent=2)
    return {"columns": cols, "images": images, "starts": starts, "lengths": np.asarray(lengths)}


def decode_all(path: str) -> list[tuple[float, np.ndarray]]:
    """Every frame of a video, in order, as ``(time, rgb24)`` (a plain sequential decode)."""
    import av

    with av.open(path) as c:
        s = c.streams.video[0]
        return [(float(fr.pts * s.time_base), fr.to_ndarray(format="rgb24")) for fr in c.decode(s)]


def rewrite_as_v21(root: str) -> None:
    """Turns a v3.0 fixture (one data/video file) into LeRobot's v2.1 layout, in place.

    v2.1: ``data/chunk-000/episode_NNNNNN.parquet`` and
    ``videos/chunk-000/<camera>/episode_NNNNNN.mp4`` per episode,
    ``meta/episodes.jsonl`` and ``meta/tasks.jsonl``.
    """
    import shutil

    import pyarrow.parquet as pq

    with open(os.path.join(root, "meta/info.json")) as fh:
        info = json.load(fh)
    fps = info["fps"]
    table = pq.read_table(os.path.join(root, DATA_PATH.format(chunk_index=0, file_index=0)))
    episodes = pq.read_table(os.path.join(root, "meta/episodes/chunk-000/file-000.parquet"))
    ep = episodes.to_pydict()
    cams = [k for k, v in info["features"].items() if v["dtype"] == "video"]
    videos = {
        cam: decode_all(
            os.path.join(root, VIDEO_PATH.format(video_key=cam, chunk_index=0, file_index=0))
        )
        for cam in cams
    }
    shutil.rmtree(os.path.join(root, "data"))
    shutil.rmtree(os.path.join(root, "meta/episodes"))
    os.remove(os.path.join(root, "meta/tasks.parquet"))
    if cams:
        shutil.rmtree(os.path.join(root, "videos"))
    data_path = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
    video_path = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
    with open(os.path.join(root, "meta/episodes.jsonl"), "w") as fh:
        for e, lo, hi in zip(ep["episode_index"], ep["dataset_from_index"], ep["dataset_to_index"]):
            path = os.path.join(root, data_path.format(episode_chunk=0, episode_index=e))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            pq.write_table(table.slice(lo, hi - lo), path)
            for cam in cams:
                frames = [img for _, img in videos[cam][lo:hi]]
                encode_video(
                    os.path.join(
                        root, video_path.format(episode_chunk=0, video_key=cam, episode_index=e)
                    ),
                    frames,
                    fps,
                )
            fh.write(json.dumps({"episode_index": e, "tasks": [], "length": hi - lo}) + "\n")
    with open(os.path.join(root, "meta/tasks.jsonl"), "w") as fh:
        for i, task in enumerate(TASKS):
            fh.write(json.dumps({"task_index": i, "task": task}) + "\n")
    info.update(
        codebase_version="v2.1", data_path=data_path, video_path=video_path if cams else None
    )
    with open(os.path.join(root, "meta/info.json"), "w") as fh:
        json.dump(info, fh, indent=2)
