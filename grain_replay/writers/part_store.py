"""A bounded, many-writer store as one of its writers opens it: the arguments, the store file.

``capacity=``/``writer_id=`` make a directory of segments: :func:`open_store_format`
checks ``segment_rows`` and ``format``, refuses a path that holds another kind of
store, makes the store file of a new store (its segments' format, named by
``format`` or the path's suffix) and returns the format the store file names.
"""

from __future__ import annotations

import os

from grain_replay.errors import InvalidArgumentError, InvalidStoreError
from grain_replay.store import parts as parts_lib
from grain_replay.store.formats import FORMATS, format_from_path
from grain_replay.writers.layouts import choice_fix

__all__ = ["open_store_format"]

# The format each suffix names (as gr.write infers it); ".npz" names none a store has.
_SUFFIX_FORMATS = {".h5": "hdf5", ".hdf5": "hdf5", ".zarr": "zarr", ".npy": "npy", ".npz": None}


def _check_new_store_path(path: str, format: str | None) -> str:
    """The segments' format of a new many-writer store at ``path`` (a directory, which
    keeps the path's name): ``format``, else the one the suffix names. Refuses a suffix
    that names another format than the segments' (``buf.h5`` holding npy segments)."""
    fmt = format or format_from_path(path)
    stem, suffix = os.path.splitext(path.rstrip("/"))
    named = _SUFFIX_FORMATS.get(suffix.lower(), fmt)
    if named != fmt:
        what = f"{named} (as gr.write infers it)" if named else "no format a store has"
        raise InvalidArgumentError(
            f"{path}: a bounded, many-writer store (capacity= or writer_id=) is a directory "
            f"of {fmt} segments named as given, so its suffix {suffix!r} must name {fmt}; it "
            f"names {what}. Fix: gr.ReplayWriter({stem!r}, format={fmt!r}, ...) (a "
            f"directory without a suffix)"
            + (f", or format={named!r} for {named} segments." if named else ".")
        )
    return fmt


def open_store_format(path: str, format: str | None, segment_rows: int | None, where: str) -> str:
    """The segments' format of the many-writer store at ``path``, made if new (``where``:
    the writer, as messages name it).

    Raises:
      InvalidArgumentError: ``segment_rows`` or ``format`` is not one a store takes, or a
        new store's suffix names another format.
      InvalidStoreError: ``path`` holds a single-writer store (or another file), or a
        store of another format than ``format``.
    """
    if segment_rows is not None and (
        isinstance(segment_rows, bool) or not isinstance(segment_rows, int) or segment_rows <= 0
    ):
        raise InvalidArgumentError(
            f"{where}: segment_rows must be a positive int or None, got "
            f"{segment_rows!r}. Fix: leave it None (capacity / 16)."
        )
    if format is not None and format not in FORMATS:
        raise InvalidArgumentError(
            f"format must be one of {FORMATS} or None, got {format!r}. "
            f"{choice_fix('format', format, FORMATS)}"
        )
    if (
        os.path.exists(path)
        and not parts_lib.is_parts_store(path)
        and not parts_lib.being_made(path)
    ):
        raise InvalidStoreError(
            f"{path} is a single-writer store (or another file); capacity= and writer_id= "
            "need a store directory made by them. Fix: pass another path, or drop "
            "capacity/writer_id to append to it."
        )
    if not parts_lib.is_parts_store(path):
        parts_lib.create_store_file(path, _check_new_store_path(path, format))
    on_disk = parts_lib.read_store_file(path)
    if format is not None and format != on_disk:
        raise InvalidStoreError(
            f"{path} is a {on_disk} store but format={format!r} was given. "
            f"Fix: pass format={on_disk!r} or another path."
        )
    return on_disk
