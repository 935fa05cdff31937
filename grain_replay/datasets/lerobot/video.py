"""Camera frames of a LeRobot dataset, decoded with PyAV in the process that reads the batch."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from grain_replay.datasets.lerobot.meta import Camera
from grain_replay.errors import (
    FrameTimestampError,
    InvalidStoreError,
    StoreNotFoundError,
)
from grain_replay.sources.reading.cache import ChunkCache
from grain_replay.sources.reading.readers import LeafReader
from grain_replay.sources.reading.runs import runs
from grain_replay.store.formats import import_optional, shown_path

__all__ = ["VideoFiles", "VideoReader", "decode_at", "import_av"]


def import_av() -> Any:
    """The ``av`` module (PyAV), or MissingDependencyError with the install hint."""
    return import_optional(
        "av",
        "Decoding LeRobot camera videos needs PyAV. Fix: pip install av (or "
        "grain_replay[rl]), or leave the cameras out with keys=[...].",
    )


class _Frame:
    __slots__ = ("frame", "time")

    def __init__(self, time: float, frame: Any):
        self.time = time
        self.frame = frame


class _Video:
    """One open video file: container, stream and the lock that serializes its decoding."""

    def __init__(self, path: str, camera: str, episode: int):
        av = import_av()
        self.path = path
        self.lock = threading.Lock()
        if not os.path.isfile(path):
            raise StoreNotFoundError(
                f"{shown_path(path)}: missing video of camera {camera!r} (episode {episode}). "
                "Fix: download "
                "the dataset's videos/ folder, or leave the camera out with keys=[...]."
            )
        try:
            self.container = av.open(path, "r")
            self.stream = self.container.streams.video[0]
        except (av.error.FFmpegError, IndexError, OSError) as e:
            raise InvalidStoreError(
                f"{path}: camera {camera!r} (episode {episode}): not a readable video "
                f"({type(e).__name__}: {e}). Fix: download or re-encode the file."
            ) from e
        context = self.stream.codec_context
        codec = context.name if context is not None else None
        try:
            if codec is None:
                raise ValueError("unknown codec")
            av.codec.Codec(codec, "r")
        except (ValueError, av.error.FFmpegError) as e:
            self.container.close()
            tag = getattr(self.stream, "codec_tag", None)
            raise InvalidStoreError(
                f"{path}: camera {camera!r} (episode {episode}): the FFmpeg in PyAV "
                f"{av.__version__} has no decoder for the video's codec "
                f"{codec or 'unknown'} (tag {tag!r}). Fix: "
                "re-encode the videos (e.g. ffmpeg -i in.mp4 -c:v libx264 -g 2 out.mp4) or "
                "install a PyAV build whose FFmpeg decodes it."
            ) from e
        self.stream.thread_type = "AUTO"
        self.time_base = Fraction(self.stream.time_base)
        # Longest keyframe interval seen so far: decoding forward this far costs no
        # more than a seek, which restarts at the keyframe before the target.
        self.gop_s = 0.0

    def close(self) -> None:
        self.container.close()


class VideoFiles:
    """The process's open videos: one container per file, opened on first use."""

    def __init__(self, root: str):
        self._root = root
        self._open: dict[str, _Video] = {}
        self._lock = threading.Lock()

    def get(self, rel: str, camera: str, episode: int) -> _Video:
        video = self._open.get(rel)
        if video is None:
            with self._lock:
                video = self._open.get(rel)
                if video is None:
                    video = _Video(os.path.join(self._root, rel), camera, episode)
                    self._open[rel] = video
        return video

    def close(self) -> None:
        with self._lock:
            for video in self._open.values():
                with video.lock:
                    video.close()
            self._open.clear()


def _nearest(cands: Sequence[_Frame | None], q: float) -> _Frame | None:
    best = None
    for c in cands:  # earlier first: a tie goes to the earlier frame, as in LeRobot
        if c is not None and (best is None or abs(c.time - q) < abs(best.time - q)):
            best = c
    return best


def decode_at(
    video: _Video, times: np.ndarray, fps: float, tolerance_s: float
) -> list[tuple[float, Any] | None]:
    """The frame nearest each of ``times`` (sorted, seconds in the file), in one forward pass.

    Seeks to the keyframe before a time only when that time lies further ahead
    than a keyframe interval; times in the same GOP are reached by decoding on.
    Hold ``video.lock``.

    Returns:
      Per time, ``(frame time, rgb24 array (H, W, 3))``, or None when no frame
      lies within ``tolerance_s`` (with the nearest frame time when known: the
      entry is then ``(time, None)``).
    """
    av = import_av()
    out: list[tuple[float, Any] | None] = []
    it = None
    prev: _Frame | None = None
    cur: _Frame | None = None
    eof = False
    last_key: float | None = None
    tb = video.time_base
    for q in times:
        q = float(q)
        ahead = max(video.gop_s, 1.5 / fps)
        if it is None or cur is None or q - cur.time > ahead or (eof and cur.time < q):
            target = max(0, math.floor((q - tolerance_s) / tb))
            video.container.seek(target, stream=video.stream, backward=True, any_frame=False)
            it = video.container.decode(video.stream)
            prev = cur = None
            eof = False
            last_key = None
        while not eof and (cur is None or cur.time < q):
            try:
                frame = next(it, None)
            except av.error.FFmpegError as e:
                raise InvalidStoreError(
                    f"{video.path}: decoding failed near t={q:.4f}s ({type(e).__name__}: {e}). "
                    "Fix: re-encode or download the video again."
                ) from e
            if frame is None:
                eof = True
                break
            t = float(frame.pts * tb) if frame.pts is not None else float(frame.time)
            if frame.key_frame:
                if last_key is not None:
                    video.gop_s = max(video.gop_s, t - last_key)
                last_key = t
            prev, cur = cur, _Frame(t, frame)
        best = _nearest((prev, cur), q)
        if best is None or not abs(best.time - q) < tolerance_s:
            out.append(None if best is None else (best.time, None))
            continue
        out.append((best.time, best.frame))
    return [
        None if o is None else (o[0], None if o[1] is None else o[1].to_ndarray(format="rgb24"))
        for o in out
    ]


class VideoReader(LeafReader):
    """Frames of one camera as uint8 ``(H, W, 3)`` arrays, for any frame numbers.

    A frame's video time is its episode's ``from_timestamp`` plus its
    ``timestamp``, as LeRobot computes it; the decoded frame is the one nearest
    that time, which must lie within ``tolerance_s``. A batch is grouped by
    file; each file's times are decoded in one sorted forward pass. Decoded
    frames are kept in a byte-bounded per-process cache.
    """

    def __init__(
        self,
        camera: Camera,
        timestamps: LeafReader,
        ends: np.ndarray,
        episode_index: np.ndarray,
        videos: VideoFiles,
        cache: ChunkCache,
        fps: float,
        tolerance_s: float,
    ):
        self._cam = camera
        self._timestamps = timestamps
        self._ends = ends
        self._episode_index = episode_index
        self._videos = videos
        self._cache = cache
        self._fps = fps
        self._tol = tolerance_s
        self._shape = camera.shape
        self._file_names = list(camera.files)
        self._file_of_episode = camera.file_of_episode

    def take(self, indices: np.ndarray) -> np.ndarray:
        out = np.empty((len(indices), *self._shape), dtype=np.uint8)
        if len(indices) == 0:
            return out
        ep = np.searchsorted(self._ends, indices, side="right")
        times = self._cam.from_timestamp[ep] + self._timestamps.take(indices).astype(np.float64)
        fid = self._file_of_episode[ep]
        # The batch cut into its files (positions kept in batch order).
        for f, pos in runs(fid):
            self._fill(f, times[pos], ep[pos], indices[pos], pos, out)
        return out

    def _key(self, f: int, t: float) -> tuple[str, int]:
        return (f"{self._cam.key}\0{self._file_names[f]}", round(t * 1e6))

    def _fill(
        self,
        f: int,
        times: np.ndarray,
        eps: np.ndarray,
        frames: np.ndarray,
        pos: np.ndarray,
        out: np.ndarray,
    ) -> None:
        uniq, inv = np.unique(times, return_inverse=True)
        got: list[np.ndarray | None] = [self._cache.get(self._key(f, float(t))) for t in uniq]
        missing = [j for j, g in enumerate(got) if g is None]
        if missing:
            first = int(np.argmax(inv == missing[0]))
            video = self._videos.get(self._file_names[f], self._cam.key, self._ep(eps[first]))
            with video.lock:
                decoded = decode_at(video, uniq[missing], self._fps, self._tol)
            for j, d in zip(missing, decoded):
                if d is None or d[1] is None:
                    k = int(np.argmax(inv == j))
                    nearest = "no frame" if d is None else f"the nearest frame is at {d[0]:.6f}s"
                    raise FrameTimestampError(
                        f"{video.path}: camera {self._cam.key!r}, episode {self._ep(eps[k])}, "
                        f"frame {int(frames[k])}: no video frame within tolerance_s="
                        f"{self._tol} of t={float(uniq[j]):.6f}s in the file ({nearest}). "
                        "The video and the frame timestamps disagree. Fix: re-encode the "
                        "episode, or pass a larger tolerance_s."
                    )
                frame = np.ascontiguousarray(d[1])
                if frame.shape != self._shape:
                    raise InvalidStoreError(
                        f"{video.path}: camera {self._cam.key!r}: frames decode to shape "
                        f"{frame.shape}, but info.json declares {self._shape}. Fix: correct "
                        "meta/info.json or re-encode the video."
                    )
                frame.flags.writeable = False
                self._cache.put(self._key(f, float(uniq[j])), frame)
                got[j] = frame
        out[pos] = np.stack(got)[inv.reshape(-1)]  # type: ignore[arg-type, unused-ignore]

    def _ep(self, e: Any) -> int:
        return int(self._episode_index[int(e)])
