"""A host batch laid out as one lane-aligned buffer: the packed transfer's layout, in numpy.

``sharded_device_put``'s packed transfers (``device/packed.py``) move a batch as
``uint32[rows, 128]`` rows (512 bytes each) and lay its leaves out on the device. For a
batch on one device that buffer is every leaf in turn, each starting on a row; a leaf whose
element (one batch row) is :data:`ELEMENT_ROWS_BYTES` or more gives every element whole
rows of its own (the chip then splits a row axis, not a flat one), smaller elements are
packed densely. A loader asked for it (``lay_out_lanes()``: the workers' shared-memory
slots, or the in-process reads) hands out batches whose leaves are views of such a buffer;
the device side then puts that buffer as it is, with no copy in the consuming process.

The rule lives here, below ``device/``, so that loader workers (which never import jax)
apply it too; ``device/packed.py`` plans its transfers with the same function.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ELEMENT_ROWS_BYTES",
    "ROW_BYTES",
    "LaneBuffer",
    "LaneField",
    "lane_bytes",
    "lane_fields",
    "lane_view",
    "lane_views",
    "leaf_rows",
    "owner_of",
    "padded",
    "record",
]

ROW_BYTES = 512  # one row of 128 32-bit lanes
ELEMENT_ROWS_BYTES = 4096  # elements this large get rows of their own


class LaneField(NamedTuple):
    """Where one leaf lies in the buffer: from ``row``, over ``rows`` rows, ``per_element``
    rows for each element (0: the leaf's bytes packed densely from ``row``). A tuple:
    hashed in C, as a transfer's layout key is per batch."""

    row: int
    rows: int
    per_element: int

    @property
    def offset(self) -> int:
        return self.row * ROW_BYTES


class LaneBuffer(np.ndarray):
    """A buffer a loader laid a batch out in: ``lane_rows`` rows, and the field of each
    leaf it handed out, by the leaf's ``id`` (``lane_fields``).

    The handed-out leaves are plain arrays viewing it; it records them by ``id`` (not by
    reference: the buffer lives exactly as long as its views do). The device side finds
    it as the nearest base of a leaf and puts its first ``lane_rows`` rows as they lie
    once every leaf of the batch is one it records.
    """

    lane_rows: int = 0
    lane_fields: dict[int, LaneField] | None = None


def owner_of(leaf: np.ndarray) -> LaneBuffer | None:
    """The :class:`LaneBuffer` ``leaf`` was handed out over, or None."""
    base = leaf.base
    for _ in range(2):  # the view numpy made last, then the buffer its views collapse to
        if isinstance(base, LaneBuffer) and base.lane_fields is not None:
            return base
        base = getattr(base, "base", None)
    return None


def leaf_rows(n: int, element: int) -> tuple[int, int]:
    """(rows, rows per element or 0) of ``n`` elements of ``element`` bytes."""
    if element >= ELEMENT_ROWS_BYTES and n:
        per_element = -(-element // ROW_BYTES)
        return n * per_element, per_element
    return -(-(n * element) // ROW_BYTES), 0


def lane_fields(leaves: Sequence[tuple[Any, tuple[int, ...]]]) -> tuple[list[LaneField], int]:
    """The fields of leaves given as ``(dtype, shape)`` (axis 0: the batch rows), in order,
    and the buffer's rows (at least 1)."""
    fields, row = [], 0
    for dtype, shape in leaves:
        element = np.dtype(dtype).itemsize * math.prod(shape[1:])
        rows, per_element = leaf_rows(shape[0], element)
        fields.append(LaneField(row, rows, per_element))
        row += rows
    return fields, max(row, 1)


def lane_view(buf: np.ndarray, field: LaneField, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The leaf of ``field`` over ``buf`` (flat ``uint8``, from the buffer's first row): a
    C-contiguous view, or for an element with rows of its own a view whose axis 0 steps
    over them."""
    dtype = np.dtype(dtype)
    n = shape[0]
    element = dtype.itemsize * math.prod(shape[1:])
    start = field.offset
    if field.per_element and element % ROW_BYTES:
        stride = field.per_element * ROW_BYTES
        rows = buf[start : start + n * stride].reshape(n, stride)[:, :element]
        return rows.view(dtype).reshape(shape)
    return buf[start : start + n * element].view(dtype).reshape(shape)


def lane_views(
    buf: np.ndarray,
    leaves: Mapping[str, tuple[Any, tuple[int, ...]]],
    laid: tuple[list[LaneField], int] | None = None,
) -> dict[str, np.ndarray]:
    """Every leaf (key -> ``(dtype, shape)``) as a plain array viewing ``buf`` (flat
    ``uint8``) in the lane layout; a :class:`LaneBuffer` records them. ``laid``: the
    leaves' :func:`lane_fields`, when the caller kept them."""
    fields, rows = laid if laid is not None else lane_fields(list(leaves.values()))
    out = {
        key: lane_view(buf, field, dtype, shape).view(np.ndarray)
        for (key, (dtype, shape)), field in zip(leaves.items(), fields, strict=True)
    }
    if isinstance(buf, LaneBuffer):
        record(buf, rows, zip(out.values(), fields, strict=True))
    return out


def record(buf: LaneBuffer, rows: int, leaves: Any) -> None:
    """Records the ``(leaf, field)`` pairs handed out over ``buf`` (see :class:`LaneBuffer`)."""
    buf.lane_rows = rows
    buf.lane_fields = {id(leaf): field for leaf, field in leaves}


def lane_bytes(leaves: Sequence[tuple[Any, tuple[int, ...]]]) -> int:
    """The buffer's bytes for these leaves."""
    return lane_fields(leaves)[1] * ROW_BYTES


def padded(leaves: Sequence[tuple[Any, tuple[int, ...]]]) -> bool:
    """Whether some leaf's elements are padded to whole rows (its view is not contiguous)."""
    fields, _ = lane_fields(leaves)
    for (dtype, shape), field in zip(leaves, fields, strict=True):
        element = np.dtype(dtype).itemsize * math.prod(shape[1:])
        if field.per_element and element % ROW_BYTES:
            return True
    return False
