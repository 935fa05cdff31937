"""Runs in the rlds venv (make test-rlds): writes an RLDS dataset with TFDS's own builder and
dumps what ``tfds.builder_from_directory(...).as_dataset()`` returns, step by step, for the
main venv's tests to compare.

Usage:
  python rlds_peer.py write ROOT [--episodes 5] [--length 6] [--size 16] [--shards 3]
  python rlds_peer.py dump DATASET_DIR OUT.npz
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

INSTRUCTIONS = ("pick up the red block", "open the drawer", "")


def _features(size: int):  # type: ignore[no-untyped-def]
    import tensorflow_datasets as tfds

    f = tfds.features
    return f.FeaturesDict(
        {
            "steps": tfds.features.Dataset(
                {
                    "observation": f.FeaturesDict(
                        {
                            "image": f.Image(shape=(size, size, 3), encoding_format="jpeg"),
                            "wrist_image": f.Image(shape=(size, size, 3), encoding_format="png"),
                            "state": f.Tensor(shape=(4,), dtype=np.float32),
                            "depth": f.Tensor(shape=(2, 3), dtype=np.uint16),
                        }
                    ),
                    "action": f.Tensor(shape=(7,), dtype=np.float32),
                    "reward": f.Scalar(dtype=np.float32),
                    "discount": f.Scalar(dtype=np.float32),
                    "is_first": f.Scalar(dtype=np.bool_),
                    "is_last": f.Scalar(dtype=np.bool_),
                    "is_terminal": f.Scalar(dtype=np.bool_),
                    "language_instruction": f.Text(),
                    "language_embedding": f.Tensor(shape=(3,), dtype=np.float64),
                    "gripper": f.Tensor(shape=(), dtype=np.int32),
                    "raw": f.Tensor(shape=(2,), dtype=np.uint8, encoding="zlib"),
                }
            ),
            "episode_metadata": f.FeaturesDict(
                {"file_path": f.Text(), "episode_id": f.Scalar(dtype=np.int64)}
            ),
        }
    )


def episode(e: int, length: int, size: int) -> dict:
    rng = np.random.default_rng(e)
    steps = []
    for t in range(length):
        img = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
        img[: size // 2] = 40 + 10 * t  # flat regions: JPEG keeps something recognisable
        steps.append(
            {
                "observation": {
                    "image": img,
                    "wrist_image": rng.integers(0, 255, (size, size, 3), dtype=np.uint8),
                    "state": rng.standard_normal(4).astype(np.float32),
                    "depth": rng.integers(0, 60000, (2, 3)).astype(np.uint16),
                },
                "action": rng.standard_normal(7).astype(np.float32),
                "reward": np.float32(t == length - 1),
                "discount": np.float32(1.0),
                "is_first": t == 0,
                "is_last": t == length - 1,
                "is_terminal": t == length - 1 and e % 2 == 0,
                "language_instruction": INSTRUCTIONS[e % len(INSTRUCTIONS)],
                "language_embedding": rng.standard_normal(3),
                "gripper": np.int32(t - 2),
                "raw": rng.integers(0, 255, 2, dtype=np.uint8),
            }
        )
    return {"steps": steps, "episode_metadata": {"file_path": f"ep{e}.npy", "episode_id": 1000 + e}}


def write(root: str, episodes: int, length: int, size: int, shards: int) -> None:
    import tensorflow_datasets as tfds

    class ToyRlds(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):  # type: ignore[no-untyped-def]
            return tfds.core.DatasetInfo(builder=self, features=_features(size))

        def _split_generators(self, dl_manager):  # type: ignore[no-untyped-def]
            return {"train": self._generate_examples()}

        def _generate_examples(self):  # type: ignore[no-untyped-def]
            for e in range(episodes):
                yield f"ep{e}", episode(e, length + (e % 3) * 2, size)

    builder = ToyRlds(data_dir=root)
    # Several shards: TFDS would pick one for a dataset this small.
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=shards))
    print(builder.data_dir)


def dump(path: str, out: str) -> None:
    import tensorflow_datasets as tfds

    builder = tfds.builder_from_directory(path)
    ds = builder.as_dataset(split="train", shuffle_files=False)
    rows: dict[str, list] = {}
    meta: dict[str, list] = {}
    lengths = []
    for ep in tfds.as_numpy(ds):
        n = 0
        for step in ep["steps"]:
            flat = _flatten(step)
            for k, v in flat.items():
                rows.setdefault(k, []).append(v)
            n += 1
        lengths.append(n)
        for k, v in _flatten(ep["episode_metadata"], "episode_metadata/").items():
            meta.setdefault(k, []).append(v)
    arrays = {k: np.stack(v) for k, v in rows.items()}
    arrays.update({k: np.stack(v) for k, v in meta.items()})
    arrays["__lengths__"] = np.array(lengths)
    np.savez(out, **{k.replace("/", "|"): v for k, v in arrays.items()})


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = np.asarray(v)
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("root")
    w.add_argument("--episodes", type=int, default=5)
    w.add_argument("--length", type=int, default=6)
    w.add_argument("--size", type=int, default=16)
    w.add_argument("--shards", type=int, default=3)
    d = sub.add_parser("dump")
    d.add_argument("path")
    d.add_argument("out")
    a = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if a.cmd == "write":
        write(a.root, a.episodes, a.length, a.size, a.shards)
    else:
        dump(a.path, a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
