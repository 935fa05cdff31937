"""Opening any store the CLI reads: grain_replay stores, Minari, LeRobot, D4RL."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["open_store"]


def open_store(path: str, storage_options: dict[str, Any] | None = None) -> Any:
    """Opens any store: Minari datasets and D4RL files as transitions, LeRobot datasets as
    frames (cameras decoded), else gr.open_source; a store at an URL with
    ``storage_options`` (gr.open_source's)."""
    import grain_replay as gr

    if "://" in path:
        return gr.open_source(path, storage_options=storage_options)

    if os.path.isfile(os.path.join(path, "meta", "info.json")):
        return gr.LeRobotDataSource(path)
    if os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, "data", f)) for f in ("main_data.hdf5", "metadata.json")
    ):
        return gr.MinariDataSource(path)
    if path.endswith("main_data.hdf5"):
        return gr.MinariDataSource(path)
    return gr.open_source(path) if _is_plain(path) else gr.D4RLDataSource(path)


def _is_plain(path: str) -> bool:
    """False for a D4RL-layout HDF5 file without grain_replay metadata."""
    from grain_replay.store.formats import STORE_FAULTS, format_from_path, import_h5py
    from grain_replay.store.layout import METADATA_ATTR

    if format_from_path(path) != "hdf5" or not os.path.isfile(path):
        return True
    h5py = import_h5py()
    try:
        with h5py.File(path, "r", locking=False) as f:
            d4rl = {"observations", "actions", "rewards", "terminals"} <= set(f.keys())
            return METADATA_ATTR in f.attrs or not d4rl
    except STORE_FAULTS:  # damaged: gr.open_source names the file and the fix
        return True
