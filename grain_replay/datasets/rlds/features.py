"""TFDS's ``features.json`` for an RLDS dataset: the leaves, their dtypes, shapes and encodings."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.errors import InvalidStoreError, StoreNotFoundError
from grain_replay.store.formats import shown_path

__all__ = ["Feature", "read_dataset_json", "read_features", "STEPS", "EPISODE"]

STEPS = "steps"
EPISODE = "episode"
_PREFIX = "tensorflow_datasets.core.features."
_TENSOR = {"tensor_feature.Tensor", "scalar.Scalar", "feature.Tensor"}
_DICT = "features_dict.FeaturesDict"
_DATASET = "dataset_feature.Dataset"
_SUPPORTED = "FeaturesDict, Dataset (the steps), Tensor, Scalar, Image, Text and ClassLabel"


@dataclasses.dataclass(frozen=True)
class Feature:
    """One leaf of the dataset.

    Attributes:
      key: the leaf key (``observation/image``; ``episode_metadata/file_path``).
      name: the feature's name inside the ``tf.train.Example``
        (``steps/observation/image``).
      level: ``"steps"`` (one value per step) or ``"episode"`` (one per episode).
      kind: ``"tensor"`` (int64/float lists), ``"raw"`` (a Tensor stored as bytes,
        ``zlib`` when compressed), ``"image"`` (PNG/JPEG bytes) or ``"text"``.
      dtype, shape: what a record holds (text: ``S`` bytes, width found when indexed).
      compressed: a ``raw`` tensor stored zlib-compressed.
    """

    key: str
    name: str
    level: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]
    compressed: bool = False
    encoding: str | None = None

    @property
    def size(self) -> int:
        """Values per record."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def wire(self) -> str:
        """The Feature list kind in the Example: ``bytes``, ``float`` or ``int64``."""
        if self.kind != "tensor":
            return "bytes"
        return "float" if self.dtype.kind == "f" else "int64"


def _class(node: Mapping[str, Any]) -> str:
    name = str(node.get("pythonClassName", ""))
    return name[len(_PREFIX) :] if name.startswith(_PREFIX) else name


def _shape(node: Mapping[str, Any], key: str, where: str, cls: str) -> tuple[int, ...]:
    dims = node.get("shape", {}).get("dimensions", [])
    try:
        shape = tuple(int(d) for d in dims)
    except (TypeError, ValueError) as e:
        raise InvalidStoreError(f"{where}: feature {key!r} has the shape {dims!r}.") from e
    if any(d < 0 for d in shape):
        raise InvalidStoreError(
            f"{where}: feature {key!r} ({cls}) has a dynamic shape {list(shape)} (-1 is an "
            "unknown dimension); grain_replay reads fixed shapes only. Fix: leave it out with "
            "keys=[...], or convert the dataset with fixed shapes."
        )
    return shape


def _dtype(name: Any, key: str, where: str) -> np.dtype:
    if str(name) in ("string", "str", "object"):
        return np.dtype("S1")
    try:
        return np.dtype(str(name))
    except TypeError as e:
        raise InvalidStoreError(
            f"{where}: feature {key!r} has the dtype {name!r}, which is not a numpy dtype. "
            "Fix: leave it out with keys=[...]."
        ) from e


def _leaves(
    node: Mapping[str, Any], path: list[str], level: str, where: str, out: list[Feature]
) -> None:
    cls = _class(node)
    key = "/".join(path)
    name = key if level == EPISODE else "/".join([STEPS, *path])
    if cls == _DICT or ("featuresDict" in node and not cls):
        for child, sub in node.get("featuresDict", {}).get("features", {}).items():
            _leaves(sub, [*path, child], level, where, out)
        return
    if cls == _DATASET or ("sequence" in node and not cls):
        if level == STEPS or path != [STEPS]:
            raise InvalidStoreError(
                f"{where}: feature {key!r} is a {cls or 'Sequence'} inside "
                f"{'the steps' if level == STEPS else 'the episode'}; RLDS has one Dataset of "
                "steps at the top ('steps'), and grain_replay reads no other nested sequence. "
                "Fix: leave it out with keys=[...]."
            )
        _leaves(node["sequence"]["feature"], [], STEPS, where, out)
        return
    if cls in _TENSOR or (not cls and "tensor" in node):
        t = node.get("tensor", {})
        dtype = _dtype(t.get("dtype"), key, where)
        encoding = str(t.get("encoding", "none") or "none").lower()
        shape = _shape(t, key, where, cls)
        if dtype.kind in "SUO":
            out.append(Feature(key, name, level, "text", np.dtype("S1"), shape))
            return
        if encoding not in ("none", "bytes", "zlib"):
            raise InvalidStoreError(
                f"{where}: feature {key!r} (Tensor) has the encoding {encoding!r}; "
                "grain_replay reads 'none', 'bytes' and 'zlib'. Fix: leave it out with keys=[...]."
            )
        kind = "tensor" if encoding == "none" else "raw"
        out.append(Feature(key, name, level, kind, dtype, shape, compressed=encoding == "zlib"))
        return
    if cls == "image_feature.Image" or (not cls and "image" in node):
        t = node.get("image", {})
        dtype = _dtype(t.get("dtype", "uint8"), key, where)
        shape = _shape(t, key, where, "Image")
        if len(shape) != 3 or dtype not in (np.uint8, np.uint16):
            raise InvalidStoreError(
                f"{where}: feature {key!r} (Image) is {dtype}{list(shape)}; grain_replay "
                "decodes uint8/uint16 images of shape (height, width, channels). Fix: leave "
                "it out with keys=[...]."
            )
        fmt = t.get("encodingFormat")
        out.append(Feature(key, name, level, "image", dtype, shape, encoding=fmt))
        return
    if cls == "text_feature.Text" or (not cls and "text" in node):
        out.append(Feature(key, name, level, "text", np.dtype("S1"), ()))
        return
    if cls == "class_label_feature.ClassLabel" or (not cls and "classLabel" in node):
        out.append(Feature(key, name, level, "tensor", np.dtype(np.int64), ()))
        return
    raise InvalidStoreError(
        f"{where}: feature {key!r} is a {cls or sorted(node)!r}, a feature type grain_replay "
        f"does not read (it reads {_SUPPORTED}). Fix: leave it out with keys=[...] naming the "
        "other features, or convert the dataset with TFDS to supported features."
    )


def read_dataset_json(root: str, name: str) -> tuple[str, Any]:
    """``(path, parsed JSON)`` of the file ``name`` of the TFDS-built dataset at ``root``.

    Raises:
      StoreNotFoundError: no such file (``root`` is not a TFDS-built dataset directory).
      InvalidStoreError: the file is not valid JSON.
    """
    where = os.path.join(root, name)
    try:
        with open(where, "rb") as f:
            return where, json.loads(f.read())
    except FileNotFoundError as e:
        raise StoreNotFoundError(
            f"{shown_path(where)} is missing: {root} is not a TFDS-built dataset directory. Fix: "
            "point "
            "at the folder holding dataset_info.json, features.json and the shards (e.g. "
            "~/tensorflow_datasets/NAME/VERSION)."
        ) from e
    except ValueError as e:
        raise InvalidStoreError(f"{where} is not valid JSON ({e}).") from e


def read_features(root: str) -> list[Feature]:
    """The leaves of the RLDS dataset at ``root``: step features first, then episode ones.

    Raises:
      StoreNotFoundError: no ``features.json``.
      InvalidStoreError: not an RLDS FeaturesDict with ``steps``, or a feature type
        grain_replay does not read (the message names it).
    """
    where, doc = read_dataset_json(root, "features.json")
    top = doc.get("featuresDict", {}).get("features") if isinstance(doc, dict) else None
    if not isinstance(top, dict) or STEPS not in top:
        raise InvalidStoreError(
            f"{where}: the top-level features have no 'steps' Dataset, so this is not an RLDS "
            f"dataset (features: {sorted(top or {})}). Fix: open an RLDS dataset (episodes "
            "with a 'steps' Dataset feature)."
        )
    out: list[Feature] = []
    _leaves(top[STEPS], [STEPS], EPISODE, where, out)
    for name, node in top.items():
        if name != STEPS:
            _leaves(node, [name], EPISODE, where, out)
    return out
