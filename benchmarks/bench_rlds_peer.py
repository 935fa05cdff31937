"""The TensorFlow side of bench_rlds.py, run in the rlds venv (make test-rlds builds it).

Usage:
  python bench_rlds_peer.py write ROOT --episodes E --length T --size S --format FMT
  python bench_rlds_peer.py tfdata DATASET_DIR --batches K --shuffle 10000
  python bench_rlds_peer.py datasource DATASET_DIR --batches K
(FMT: tfrecord or array_record.) Each timing command prints one JSON line: {"steps_per_s": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

BATCH = 256


def write(root: str, episodes: int, length: int, size: int, fmt: str) -> None:
    import tensorflow_datasets as tfds

    f = tfds.features

    class BenchRlds(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):  # type: ignore[no-untyped-def]
            cam = f.Image(shape=(size, size, 3), encoding_format="jpeg")
            steps = {
                "observation": f.FeaturesDict(
                    {
                        "image": cam,
                        "wrist_image": cam,
                        "state": f.Tensor(shape=(8,), dtype=np.float32),
                    }
                ),
                "action": f.Tensor(shape=(7,), dtype=np.float32),
                "reward": f.Scalar(dtype=np.float32),
                "discount": f.Scalar(dtype=np.float32),
                "is_first": f.Scalar(dtype=np.bool_),
                "is_last": f.Scalar(dtype=np.bool_),
                "is_terminal": f.Scalar(dtype=np.bool_),
                "language_instruction": f.Text(),
            }
            return tfds.core.DatasetInfo(
                builder=self,
                features=f.FeaturesDict({"steps": tfds.features.Dataset(steps)}),
            )

        def _split_generators(self, dl_manager):  # type: ignore[no-untyped-def]
            return {"train": self._generate_examples()}

        def _generate_examples(self):  # type: ignore[no-untyped-def]
            rng = np.random.default_rng(0)
            yy, xx = np.mgrid[0:size, 0:size]
            for e in range(episodes):
                steps = []
                for t in range(length):
                    # Smooth frames (JPEG-typical sizes), different per step.
                    base = (np.sin(xx / 9 + t / 5 + e) + np.cos(yy / 7 - t / 3)) * 60 + 128
                    img = np.stack([base, base[::-1], base[:, ::-1]], -1).astype(np.uint8)
                    steps.append(
                        {
                            "observation": {
                                "image": img,
                                "wrist_image": img[::-1].copy(),
                                "state": rng.standard_normal(8).astype(np.float32),
                            },
                            "action": rng.standard_normal(7).astype(np.float32),
                            "reward": np.float32(t == length - 1),
                            "discount": np.float32(1),
                            "is_first": t == 0,
                            "is_last": t == length - 1,
                            "is_terminal": t == length - 1,
                            "language_instruction": "pick up the block",
                        }
                    )
                yield f"ep{e}", {"steps": steps}

    builder = BenchRlds(data_dir=root, file_format=fmt)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=4))
    print(builder.data_dir)


def _chunked(ep, chunk: int):  # type: ignore[no-untyped-def]
    """octo's trajectory transform: each step gets the next ``chunk`` actions (edge-padded)."""
    import tensorflow as tf

    steps = ep["steps"].batch(1 << 20).get_single_element()  # the whole trajectory
    n = tf.shape(steps["action"])[0]
    idx = tf.minimum(tf.range(n)[:, None] + tf.range(chunk)[None, :], n - 1)
    steps["action"] = tf.gather(steps["action"], idx)
    return tf.data.Dataset.from_tensor_slices(steps)


def tfdata(path: str, batches: int, shuffle: int, chunk: int = 0) -> None:
    """octo/openpi's pipeline: episodes -> steps -> shuffle buffer -> batch, images decoded."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    builder = tfds.builder_from_directory(path)
    ds = builder.as_dataset(split="train", shuffle_files=True)
    if chunk:
        ds = ds.flat_map(lambda ep: _chunked(ep, chunk)).repeat()
    else:
        ds = ds.flat_map(lambda ep: ep["steps"]).repeat()
    ds = ds.shuffle(shuffle).batch(BATCH).prefetch(tf.data.AUTOTUNE)
    it = iter(ds)
    for _ in range(2):  # warm-up (fills the shuffle buffer)
        next(it)
    t = time.perf_counter()
    for _ in range(batches):
        b = next(it)
        b["observation"]["image"].numpy()
    dt = time.perf_counter() - t
    print(json.dumps({"steps_per_s": batches * BATCH / dt}))


def datasource(path: str, batches: int) -> None:
    """Random steps through ``as_data_source()`` (an episode per record, decoded whole)."""
    import tensorflow_datasets as tfds

    builder = tfds.builder_from_directory(path)
    src = builder.as_data_source(split="train")
    lengths = np.array([len(src[i]["steps"]) for i in range(len(src))])
    ends = np.cumsum(lengths)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    for _ in range(batches):
        steps = rng.integers(0, ends[-1], BATCH)
        ep = np.searchsorted(ends, steps, side="right")
        j = steps - (ends[ep] - lengths[ep])
        rows = [src[int(e)]["steps"][int(k)] for e, k in zip(ep, j)]
        np.stack([r["observation"]["image"] for r in rows])
    dt = time.perf_counter() - t
    print(json.dumps({"steps_per_s": batches * BATCH / dt}))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("root")
    w.add_argument("--episodes", type=int, default=40)
    w.add_argument("--length", type=int, default=50)
    w.add_argument("--size", type=int, default=128)
    w.add_argument("--format", default="tfrecord")
    for name in ("tfdata", "datasource"):
        s = sub.add_parser(name)
        s.add_argument("path")
        s.add_argument("--batches", type=int, default=5)
        s.add_argument("--shuffle", type=int, default=10000)
        s.add_argument("--chunk", type=int, default=0)
    a = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if a.cmd == "write":
        write(a.root, a.episodes, a.length, a.size, a.format)
    elif a.cmd == "tfdata":
        tfdata(a.path, a.batches, a.shuffle, a.chunk)
    else:
        datasource(a.path, a.batches)


if __name__ == "__main__":
    main(sys.argv[1:])
