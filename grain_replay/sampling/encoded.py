"""Numpy arrays inside a JSON checkpoint: raw little-endian bytes in base64, no pickle."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["decode_arrays", "encode_arrays"]

# Plain numeric dtypes only: decoding never builds objects.
_KINDS = "biuf"


def encode_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """``{name: {"dtype", "shape", "data"}}``: JSON-safe, 4/3 of the arrays' bytes.

    grain's Orbax handler writes a state as text, so the bytes go as base64
    (one C pass over them, no per-element formatting).
    """
    out: dict[str, Any] = {}
    for name, value in arrays.items():
        a = np.asarray(value)
        if a.dtype.kind not in _KINDS:
            raise TypeError(f"array {name!r} has dtype {a.dtype}; only numbers are encoded")
        a = np.asarray(a, dtype=a.dtype.newbyteorder("<"))
        if not a.flags.c_contiguous:  # (ascontiguousarray would make a 0-d array 1-d)
            a = a.copy()
        out[name] = {
            "dtype": a.dtype.str,
            "shape": list(a.shape),
            "data": base64.b64encode(memoryview(a.reshape(-1).view(np.uint8))).decode("ascii"),
        }
    return out


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
