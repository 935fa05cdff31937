"""Optional libraries imported when first needed, or a MissingDependencyError with the fix."""

from __future__ import annotations

import importlib
from typing import Any

from grain_replay.errors import MissingDependencyError

__all__ = ["import_fsspec", "import_h5py", "import_optional", "import_tensorstore", "import_zarr"]


def import_optional(module: str, hint: str) -> Any:
    """``module`` imported, or a MissingDependencyError with ``hint`` (what needs it, the fix).

    Each parent package is imported first, as ``import a.b`` does, so that a package
    blocked or missing (``sys.modules["a"] = None``) is noticed even when ``a.b`` was
    imported before.
    """
    parts = module.split(".")
    try:
        for i in range(1, len(parts) + 1):
            got = importlib.import_module(".".join(parts[:i]))
    except ImportError as e:
        raise MissingDependencyError(hint) from e
    return got


def import_h5py() -> Any:
    """``h5py``, or a MissingDependencyError saying how to install it."""
    try:
        import h5py
    except ImportError as e:
        raise MissingDependencyError(
            f"HDF5 stores need the h5py package ({e}). Fix: pip install 'h5py>=3.10' (a "
            "dependency of grain-replay: reinstall it with pip install grain-replay)."
        ) from e
    return h5py


def import_zarr() -> Any:
    """``zarr`` (v3), or a MissingDependencyError saying how to install it."""
    try:
        import zarr
    except ImportError as e:
        raise MissingDependencyError(
            f"Zarr stores need the zarr package, version 3 ({e}). Fix: pip install "
            "'zarr>=3.1' (a dependency of grain-replay: reinstall it with pip install "
            "grain-replay)."
        ) from e
    return zarr


def import_fsspec() -> Any:
    """``fsspec``, or a MissingDependencyError naming the ``s3`` extra."""
    try:
        import fsspec
    except ImportError as e:
        raise MissingDependencyError(
            f"Stores at URLs need fsspec ({e}). Fix: pip install 'grain-replay[s3]' (fsspec "
            "and s3fs; for other protocols add their fsspec backend, e.g. gcsfs)."
        ) from e
    return fsspec


def import_tensorstore() -> Any:
    """``tensorstore``, or a MissingDependencyError naming the ``vault`` extra."""
    try:
        import tensorstore
    except ImportError as e:
        raise MissingDependencyError(
            f"flashbax Vaults are read through tensorstore ({e}). Fix: pip install "
            "'grain-replay[vault]' (or pip install tensorstore)."
        ) from e
    return tensorstore
