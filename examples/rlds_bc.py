"""Behaviour cloning with 16-step action chunks from an RLDS dataset, without TensorFlow.

RLDS (Open X-Embodiment, DROID, Bridge, LIBERO's ports) is read in place, shards and all:

    gr.RLDSDataSource(dataset, keys=[camera, state, action])   # steps, images decoded
    -> gr.SequenceDataSource(offsets={"action": range(16)})    # chunk t..t+15, edge-padded
    -> gr.make_data_loader(batch_size=B/P)                     # shuffled, per process
    -> gr.sharded_device_put(mesh)                             # jax.Arrays over every device

and a small MLP on the (pooled) camera image and the state predicts the whole chunk of
actions, with the padded positions of each chunk masked out of the mean squared error
(SGD with momentum in pure JAX, no flax or optax).

Without ``--dataset`` a toy RLDS dataset is written first, in TFDS's published layout
(``dataset_info.json``, ``features.json``, ``toy-train.tfrecord-0000X-of-0000Y``): a
point moves toward a target drawn in the 32x32 camera image, and the expert's action is
the step toward it, so the chunk is learnable from the image and the state.

Run it::

    python examples/rlds_bc.py                                   # toy dataset in a temp dir
    python examples/rlds_bc.py --dataset ~/tensorflow_datasets/bridge/1.0.0 \\
        --camera observation/image --state observation/state --steps 2000
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/rlds_bc.py

The global batch size must be a multiple of the device count (default 64).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import struct
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import grain_replay as gr
from grain_replay.datasets.rlds.tfrecord import masked_crc

CHUNK = 16
SIZE = 32
POOL = 8  # the image is average-pooled to POOL x POOL before the MLP
_TFDS = "tensorflow_datasets.core.features."
# Training steps dispatched ahead of the host before it waits for one to finish: on
# jaxlib before 0.12 with several CPU devices, more queued steps with an all-reduce can
# make XLA abort ("Expected 8 threads to join the rendezvous, but only 7 of them arrived").
_MAX_IN_FLIGHT = 8


# -- a toy RLDS dataset in TFDS's layout (what TFDS's writer produces, minus TensorFlow) ---


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _example(features: dict[str, bytes]) -> bytes:
    """A serialized ``tf.train.Example``: a map from feature name to Feature."""
    entries = b"".join(
        _field(1, _field(1, name.encode()) + _field(2, feat)) for name, feat in features.items()
    )
    return _field(1, entries)


def _floats(values: np.ndarray) -> bytes:
    return _field(2, _field(1, np.asarray(values, "<f4").tobytes()))


def _ints(values: np.ndarray) -> bytes:
    return _field(3, _field(1, b"".join(_varint(int(v)) for v in np.asarray(values).reshape(-1))))


def _bytes(values: list[bytes]) -> bytes:
    return _field(1, b"".join(_field(1, v) for v in values))


def _tensor(dtype: str, shape: tuple[int, ...] = ()) -> dict[str, Any]:
    dims = {"dimensions": [str(d) for d in shape]} if shape else {}
    return {
        "pythonClassName": _TFDS + "tensor_feature.Tensor",
        "tensor": {"dtype": dtype, "encoding": "none", "shape": dims},
    }


def _dict(features: dict[str, Any]) -> dict[str, Any]:
    return {
        "pythonClassName": _TFDS + "features_dict.FeaturesDict",
        "featuresDict": {"features": features},
    }


def write_toy_dataset(root: str, episodes: int, seed: int = 0, shards: int = 2) -> str:
    """Writes ``episodes`` episodes of the point-to-target task; returns ``root``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    records = []
    for _ in range(episodes):
        n = int(rng.integers(30, 60))
        target = rng.uniform(0.15, 0.85, 2)
        pos = np.empty((n, 2), np.float32)
        act = np.empty((n, 2), np.float32)
        p = rng.uniform(0.1, 0.9, 2)
        for t in range(n):
            pos[t] = p
            act[t] = np.clip(target - p, -0.05, 0.05) + rng.normal(0, 0.002, 2)
            p = p + act[t]
        img = np.full((SIZE, SIZE, 3), 30, np.uint8)
        y, x = (target * SIZE).astype(int)
        img[max(0, y - 3) : y + 3, max(0, x - 3) : x + 3] = 230
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        jpegs = [buf.getvalue()] * n  # the target does not move within an episode
        flags = np.arange(n)
        records.append(
            _example(
                {
                    "steps/observation/image": _bytes(jpegs),
                    "steps/observation/state": _floats(pos),
                    "steps/action": _floats(act),
                    "steps/is_first": _ints(flags == 0),
                    "steps/is_last": _ints(flags == n - 1),
                    "steps/is_terminal": _ints(flags == n - 1),
                }
            )
        )
    steps = {
        "observation": _dict(
            {
                "image": {
                    "pythonClassName": _TFDS + "image_feature.Image",
                    "image": {
                        "dtype": "uint8",
                        "encodingFormat": "jpeg",
                        "shape": {"dimensions": [str(SIZE), str(SIZE), "3"]},
                    },
                },
                "state": _tensor("float32", (2,)),
            }
        ),
        "action": _tensor("float32", (2,)),
        "is_first": _tensor("bool"),
        "is_last": _tensor("bool"),
        "is_terminal": _tensor("bool"),
    }
    features = _dict(
        {
            "steps": {
                "pythonClassName": _TFDS + "dataset_feature.Dataset",
                "sequence": {"feature": _dict(steps), "length": "-1"},
            }
        }
    )
    bounds = np.linspace(0, len(records), shards + 1).round().astype(int)
    lengths = []
    for i in range(shards):
        part = records[bounds[i] : bounds[i + 1]]
        lengths.append(str(len(part)))
        with open(os.path.join(root, f"toy-train.tfrecord-{i:05d}-of-{shards:05d}"), "wb") as f:
            for r in part:  # TFRecord framing: length, its masked CRC32C, data, its CRC
                head = struct.pack("<Q", len(r))
                f.write(head + struct.pack("<I", masked_crc(head)))
                f.write(r + struct.pack("<I", masked_crc(r)))
    with open(os.path.join(root, "features.json"), "w") as f:
        json.dump(features, f)
    info = {"name": "toy", "fileFormat": "tfrecord", "version": "1.0.0"}
    info["splits"] = [{"name": "train", "shardLengths": lengths}]
    with open(os.path.join(root, "dataset_info.json"), "w") as f:
        json.dump(info, f)
    return root


# -- the policy ---------------------------------------------------------------------------


def features(image: jax.Array, state: jax.Array) -> jax.Array:
    """The camera average-pooled to POOL x POOL, in [0, 1], next to the state."""
    b, h, w, c = image.shape
    x = image.astype(jnp.float32).reshape(b, POOL, h // POOL, POOL, w // POOL, c) / 255.0
    return jnp.concatenate([x.mean(axis=(2, 4)).reshape(b, -1), state.reshape(b, -1)], axis=1)


def init_params(seed: int, in_dim: int, hidden: int, out_dim: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((in_dim, hidden)) / np.sqrt(in_dim)).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, out_dim)) * 0.01).astype(np.float32),
        "b2": np.zeros(out_dim, np.float32),
    }


def masked_mse(params: dict[str, Any], scale: jax.Array, batch: dict[str, Any]) -> jax.Array:
    """Mean squared error over the chunk's real (not padded) actions, in units of ``scale``."""
    obs = batch["observation"]
    x = features(obs["image"][:, 0], obs["state"][:, 0])
    pred = (jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]).reshape(
        batch["action"].shape
    )
    err = ((pred - batch["action"] / scale) ** 2).mean(axis=-1)
    keep = 1.0 - batch["action_is_pad"].astype(jnp.float32)
    return (err * keep).sum() / jnp.maximum(keep.sum(), 1.0)


def make_train_step(learning_rate: float, momentum: float) -> Any:
    @jax.jit
    def train_step(params: Any, velocity: Any, scale: Any, batch: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(masked_mse)(params, scale, batch)
        velocity = jax.tree_util.tree_map(lambda v, g: momentum * v + g, velocity, grads)
        params = jax.tree_util.tree_map(lambda p, v: p - learning_rate * v, params, velocity)
        return params, velocity, loss

    return train_step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--dataset", help="an RLDS dataset folder (default: a toy one)")
    parser.add_argument("--camera", default="observation/image")
    parser.add_argument("--state", default="observation/state")
    parser.add_argument("--episodes", type=int, default=40, help="toy dataset's episodes")
    parser.add_argument("--steps", type=int, default=600, help="training steps")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="global batch size, a multiple of the devices"
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--workers", type=int, default=0, help="grain worker processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    args = parser.parse_args(argv)
    devices = jax.device_count()
    if args.batch_size <= 0 or args.batch_size % devices:
        parser.error(f"--batch-size {args.batch_size} does not split over {devices} device(s)")
    return args


def train(args: argparse.Namespace, dataset: str) -> dict[str, Any]:
    steps = gr.RLDSDataSource(dataset, keys=[args.camera, args.state, "action"], progress=False)
    spec = steps.spec
    chunks = gr.SequenceDataSource(
        steps,
        offsets={args.camera: [0], args.state: [0], "action": list(range(CHUNK))},
        pad="edge",
    )
    loader = gr.make_data_loader(
        chunks,
        batch_size=args.batch_size // jax.process_count(),
        seed=args.seed,
        num_epochs=None,
        worker_count=args.workers,
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    channels = spec[args.camera].shape[-1]
    in_dim = POOL * POOL * channels + int(np.prod(spec[args.state].shape))
    act_dim = int(np.prod(spec["action"].shape))
    sample = steps.read_leaf("action", np.arange(min(len(steps), 10_000)))
    scale = jax.device_put(np.float32(np.abs(sample).mean() + 1e-6), replicated)
    host = init_params(args.seed, in_dim, args.hidden, CHUNK * act_dim)
    params = jax.device_put(host, replicated)
    velocity = jax.device_put(jax.tree_util.tree_map(np.zeros_like, host), replicated)
    train_step = make_train_step(args.learning_rate, args.momentum)
    losses = []
    start = time.perf_counter()
    with gr.sharded_device_put(loader, mesh, prefetch=2) as batches:
        for step, batch in zip(range(args.steps), batches):
            params, velocity, loss = train_step(params, velocity, scale, batch)
            losses.append(loss)
            if len(losses) > _MAX_IN_FLIGHT:
                losses[-_MAX_IN_FLIGHT - 1].block_until_ready()
            if step == 0:
                print(f"step     0  loss {float(loss):.4f}  (initial)", flush=True)
                start = time.perf_counter()
            elif args.log_every and step % args.log_every == 0:
                print(f"step {step:5d}  loss {float(loss):.4f}", flush=True)
        jax.block_until_ready(params)
    elapsed = time.perf_counter() - start
    values = [float(x) for x in jax.device_get(losses)]
    tail = max(1, min(20, len(values) // 5))
    result = {
        "dataset": dataset,
        "steps": len(values),
        "records": len(steps),
        "episodes": len(steps.episode_ends),
        "initial_loss": values[0],
        "final_loss": float(np.mean(values[-tail:])),
        "steps_per_s": (len(values) - 1) / max(elapsed, 1e-9),
        "devices": jax.device_count(),
    }
    print(
        f"{result['records']} steps in {result['episodes']} episodes; loss "
        f"{result['initial_loss']:.4f} -> {result['final_loss']:.4f}; "
        f"{result['steps_per_s']:.1f} train steps/s"
    )
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.dataset:
        return train(args, os.path.expanduser(args.dataset))
    with tempfile.TemporaryDirectory(prefix="rlds_bc_") as tmp:
        dataset = write_toy_dataset(os.path.join(tmp, "toy", "1.0.0"), args.episodes, args.seed)
        return train(args, dataset)


if __name__ == "__main__":
    main()
