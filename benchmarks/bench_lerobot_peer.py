"""The peer side of bench_lerobot.py: LeRobotDataset through a torch DataLoader (lerobot venv).

Usage: python bench_lerobot_peer.py ROOT --batches K --workers W [--delta JSON]
       [--backend pyav|torchcodec] [--repeats R]
Prints one JSON line: {"frames_per_s": [per repeat], "startup_s": ...}.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--delta", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()

    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    torch.set_num_threads(1)
    delta = None if a.delta is None else json.loads(a.delta)
    t0 = time.perf_counter()
    ds = LeRobotDataset("local/bench", root=a.root, delta_timestamps=delta, video_backend=a.backend)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=a.batch_size,
        shuffle=True,
        num_workers=a.workers,
        persistent_workers=a.workers > 0,
        drop_last=True,
    )

    def batches():  # type: ignore[no-untyped-def]
        while True:
            yield from loader

    it = batches()
    for _ in range(4):  # workers started and their prefetch in steady state (as on our side)
        next(it)
    startup = time.perf_counter() - t0
    rates = []
    for _ in range(a.repeats):
        t = time.perf_counter()
        for _ in range(a.batches):
            next(it)
        rates.append(a.batches * a.batch_size / (time.perf_counter() - t))
    print(json.dumps({"frames_per_s": rates, "startup_s": startup}))


if __name__ == "__main__":
    main()
