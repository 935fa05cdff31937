"""A local Zarr array's chunk files and codecs, read from its own metadata file (the Zarr spec).

zarr-python parses the same files into classes of ``zarr.core``, which are not
public and change between releases (3.1 to 3.4 renamed the chunk grid and the
codecs' synchronous decoders). The Zarr room needs only what the format
specifies: where each chunk's file is and which codecs encoded it. So it reads
``zarr.json`` (v3) or ``.zarray`` (v2) itself.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ArrayFiles", "read_array_files"]


@dataclass(frozen=True)
class ArrayFiles:
    """Where a local array's chunk files are, and how they were encoded.

    Attributes:
      folder: the array's folder.
      zarr_format: 2 or 3.
      shape: the array's shape.
      grid: the shape of one cell of the regular chunk grid (for a sharded
        array: one shard, the stored object), or None for another grid.
      prefix: ``"c"`` for the v3 default chunk key encoding, ``""`` for v2 keys.
      separator: between the coordinates of a chunk key.
      codecs: the v3 codec list, each ``{"name": ..., "configuration": {...}}``
        (empty for v2).
      plain: no storage transformers (v3) and no v2 filters: the codecs say it all.
    """

    folder: str
    zarr_format: int
    shape: tuple[int, ...]
    grid: tuple[int, ...] | None
    prefix: str
    separator: str
    codecs: tuple[dict[str, Any], ...]
    plain: bool

    def key(self, coords: Sequence[int]) -> str:
        """The store key of chunk ``coords``, relative to the array's folder."""
        parts = [str(int(c)) for c in coords]
        if self.prefix:
            return self.separator.join([self.prefix, *parts])
        return self.separator.join(parts) if parts else "0"

    def path(self, coords: Sequence[int]) -> str:
        return os.path.join(self.folder, *self.key(coords).split("/"))

    def paths_of_rows(self, start: int, stop: int) -> Iterator[str]:
        """The chunk files that hold rows ``[start, stop)`` (every column), in key order.

        Only for a regular grid (``grid`` is not None) and ``stop > start``.
        """
        assert self.grid is not None
        first, last = start // self.grid[0], (stop - 1) // self.grid[0]
        rest = [range(math.ceil(s / c)) for s, c in zip(self.shape[1:], self.grid[1:])]
        for coords in itertools.product(range(first, last + 1), *rest):
            yield self.path(coords)


def _named(codec: Any) -> dict[str, Any] | None:
    if isinstance(codec, str):  # the spec allows a bare name for a codec without configuration
        return {"name": codec, "configuration": {}}
    if isinstance(codec, dict) and isinstance(codec.get("name"), str):
        config = codec.get("configuration", {})
        return {"name": codec["name"], "configuration": config if isinstance(config, dict) else {}}
    return None


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    return None


def _v3(folder: str, meta: dict[str, Any]) -> ArrayFiles | None:
    shape = _ints(meta.get("shape"))
    grid_meta = _named(meta.get("chunk_grid"))
    encoding = _named(meta.get("chunk_key_encoding"))
    codecs = [_named(c) for c in meta.get("codecs", [])]
    if shape is None or grid_meta is None or encoding is None or None in codecs:
        return None
    grid = None
    if grid_meta["name"] == "regular":
        grid = _ints(grid_meta["configuration"].get("chunk_shape"))
        if grid is None or len(grid) != len(shape) or 0 in grid:
            grid = None
    if encoding["name"] == "default":
        prefix, separator = "c", encoding["configuration"].get("separator", "/")
    elif encoding["name"] == "v2":
        prefix, separator = "", encoding["configuration"].get("separator", ".")
    else:
        return None
    if separator not in ("/", "."):
        return None
    return ArrayFiles(
        folder,
        3,
        shape,
        grid,
        prefix,
        separator,
        tuple(c for c in codecs if c is not None),
        not meta.get("storage_transformers"),
    )


def _v2(folder: str, meta: dict[str, Any]) -> ArrayFiles | None:
    shape = _ints(meta.get("shape"))
    grid = _ints(meta.get("chunks"))
    separator = meta.get("dimension_separator", ".")
    if shape is None or separator not in ("/", "."):
        return None
    if grid is not None and (len(grid) != len(shape) or 0 in grid):
        grid = None
    return ArrayFiles(folder, 2, shape, grid, "", separator, (), not meta.get("filters"))


def read_array_files(folder: str) -> ArrayFiles | None:
    """The chunk layout of the array in ``folder``, or None where its metadata says otherwise.

    None for a folder without array metadata, metadata that does not parse, or
    a chunk key encoding other than the two the spec defines; zarr then reads
    (or refuses) the array itself. The metadata files were checked (regular,
    inside the store) before zarr opened them.
    """
    for name, parse in (("zarr.json", _v3), (".zarray", _v2)):
        try:
            with open(os.path.join(folder, name), "rb") as f:
                meta = json.loads(f.read())
        except FileNotFoundError:
            continue
        except (OSError, ValueError, RecursionError):
            return None
        if not isinstance(meta, dict):
            return None
        if name == "zarr.json" and meta.get("node_type") != "array":
            return None
        return parse(folder, meta)
    return None
