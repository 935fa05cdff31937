"""Numpy arrays inside a JSON checkpoint: raw little-endian bytes in base64, no pickle."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.store.integrity import as_bytes

__all__ = ["decode_arrays", "encode_arrays", "encode_arrays_json", "json_pieces"]

# Plain numeric dtypes only: decoding never builds objects.
_KINDS = "biuf"


def _entries(arrays: Mapping[str, np.ndarray]) -> list[tuple[str, dict[str, Any], bytes]]:
    out = []
    for name, value in arrays.items():
        a = np.asarray(value)
        if a.dtype.kind not in _KINDS:
            raise TypeError(f"array {name!r} has dtype {a.dtype}; only numbers are encoded")
        a = np.asarray(a, dtype=a.dtype.newbyteorder("<"))
        if not a.flags.c_contiguous:  # (ascontiguousarray would make a 0-d array 1-d)
            a = a.copy()
        data = base64.b64encode(as_bytes(a))
        out.append((name, {"dtype": a.dtype.str, "shape": list(a.shape)}, data))
    return out


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """``{name: {"dtype", "shape", "data"}}``: JSON-safe, 4/3 of the arrays' bytes.

    grain's Orbax handler writes a state as text, so the bytes go as base64
    (one C pass over them, no per-element formatting).
    """
    return {name: {**head, "data": data.decode("ascii")} for name, head, data in _entries(arrays)}


def encode_arrays_json(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``json.dumps(encode_arrays(arrays)).encode()``, without passing megabytes of base64
    through the JSON encoder (base64 needs no escaping)."""
    return b"".join(json_pieces(arrays))


def json_pieces(arrays: Mapping[str, np.ndarray]) -> list[bytes]:
    """The pieces of :func:`encode_arrays_json`, for a caller that joins more around them."""
    pieces = [b"{"]
    for i, (name, head, data) in enumerate(_entries(arrays)):
        meta = json.dumps({**head, "data": ""})[:-3]  # up to the data's opening quote
        sep = ", " if i else ""
        pieces += [f'{sep}{json.dumps(name)}: {meta}"'.encode(), data, b'"}']
    pieces.append(b"}")
    return pieces


def decode_arrays(encoded: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays :func:`encode_arrays` encoded.

    Raises:
      ValueError: an entry is malformed (wrong dtype, size or base64).
    """
    out: dict[str, np.ndarray] = {}
    for name, entry in encoded.items():
        try:
            dtype = np.dtype(entry["dtype"])
            shape = tuple(int(s) for s in entry["shape"])
            raw = base64.b64decode(entry["data"], validate=True)
        except (KeyError, TypeError, binascii.Error) as e:
            raise ValueError(f"array {name!r}: {type(e).__name__}: {e}") from None
        if dtype.kind not in _KINDS:
            raise ValueError(f"array {name!r} has dtype {dtype}")
        want = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if len(raw) != want:
            raise ValueError(f"array {name!r} holds {len(raw)} bytes, its shape needs {want}")
        out[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out
