"""HDF5 filter pipelines: name the filter a dataset needs, and load ``hdf5plugin`` for it."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from grain_replay.errors import MissingDependencyError

__all__ = ["filter_name", "load_hdf5plugin", "require_filters"]

# Registered filter ids (The HDF Group's registry) that users meet in practice.
_KNOWN = {
    1: "deflate (gzip)",
    2: "shuffle",
    3: "fletcher32",
    4: "szip",
    5: "nbit",
    6: "scaleoffset",
    307: "bzip2",
    32000: "lzf",
    32001: "blosc",
    32004: "lz4",
    32008: "bitshuffle",
    32013: "zfp",
    32015: "zstd",
    32017: "sz",
    32018: "fcidecomp",
    32024: "sz3",
    32026: "blosc2",
    32028: "sperr",
}


def filter_name(code: int, stored: bytes | str | None = None) -> str:
    """A readable name for filter ``code``: the registry's, else the one the file stores."""
    if code in _KNOWN:
        return _KNOWN[code]
    if isinstance(stored, bytes):
        stored = stored.decode("utf-8", "replace")
    return (stored or "").strip("\x00 ") or "unregistered filter"


@functools.cache
def load_hdf5plugin() -> str | None:
    """Imports ``hdf5plugin`` (which registers its filters with HDF5) if installed.

    Returns its version, or None when it is not installed. Safe to call in every
    process: a spawned loader worker calls it when a store it opens needs a filter.
    """
    try:
        module = importlib.import_module("hdf5plugin")
    except ImportError:
        return None
    return str(getattr(module, "version", "?"))


def _missing(dset: Any) -> list[tuple[int, str]]:
    from h5py import h5z

    plist = dset.id.get_create_plist()
    missing = []
    for i in range(plist.get_nfilters()):
        code, _flags, _values, stored = plist.get_filter(i)
        if not h5z.filter_avail(code):
            missing.append((int(code), filter_name(int(code), stored)))
    return missing


def require_filters(dset: Any, path: str, key: str) -> None:
    """Makes sure this process can decode ``dset``'s filters, loading hdf5plugin if needed.

    Raises:
      MissingDependencyError: a filter is not available in this process and
        ``hdf5plugin`` is not installed or does not provide it. The message names
        the file, the leaf, the filter id and name, and the fix.
    """
    missing = _missing(dset)
    if not missing:
        return
    version = load_hdf5plugin()
    if version is not None:
        missing = _missing(dset)
        if not missing:
            return
    names = ", ".join(f"{code} ({name})" for code, name in missing)
    if version is None:
        fix = (
            "install hdf5plugin (`pip install hdf5plugin`, or `pip install "
            "'grain-replay[hdf5plugin]'`); grain_replay then loads it by itself, in this "
            "process and in every loader worker"
        )
    else:
        fix = (
            f"hdf5plugin {version} is installed but does not provide it: install an HDF5 "
            "plugin for this filter and point HDF5_PLUGIN_PATH at it, or re-write the store "
            "with a filter this machine has (`grain-replay convert PATH OUT.h5 --compression "
            "gzip` on a machine that can read it)"
        )
    raise MissingDependencyError(
        f"{path}: leaf {key!r} is compressed with HDF5 filter {names}, which this process "
        f"cannot decode. Fix: {fix}."
    )
