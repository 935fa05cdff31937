"""Writes RLDS datasets in TFDS's published layout without TensorFlow (for the default suite).

``write_rlds(root, ...)`` writes ``dataset_info.json``, ``features.json`` and
``<name>-train.tfrecord-XXXXX-of-YYYYY`` shards, one ``tf.train.Example`` per
episode with the step features flattened as ``steps/<path>`` lists, exactly as
TFDS's example serializer does, and returns the steps it wrote.
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.datasets.rlds.tfrecord import masked_crc

INSTRUCTIONS = ("pick up the red block", "open the drawer", "")
P = "tensorflow_datasets.core.features."


# -- protobuf wire format -------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def feature_bytes(values: Sequence[bytes]) -> bytes:
    return _len_field(1, b"".join(_len_field(1, v) for v in values))


def feature_floats(values: np.ndarray, packed: bool = True) -> bytes:
    v = np.asarray(values, "<f4").reshape(-1)
    if packed:
        body = _len_field(1, v.tobytes()) if v.size else b""
    else:
        body = b"".join(b"\x0d" + x.tobytes() for x in v)
    return _len_field(2, body)


def feature_ints(values: np.ndarray, packed: bool = True) -> bytes:
    v = np.asarray(values).astype(np.int64).reshape(-1)
    if packed:
        body = _len_field(1, b"".join(_varint(int(x)) for x in v)) if v.size else b""
    else:
        body = b"".join(b"\x08" + _varint(int(x)) for x in v)
    return _len_field(3, body)


def example(features: dict[str, bytes]) -> bytes:
    entries = b"".join(
        _len_field(1, _len_field(1, k.encode()) + _len_field(2, v)) for k, v in features.items()
    )
    return _len_field(1, entries)


def tfrecord(records: Sequence[bytes]) -> bytes:
    out = bytearray()
    for r in records:
        head = struct.pack("<Q", len(r))
        out += head + struct.pack("<I", masked_crc(head)) + r + struct.pack("<I", masked_crc(r))
    return bytes(out)


# -- features.json ----------------------------------------------------------------------


def tensor(dtype: str, shape: Sequence[int] = (), encoding: str = "none") -> dict[str, Any]:
    cls = "scalar.Scalar" if not shape else "tensor_feature.Tensor"
    t: dict[str, Any] = {"dtype": dtype, "encoding": encoding, "shape": {}}
    if shape:
        t["shape"] = {"dimensions": [str(d) for d in shape]}
    return {"pythonClassName": P + cls, "tensor": t}


def image(size: int, fmt: str) -> dict[str, Any]:
    dims = [str(size), str(size), "3"]
    return {
        "pythonClassName": P + "image_feature.Image",
        "image": {"dtype": "uint8", "encodingFormat": fmt, "shape": {"dimensions": dims}},
    }


def text() -> dict[str, Any]:
    return {"pythonClassName": P + "text_feature.Text", "text": {}}


def fdict(features: dict[str, Any]) -> dict[str, Any]:
    return {
        "pythonClassName": P + "features_dict.FeaturesDict",
        "featuresDict": {"features": features},
    }


def step_features(size: int, cameras: int = 2) -> dict[str, Any]:
    obs: dict[str, Any] = {"state": tensor("float32", (4,))}
    for c in range(cameras):
        obs["image" if c == 0 else f"image_{c}"] = image(size, "jpeg" if c == 0 else "png")
    return {
        "observation": fdict(obs),
        "action": tensor("float32", (7,)),
        "reward": tensor("float32"),
        "discount": tensor("float32"),
        "is_first": tensor("bool"),
        "is_last": tensor("bool"),
        "is_terminal": tensor("bool"),
        "language_instruction": text(),
    }


def features_json(steps: dict[str, Any], episode: dict[str, Any] | None = None) -> dict[str, Any]:
    top: dict[str, Any] = {
        "steps": {
            "pythonClassName": P + "dataset_feature.Dataset",
            "sequence": {"feature": fdict(steps), "length": "-1"},
        }
    }
    if episode is not None:
        top["episode_metadata"] = fdict(episode)
    return fdict(top)


# -- datasets ---------------------------------------------------------------------------


def _encode_image(img: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG" if fmt == "jpeg" else "PNG", quality=90)
    return buf.getvalue()


def _decode_image(data: bytes) -> np.ndarray:
    # As the reader decodes (simplejpeg when installed, else Pillow): tested apart in
    # test_rlds_source.py against Pillow and, in make test-rlds, against TensorFlow.
    from grain_replay.datasets.rlds.images import decode_image, jpeg_decoder

    return decode_image(data, (*np.asarray(_shape_of(data)), 3), np.dtype(np.uint8), jpeg_decoder())


def _shape_of(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.height, im.width


def write_rlds(
    root: str | os.PathLike[str],
    *,
    lengths: Sequence[int] = (5, 3, 7, 4, 6),
    shards: int = 3,
    size: int = 8,
    cameras: int = 2,
    packed: bool = True,
    name: str = "toy_rlds",
    seed: int = 0,
    images: bool = True,
) -> dict[str, np.ndarray]:
    """Writes the dataset and returns ``{leaf: (N, ...) array}`` of the steps in read order,
    episode leaves (``episode_metadata/...``) repeated per step, and ``"__lengths__"``.

    ``images=False``: the image leaves are left out of what is returned (they are written
    all the same): decoding every frame back is a third of the time of a big dataset's
    write, wasted where only the files are wanted."""
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows: dict[str, list[Any]] = {}
    records: list[bytes] = []
    for e, n in enumerate(lengths):
        instr = INSTRUCTIONS[e % len(INSTRUCTIONS)].encode()
        steps: dict[str, Any] = {
            "observation/state": rng.standard_normal((n, 4)).astype(np.float32),
            "action": rng.standard_normal((n, 7)).astype(np.float32),
            "reward": (np.arange(n) == n - 1).astype(np.float32),
            "discount": np.ones(n, np.float32),
            "is_first": np.arange(n) == 0,
            "is_last": np.arange(n) == n - 1,
            "is_terminal": (np.arange(n) == n - 1) & (e % 2 == 0),
            "language_instruction": np.array([instr] * n, dtype=object),
        }
        blobs: dict[str, list[bytes]] = {}
        for c in range(cameras):
            key = "observation/image" if c == 0 else f"observation/image_{c}"
            fmt = "jpeg" if c == 0 else "png"
            imgs = rng.integers(0, 255, (n, size, size, 3), dtype=np.uint8)
            imgs[:, : size // 2] = (40 + 10 * np.arange(n) + 60 * c)[:, None, None, None]
            blobs[key] = [_encode_image(im, fmt) for im in imgs]
            if images:
                steps[key] = np.stack([_decode_image(b) for b in blobs[key]])
        meta = {"file_path": f"ep{e}.npy".encode(), "episode_id": 1000 + e}
        feats: dict[str, bytes] = {}
        for key, v in steps.items():
            name_ = "steps/" + key
            if key in blobs:
                continue  # below, in the same order with or without ``images``
            if key == "language_instruction":
                feats[name_] = feature_bytes(list(v))
            elif v.dtype.kind == "f":
                feats[name_] = feature_floats(v, packed)
            else:
                feats[name_] = feature_ints(v, packed)
        feats.update({"steps/" + key: feature_bytes(b) for key, b in blobs.items()})
        feats["episode_metadata/file_path"] = feature_bytes([meta["file_path"]])
        feats["episode_metadata/episode_id"] = feature_ints(np.array([meta["episode_id"]]), packed)
        records.append(example(feats))
        for key, v in steps.items():
            rows.setdefault(key, []).append(v)
        rows.setdefault("episode_metadata/file_path", []).append(
            np.array([meta["file_path"]] * n, dtype=object)
        )
        rows.setdefault("episode_metadata/episode_id", []).append(np.full(n, meta["episode_id"]))
    bounds = np.linspace(0, len(records), shards + 1).round().astype(int)
    shard_lengths = []
    for i in range(shards):
        part = records[bounds[i] : bounds[i + 1]]
        shard_lengths.append(str(len(part)))
        with open(os.path.join(root, f"{name}-train.tfrecord-{i:05d}-of-{shards:05d}"), "wb") as f:
            f.write(tfrecord(part))
    episode = {"file_path": text(), "episode_id": tensor("int64")}
    with open(os.path.join(root, "features.json"), "w") as f:
        json.dump(features_json(step_features(size, cameras), episode), f, indent=1)
    info = {
        "fileFormat": "tfrecord",
        "name": name,
        "splits": [
            {
                "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
                "name": "train",
                "shardLengths": shard_lengths,
            }
        ],
        "version": "1.0.0",
    }
    with open(os.path.join(root, "dataset_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    out = {k: np.concatenate(v) for k, v in rows.items()}
    for k in ("language_instruction", "episode_metadata/file_path"):
        out[k] = out[k].astype(bytes)
    out["__lengths__"] = np.asarray(lengths)
    return out


def write_rlds_columns(
    root: str | os.PathLike[str],
    steps: dict[str, np.ndarray],
    lengths: Sequence[int],
    *,
    shards: int = 2,
    name: str = "cols",
) -> str:
    """An RLDS dataset whose step features are the numeric ``steps`` arrays (rows in read
    order, episodes of ``lengths``), plus the RLDS flags; returns ``root``."""
    root = os.fspath(root)
    os.makedirs(root, exist_ok=True)
    ends = np.cumsum(lengths)
    records = []
    for e, n in enumerate(lengths):
        a = int(ends[e]) - n
        feats = {}
        for key, v in steps.items():
            part = np.asarray(v)[a : a + n]
            pack = feature_floats if part.dtype.kind == "f" else feature_ints
            feats["steps/" + key] = pack(part)
        t = np.arange(n)
        feats["steps/is_first"] = feature_ints(t == 0)
        feats["steps/is_last"] = feature_ints(t == n - 1)
        feats["steps/is_terminal"] = feature_ints(t == n - 1)
        records.append(example(feats))
    decl = {k: tensor(np.asarray(v).dtype.name, np.asarray(v).shape[1:]) for k, v in steps.items()}
    decl.update({k: tensor("bool") for k in ("is_first", "is_last", "is_terminal")})
    bounds = np.linspace(0, len(records), shards + 1).round().astype(int)
    shard_lengths = []
    for i in range(shards):
        part = records[bounds[i] : bounds[i + 1]]
        shard_lengths.append(str(len(part)))
        with open(os.path.join(root, f"{name}-train.tfrecord-{i:05d}-of-{shards:05d}"), "wb") as f:
            f.write(tfrecord(part))
    with open(os.path.join(root, "features.json"), "w") as f:
        json.dump(features_json(decl), f)
    info = {"fileFormat": "tfrecord", "name": name, "version": "1.0.0"}
    info["splits"] = [{"name": "train", "shardLengths": shard_lengths}]
    with open(os.path.join(root, "dataset_info.json"), "w") as f:
        json.dump(info, f)
    return root


# -- sequences -------------------------------------------------------------------------


def expected_windows(
    data: dict[str, np.ndarray], lengths: Any, offsets: dict[str, list[int]], pad: str
) -> tuple[list[int], dict[str, np.ndarray]]:
    """The anchors and each leaf and mask of every record, built step by step."""
    ends = np.cumsum(lengths)
    starts = ends - np.asarray(lengths)
    every = [o for offs in offsets.values() for o in offs]
    lo, hi = min(min(every), 0), max(max(every), 0)
    anchors = []
    for a, e in zip(starts.tolist(), ends.tolist()):
        for t in range(a, e):
            if pad != "drop" or (t + lo >= a and t + hi < e):
                anchors.append(t)
    ep_of = {t: (a, e) for a, e in zip(starts.tolist(), ends.tolist()) for t in range(a, e)}
    out: dict[str, Any] = {}
    for key, offs in offsets.items():
        rows, masks = [], []
        for t in anchors:
            a, e = ep_of[t]
            steps = [t + o for o in offs]
            mask = [not (a <= s < e) for s in steps]
            vals = data[key][[min(max(s, a), e - 1) for s in steps]].copy()
            if pad == "zero":
                vals[np.array(mask)] = 0
            rows.append(vals)
            masks.append(mask)
        out[key] = np.stack(rows)
        out[key + "_is_pad"] = np.array(masks, bool)
    return anchors, out


def flat_batch(batch: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """A batch tree as ``{"a/b": array}``."""
    out: dict[str, np.ndarray] = {}
    for k, v in batch.items():
        if isinstance(v, dict):
            out.update(flat_batch(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out
