"""Runs in the lerobot venv (make test-lerobot): writes datasets with LeRobot's own writer and
dumps what ``LeRobotDataset.__getitem__`` returns, for the main venv's tests to compare.

Usage:
  python lerobot_peer.py write ROOT [--episodes 3] [--length 12] [--cameras 2] [--size 64]
                                    [--vcodec libsvtav1] [--images]
  python lerobot_peer.py dump ROOT OUT.npz [--delta JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

FPS = 10
TASKS = ("pick the cube", "push the T")


def features(cameras: int, size: int, images: bool = False) -> dict:
    out = {
        "observation.state": {"dtype": "float32", "shape": (4,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
        "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
    }
    for c in range(cameras):
        out[f"observation.images.cam{c}"] = {
            "dtype": "image" if images else "video",
            "shape": (size, size, 3),
            "names": ["height", "width", "channels"],
        }
    return out


def write(
    root: str, episodes: int, length: int, cameras: int, size: int, vcodec: str, images: bool
) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    rng = np.random.default_rng(0)
    ds = LeRobotDataset.create(
        "local/toy", fps=FPS, features=features(cameras, size, images), root=root,
        use_videos=cameras > 0 and not images, vcodec=vcodec,
    )  # fmt: skip
    g = 0
    for e in range(episodes):
        for _ in range(length + e):  # episodes of different lengths
            frame = {
                "observation.state": rng.standard_normal(4).astype(np.float32),
                "action": rng.standard_normal(2).astype(np.float32),
                "next.reward": rng.standard_normal(1).astype(np.float32),
                "task": TASKS[e % len(TASKS)],
            }
            for c in range(cameras):
                img = np.empty((size, size, 3), np.uint8)
                img[...] = ((g * 53 + 17 + 40 * np.arange(3) + 7 * c) % 200 + 28).astype(np.uint8)
                img[: size // 2, : size // 2] //= 2  # some structure for the codec
                frame[f"observation.images.cam{c}"] = img
            ds.add_frame(frame)
            g += 1
        ds.save_episode()
    ds.finalize()


def dump(root: str, out: str, delta: dict | None) -> None:
    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("local/toy", root=root, delta_timestamps=delta, video_backend="pyav")
    items = [ds[i] for i in range(len(ds))]
    arrays = {}
    for key, value in items[0].items():
        if isinstance(value, torch.Tensor):
            arrays[key] = np.stack([it[key].numpy() for it in items])
        elif key == "task":
            arrays["task"] = np.array([it[key] for it in items])
    np.savez(out, **arrays)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("root")
    w.add_argument("--episodes", type=int, default=3)
    w.add_argument("--length", type=int, default=12)
    w.add_argument("--cameras", type=int, default=2)
    w.add_argument("--size", type=int, default=64)
    w.add_argument("--vcodec", default="libsvtav1")
    w.add_argument("--images", action="store_true", help="cameras as PNG images in parquet")
    d = sub.add_parser("dump")
    d.add_argument("root")
    d.add_argument("out")
    d.add_argument("--delta", default=None)
    a = p.parse_args(argv)
    if a.cmd == "write":
        write(os.path.abspath(a.root), a.episodes, a.length, a.cameras, a.size, a.vcodec, a.images)
    else:
        dump(os.path.abspath(a.root), a.out, None if a.delta is None else json.loads(a.delta))


if __name__ == "__main__":
    main(sys.argv[1:])
