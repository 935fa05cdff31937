"""Operations (grain transforms) the worker-path tests send to spawned workers (importable by
name); the sources they wrap reads in are in loader_sources, which imports no grain."""

from __future__ import annotations

import multiprocessing
import multiprocessing.reduction
import os
import signal
from typing import Any

import grain
import numpy as np


class Grow(grain.transforms.Map):
    """Repeats every leaf ``1 + id % 3`` times: batches of changing sizes and shapes."""

    def map(self, element: Any) -> Any:
        reps = 1 + int(element["id"][0]) % 3

        def grow(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: grow(v) for k, v in node.items()}
            return np.concatenate([node] * reps)

        return grow(element)


class PythonLeaves(grain.transforms.Map):
    """Adds leaves that are not arrays: the batch must travel pickled."""

    def map(self, element: Any) -> Any:
        return {**element, "first": int(element["id"][0]), "tag": "batch", "none": None}


class Shapes(grain.transforms.Map):
    """Adds an empty leaf, a 0-d leaf, a big-endian leaf and a non-contiguous leaf."""

    def map(self, element: Any) -> Any:
        ids = element["id"]
        return {
            **element,
            "empty": np.zeros((len(ids), 0), np.float32),
            "scalar": np.array(int(ids.sum())),
            "big_endian": ids.astype(">i4"),
            "strided": np.stack([ids, ids * 2], axis=1).T,
            "text": np.array([str(i) for i in ids]),
        }


class Pid(grain.transforms.Map):
    """Records the process that mapped the batch."""

    def map(self, element: Any) -> Any:
        return {**element, "pid": np.full(len(element["id"]), os.getpid())}


class CacheShare(grain.transforms.Map):
    """Records how many processes split the default chunk-cache budget where it runs."""

    def map(self, element: Any) -> Any:
        from grain_replay.sources.reading import cache

        return {**element, "share": np.full(len(element["id"]), cache._cache_share)}


class KillWorkerOnce(grain.transforms.Map):
    """SIGKILLs loader worker 0 at its ``nth`` batch (counted from 1), once per ``marker``.

    ``before_fd``: instead, worker 0 dies inside its ``nth`` batch's slot hand-over,
    after the slot message and before the slot's file descriptor (the batch must be
    its first in that slot). The marker file, removed by the kill, keeps the workers
    started after the death alive.
    """

    def __init__(self, marker: str, nth: int, before_fd: bool = False) -> None:
        self.marker = marker
        self.nth = nth
        self.before_fd = before_fd
        self.calls = 0

    @classmethod
    def armed(cls, folder: Any, nth: int, before_fd: bool = False) -> KillWorkerOnce:
        """One whose marker file (``folder/kill``) is made: it kills at its ``nth`` batch."""
        marker = os.path.join(str(folder), "kill")
        open(marker, "w").close()
        return cls(marker, nth, before_fd)

    @property
    def fired(self) -> bool:
        """The kill happened (its marker is gone)."""
        return not os.path.exists(self.marker)

    def map(self, element: Any) -> Any:
        self.calls += 1
        name = multiprocessing.current_process().name
        if self.calls != self.nth or not name.endswith("_worker_0"):
            return element
        try:
            os.unlink(self.marker)
        except FileNotFoundError:
            return element  # a worker started after the death

        def die(*args: Any, **kwargs: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        if not self.before_fd:
            die()
        multiprocessing.reduction.send_handle = die
        return element


class Frames(grain.transforms.Map):
    """Adds a leaf of 5,000-byte elements (rows of their own in the lane layout, padded)."""

    def map(self, element: Any) -> Any:
        ids = element["id"]
        frames = (ids[:, None, None] + np.arange(5000).reshape(1, 50, 100)).astype(np.uint8)
        return {**element, "frames": frames}


class Scalar(grain.transforms.Map):
    """Adds a 0-d leaf (no batch rows)."""

    def map(self, element: Any) -> Any:
        return {**element, "scalar": np.array(int(element["id"].sum()))}
