"""Decode rate of JPEG-encoded Minari image spaces through MinariDataSource, in the same run.

A dataset of Atari-sized frames (84x84x3, uint8 Box 0..255: an image space, so
``minari.DataCollector`` JPEG-encodes it by default) is recorded in the HDF5
and the Arrow format. For each, random batches are read with
``MinariDataSource.read_batch`` (observations and next observations: two
decodes per step) and compared with

- the decode limit: ``PIL.Image.open`` + ``np.asarray`` on the same encoded
  frames, already in memory (what one decode costs, nothing else);
- minari's own reader: ``minari.load_dataset(...).iterate_episodes()``, which
  decodes every frame of every episode (the way to get frames out of Minari).

    python benchmarks/bench_minari_jpeg.py [--steps N] [--batch B] [--repeats R]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np

warnings.filterwarnings("ignore")


def _env() -> Any:
    import gymnasium as gym
    from gymnasium import spaces

    class Frames(gym.Env):
        observation_space = spaces.Box(0, 255, (84, 84, 3), np.uint8)
        action_space = spaces.Discrete(4)

        def _obs(self) -> np.ndarray:
            # Blocky moving shapes: compress like game frames, not like noise.
            yy, xx = np.mgrid[0:84, 0:84] // 6
            t = self._t
            return np.stack(
                [(xx * 13 + t) % 256, (yy * 7 + 2 * t) % 256, (xx ^ yy) * 9], -1
            ).astype(np.uint8)

        def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
            super().reset(seed=seed)
            self._t = 0
            return self._obs(), {}

        def step(self, action: Any) -> Any:
            self._t += 1
            return self._obs(), 0.0, self._t % 100 == 0, False, {}

    return Frames()


def _record(dataset_id: str, steps: int, data_format: str) -> None:
    import minari

    env = minari.DataCollector(_env(), data_format=data_format)
    env.reset(seed=0)
    for _ in range(steps):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    env.create_dataset(dataset_id=dataset_id, algorithm_name="bench")


def _median(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure(root: str, fmt: str, steps: int, batch: int, repeats: int) -> str:
    import minari
    from PIL import Image

    from grain_replay.datasets import MinariDataSource

    dataset_id = f"bench/{fmt}-v0"
    _record(dataset_id, steps, fmt)
    src = MinariDataSource(os.path.join(root, "bench", f"{fmt}-v0"))
    rng = np.random.default_rng(0)
    batches = iter([rng.integers(0, len(src), batch) for _ in range(repeats + 1)])
    src.read_batch(next(batches))  # open, map, fill the encoded-frame cache
    rate = 2 * batch / _median(lambda: src.read_batch(next(batches)), repeats)
    # The limit: decoding the same number of frames, already in memory.
    frame = next(iter(minari.load_dataset(dataset_id).iterate_episodes())).observations[0]
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG")
    blob = buf.getvalue()

    def decode_only() -> None:
        for _ in range(2 * batch):
            np.asarray(Image.open(io.BytesIO(blob)), dtype=np.uint8)

    limit = 2 * batch / _median(decode_only, repeats)
    t = time.perf_counter()
    frames = sum(len(ep.observations) for ep in minari.load_dataset(dataset_id).iterate_episodes())
    theirs = frames / (time.perf_counter() - t)
    return (
        f"{fmt:<7} {rate:>15,.0f} {limit:>15,.0f} {rate / limit:>8.2f}x "
        f"{theirs:>12,.0f} {rate / theirs:>9.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import minari

    root = tempfile.mkdtemp(prefix="bench_minari_")
    os.environ["MINARI_DATASETS_PATH"] = root
    print(
        f"JPEG-encoded 84x84x3 frames, {args.steps} steps, random batches of {args.batch} "
        f"(2 frames per step); median of {args.repeats}; minari {minari.__version__}"
    )
    print(
        f"{'format':<7} {'read_batch fr/s':>15} {'PIL limit fr/s':>15} {'vs limit':>9} "
        f"{'minari fr/s':>12} {'vs minari':>10}"
    )
    for fmt in ("hdf5", "arrow"):
        print(_measure(root, fmt, args.steps, args.batch, args.repeats))
    print(
        "vs limit: read_batch against decode alone (1.0: reading and gathering cost nothing); "
        "vs minari: against iterate_episodes, which decodes whole episodes in order."
    )


if __name__ == "__main__":
    sys.exit(main())
