"""Format knowledge below readers and writers: signatures, detection, headers, metadata."""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
import zlib
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from grain_replay.errors import InvalidStoreError, StoreNotFoundError, UnfinishedWriteError
from grain_replay.store import layout as layout_lib
from grain_replay.store.filesync import pid_alive, temp_siblings

# Where they were first: importable from here too (stores, sources and datasets use them).
from grain_replay.store.optional import (
    import_fsspec,
    import_h5py,
    import_optional,
    import_tensorstore,
    import_zarr,
)

__all__ = [
    "FORMATS",
    "HDF5_SIGNATURE",
    "NPY_MAGIC",
    "PAGE",
    "RLDS_MARKERS",
    "ZIP_SIGNATURES",
    "ZARR_MARKERS",
    "STORE_FAULTS",
    "damaged_store",
    "detect_format",
    "format_from_path",
    "import_fsspec",
    "import_h5py",
    "import_optional",
    "import_tensorstore",
    "import_zarr",
    "is_url",
    "is_vault",
    "metadata_from_attrs",
    "read_npy_header",
    "read_npy_metadata",
    "require_regular_file",
    "shown_path",
    "store_not_found",
]

FORMATS = ("hdf5", "npy", "zarr")
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
NPY_MAGIC = b"\x93NUMPY"
# A zip archive (.npz) starts with a local file header, or is empty (end record only).
ZIP_SIGNATURES = (b"PK\x03\x04", b"PK\x05\x06")
# Files whose presence makes a directory a Zarr store.
ZARR_MARKERS = ("zarr.json", ".zgroup", ".zarray", ".zmetadata", ".zattrs")
# Files whose presence together makes a directory a TFDS-built (RLDS) dataset.
RLDS_MARKERS = ("dataset_info.json", "features.json")
# The OCDBT database file at the root of a flashbax Vault.
VAULT_MANIFEST = "manifest.ocdbt"
# Chunks and HDF5 data offsets that are whole pages can be memory-mapped back to back.
PAGE = mmap.PAGESIZE
# The .npy header of a store a ReplayWriter grows: fixed, so the shape can be
# rewritten in place as N grows (a file with another header is replaced, not grown).
GROWING_NPY_HEADER = 256
# The .npy header of a many-writer store's segment: its rows start at a page boundary, so a
# reader maps the segments of a writer back to back into one array per leaf.
SEGMENT_NPY_HEADER = max(PAGE, GROWING_NPY_HEADER)


# -- paths and detection --------------------------------------------------------------


def is_url(path: str) -> bool:
    """True for fsspec URLs such as ``s3://bucket/x.zarr`` (``file://`` included)."""
    return "://" in path


def shown_path(path: str | os.PathLike[str]) -> str:
    """A local path for an error message: absolute, after the path as typed where that
    was relative (``'buf' (/work/buf)``); a URL as it is."""
    text = os.fspath(path)
    if is_url(text):
        return text
    where = os.path.abspath(text)
    return where if where == text else f"{text!r} ({where})"


def require_regular_file(path: str, key: str = "") -> None:
    """Refuses FIFOs, devices and sockets, which would block or never end when read."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        leaf = f" (leaf {key!r})" if key else ""
        raise InvalidStoreError(
            f"{path}{leaf} is not a regular file (a FIFO, device or socket). Fix: point the "
            "store at regular files."
        )


def format_from_path(path: str | os.PathLike[str]) -> str:
    """The format a path's suffix names: ``.h5``/``.hdf5`` hdf5, ``.zarr`` zarr, else npy."""
    p = os.fspath(path).rstrip("/").lower()
    if p.endswith((".h5", ".hdf5")):
        return "hdf5"
    if p.endswith(".zarr"):
        return "zarr"
    return "npy"


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format at ``path``: ``"hdf5"``, ``"npy"``, ``"npz"``, ``"zarr"``, ``"rlds"``, ....

    ``"rlds"``: a TFDS dataset folder (``dataset_info.json`` and ``features.json``).
    For URLs the suffix decides.

    Raises:
      StoreNotFoundError: nothing is at ``path``.
      UnfinishedWriteError: nothing is at ``path`` but the ``.partial`` of a write
        of it that never finished.
      InvalidStoreError: the contents (or an URL's suffix) name no format.
    """
    path = os.fspath(path)
    if is_url(path):
        fmt = format_from_path(path)
        if fmt == "npy":
            raise InvalidStoreError(
                f"Cannot tell the format of {path} from its suffix. Fix: use "
                "gr.ZarrDataSource or gr.HDF5DataSource directly."
            )
        return fmt
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(8)
        if magic == HDF5_SIGNATURE:
            return "hdf5"
        if magic.startswith(NPY_MAGIC):
            return "npy"
        if magic.startswith(ZIP_SIGNATURES):
            return "npz"
        raise InvalidStoreError(
            f"{path} is neither an HDF5, a .npy nor an .npz file (magic bytes {magic!r}). Fix: "
            "pass an HDF5 file, a .npy or .npz file, a directory of .npy files or a Zarr group."
        )
    if os.path.isdir(path):
        # Zarr v3 (group or array: zarr.json), v2 group (.zgroup), v2 array (.zarray),
        # and a v2 store with only consolidated metadata or attributes.
        if any(os.path.exists(os.path.join(path, name)) for name in ZARR_MARKERS):
            return "zarr"
        if all(os.path.isfile(os.path.join(path, name)) for name in RLDS_MARKERS):
            return "rlds"
        if any(
            os.path.isfile(os.path.join(path, *parts, name))
            for parts in ((), ("storage",))
            for name in ("storage_metadata.json", "checkpoint.h5")
        ):
            return "torchrl"  # ReplayBuffer.dumps(path), or its storage/ directory
        if is_vault(path):
            return "vault"
        return "npy"
    if os.path.exists(path):
        require_regular_file(path)  # a FIFO, device or socket
    raise store_not_found(path, f"No replay store at {shown_path(path)}. Fix: check the path.")


def store_not_found(path: str, message: str) -> StoreNotFoundError | UnfinishedWriteError:
    """The error for a local ``path`` with nothing there: :class:`UnfinishedWriteError`
    if a write of it left its ``.partial`` beside it, else ``StoreNotFoundError(message)``.

    ``gr.write`` and the writers make a store under a temp name (``filesync.temp_path``)
    and rename it into place once complete, metadata included: a ``.partial`` without
    the store is a write that crashed, or one still running.
    """
    partials = [] if os.path.lexists(path) else temp_siblings(path)
    if not partials:
        return StoreNotFoundError(message)
    where = os.path.abspath(path)
    partial = partials[-1]
    parts = os.path.basename(partial)[len(os.path.basename(where)) + 1 :].split(".")
    pid = int(parts[0]) if len(parts) >= 3 and parts[0].isdigit() else None
    if pid is not None and pid_alive(pid):
        who = f"process {pid}, which is running on this host: it may still be writing it"
    elif pid is not None:
        who = f"process {pid}, which is not running on this host: the write was interrupted"
    else:
        who = "a write that was interrupted"
    return UnfinishedWriteError(
        f"{where} is an unfinished write: its metadata was never committed (the store is "
        f"renamed into place only once complete), and what was written lies in {partial}, "
        f"left by {who}. Fix: wait for a running write to finish; else re-run the write "
        f"(e.g. gr.write({path!r}, tree)), or delete {partial}."
    )


# What h5py / zarr / numcodecs / numpy / zlib / mmap raise on damaged bytes (h5py's
# RuntimeError and KeyError included: "bad symbol table node signature", "unable to
# determine object type"). A source turns each into a named error: damaged_store.
STORE_FAULTS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    RuntimeError,
    KeyError,
    IndexError,
    TypeError,
    EOFError,
    OverflowError,
    struct.error,
    zlib.error,
)

DAMAGED_FIX = "restore it from a copy or re-write it"


def damaged_store(
    path: str, error: BaseException, *, leaf: str | None = None, doing: str = "opening"
) -> InvalidStoreError:
    """The named error for a format library's failure on a store's bytes (raise it ``from``
    the failure): the file, the leaf when known, what failed, and the fix."""
    where = path if is_url(path) else os.path.abspath(path)
    at = f" leaf {leaf!r}:" if leaf is not None else ""
    return InvalidStoreError(
        f"{where}:{at} {doing} failed ({type(error).__name__}: {error}). The file is damaged "
        f"(or was changed while open). Fix: {DAMAGED_FIX}; `grain-replay verify {where}` "
        "checks a store."
    )


def is_vault(path: str) -> bool:
    """A flashbax Vault: ``metadata.json`` beside an OCDBT ``manifest.ocdbt`` (or one such
    directory inside ``path``, as ``Vault(vault_name=...)`` nests it under its uid)."""

    def one(d: str) -> bool:
        return os.path.isfile(os.path.join(d, VAULT_MANIFEST)) and os.path.isfile(
            os.path.join(d, "metadata.json")
        )

    if one(path):
        return True
    try:
        subdirs = [e.path for e in os.scandir(path) if e.is_dir()]
    except OSError:
        return False
    return any(one(d) for d in subdirs)


# -- .npy headers -----------------------------------------------------------------------


# CPython 3.11.0-3.11.7 (gh-106905): ast.literal_eval, which numpy's header parser
# uses, can raise a spurious SystemError ("AST constructor recursion depth mismatch")
# when threads parse at once. The header is read again from its start.
_HEADER_TRIES = 4


def parse_npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` header ``f`` is positioned at.

    Leaves ``f`` just past the header. Retries the interpreter's spurious
    ``SystemError`` of gh-106905; a header that is really bad raises what numpy
    raises (``ValueError`` and others), for the caller to word.
    """
    start = f.tell()
    for attempt in range(_HEADER_TRIES):
        f.seek(start)
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                return np.lib.format.read_array_header_1_0(f)
            if version in ((2, 0), (3, 0)):  # 3.0 differs only in utf-8 field names
                return np.lib.format.read_array_header_2_0(f)
            raise ValueError(f"unsupported .npy format version {version}")
        except SystemError:
            if attempt == _HEADER_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def read_npy_header(
    path: str, key: str, *, rows: int | None = None, check_size: bool = True
) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """``(shape, dtype, fortran_order, data_offset)`` of a ``.npy`` file.

    Reads only the header: no data, never unpickles. With ``check_size`` the
    file must hold the data the header declares, or only its first ``rows``
    rows when given (a growing store's header may run ahead of its data).

    Raises:
      StoreNotFoundError: the file is missing.
      InvalidStoreError: not a valid ``.npy`` file, naming it and the leaf.
    """
    try:
        require_regular_file(path, key)
        with open(path, "rb") as f:
            shape, fortran, dtype = parse_npy_header(f)
            offset = f.tell()
            size = os.fstat(f.fileno()).st_size
        if any(not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"the header declares a negative dimension {shape}")
        counted = shape if rows is None or not shape else (min(rows, shape[0]), *shape[1:])
        needed = offset + math.prod(counted) * dtype.itemsize
        if check_size and size < needed:
            raise ValueError(
                f"the header declares {dtype}{list(shape)} ({needed:,} bytes with the header) "
                f"but the file holds {size:,} bytes: it is truncated or lies about its shape"
            )
    except InvalidStoreError:
        raise
    except FileNotFoundError as e:
        raise StoreNotFoundError(f"{shown_path(path)}: leaf {key!r} file is missing.") from e
    except Exception as e:  # numpy's header parser raises anything: TokenError, IndexError, ...
        raise InvalidStoreError(
            f"{path}: leaf {key or '<root>'!r} is not a valid .npy file ({e}). Fix: re-create it "
            "with np.save or gr.write_npy."
        ) from e
    layout_lib.check_dtype(dtype, key or "<root>", path)
    return tuple(shape), dtype, bool(fortran), offset


# -- grain_replay metadata ----------------------------------------------------------------


def metadata_from_attrs(attrs: Mapping[str, Any], where: str) -> layout_lib.StoreMetadata | None:
    """The metadata in an HDF5 file's or a Zarr group's attributes, None for a foreign store.

    HDF5 keeps it under a second name while a commit grows it (see the writers);
    that copy wins. Zarr may hand the JSON back parsed.

    Raises:
      InvalidStoreError: the metadata is malformed, naming ``where``.
    """
    raw = attrs.get(layout_lib.METADATA_ATTR_NEXT)
    if raw is None:
        raw = attrs.get(layout_lib.METADATA_ATTR)
    if raw is None:
        return None
    # Zarr hands back parsed JSON; anything else goes to the parser, which names the fault.
    text = json.dumps(raw) if isinstance(raw, (dict, list)) else raw
    return layout_lib.StoreMetadata.from_json(text, where=where)


def read_npy_metadata(path: str) -> layout_lib.StoreMetadata | None:
    """The metadata file of a ``.npy`` directory store, None if it has none (foreign).

    Raises:
      InvalidStoreError: the metadata is malformed, naming the file.
    """
    file = os.path.join(path, layout_lib.METADATA_FILE)
    if not os.path.exists(file):
        return None
    with open(file, "rb") as f:
        return layout_lib.StoreMetadata.from_json(f.read(), where=file)
