"""``open_source``: the source class a store's contents call for, and its table."""

from __future__ import annotations

import importlib
import math
import numbers
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from grain_replay.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidStoreError,
    StoreNotFoundError,
    UnfinishedWriteError,
)
from grain_replay.remote.options import redact_url
from grain_replay.sources.base import ReplaySource
from grain_replay.store.formats import detect_format, is_url, shown_path
from grain_replay.store.objects import what_is_at
from grain_replay.store.parts import being_made, is_parts_store

__all__ = ["SOURCE_CLASSES", "open_source", "source_class"]

# Class name -> (module, the detect_format name it opens). A new format or dataset
# reader adds its row here (and its signature to store/formats.py's detect_format).
SOURCE_CLASSES = {
    "HDF5DataSource": ("grain_replay.sources.hdf5", "hdf5"),
    "NpyDataSource": ("grain_replay.sources.npy", "npy"),
    "NpzDataSource": ("grain_replay.sources.npz", "npz"),
    "PartsDataSource": ("grain_replay.sources.parts", None),
    "ObjectPartsDataSource": ("grain_replay.sources.parts", None),
    "RLDSDataSource": ("grain_replay.datasets.rlds", "rlds"),
    "TorchRLDataSource": ("grain_replay.datasets.torchrl", "torchrl"),
    "VaultDataSource": ("grain_replay.datasets.vault", "vault"),
    "ZarrDataSource": ("grain_replay.sources.zarr", "zarr"),
}


def source_class(name: str) -> type[ReplaySource]:
    """The class named ``name`` in :data:`SOURCE_CLASSES`, its module imported on first use."""
    return getattr(importlib.import_module(SOURCE_CLASSES[name][0]), name)


def open_source(
    path: str | os.PathLike[str],
    keys: Sequence[str] | None = None,
    *,
    wait: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> ReplaySource:
    """Opens ``path`` with the source class its contents call for.

    Args:
      path: an HDF5 file, a ``.npy`` file or directory, a Zarr group, a TFDS-built
        RLDS dataset folder, an ``.npz`` archive, a torchrl buffer dump, a flashbax
        Vault, or an URL ending in ``.zarr`` / ``.h5``.
      keys: leaves (or groups) to read; default all.
      wait: seconds to wait for a store no writer has made yet, so that a learner may
        start before its actors: polled (every 10 ms, growing to 0.5 s) until the store
        is there with a committed row (a many-writer store: until a writer has
        committed one), then opened. A store a writer is still creating (its
        ``.partial``, a many-writer store's first files) is waited for too. None or 0:
        open now; ``math.inf``: wait without end.
      storage_options: fsspec options for URLs.
      **kwargs: passed to the source class (e.g. ``cache_bytes``).

    A bounded, many-writer store (``ReplayWriter(path, capacity=..., writer_id=...)``)
    opens as a :class:`PartsDataSource`: the union of every writer's live rows.

    Raises:
      StoreNotFoundError: nothing is at ``path`` (with ``wait``: no store with a committed
        row came in that time; the message names the absolute path and the wait).
      InvalidArgumentError, ArgumentTypeError: ``wait`` is negative, NaN or not a number.
      UnfinishedWriteError: nothing is at ``path`` but the ``.partial`` of a write
        of it that never finished.
      InvalidStoreError: the format cannot be recognized.
    """
    seconds = _check_wait(wait)
    if storage_options is not None:
        kwargs["storage_options"] = storage_options
    if not seconds:
        return _open(path, keys, kwargs)
    return _open_waiting(path, keys, kwargs, seconds)


def _open(path: str | os.PathLike[str], keys: Any, kwargs: dict[str, Any]) -> ReplaySource:
    if is_parts_store(os.fspath(path)):
        kwargs = {k: v for k, v in kwargs.items() if k != "storage_options"}
        return source_class("PartsDataSource")(path, keys, **kwargs)
    text = os.fspath(path)
    try:
        fmt = detect_format(path)
    except InvalidStoreError:
        if not is_url(text):
            raise
        found = what_is_at(text, kwargs.get("storage_options"))
        if found == "store":  # a many-writer store on object storage
            return source_class("ObjectPartsDataSource")(text, keys, **kwargs)
        if found == "nothing":
            raise StoreNotFoundError(
                f"Nothing at {redact_url(text)}: no object under it (a many-writer store "
                "there has a replay_store.json once its first writer opened it). Fix: "
                "check the URL and storage_options, start a writer of it "
                "(gr.ReplayWriter(url, writer_id=..., storage_options=...)), or wait for "
                "one: open_source(url, wait=60.0, storage_options=...)."
            ) from None
        raise
    cls: type[ReplaySource] = next(
        source_class(name) for name, (_, opens) in SOURCE_CLASSES.items() if opens == fmt
    )
    return cls(path, keys, **kwargs)


# The waiting open polls every _FIRST_POLL seconds at first, the pause doubling to _LAST_POLL.
_FIRST_POLL, _LAST_POLL = 0.01, 0.5


def _check_wait(wait: Any) -> float:
    """``wait`` in seconds (0: do not wait), or the error naming the fix."""
    if wait is None:
        return 0.0
    if isinstance(wait, (bool, np.bool_)) or not isinstance(wait, numbers.Real):
        raise ArgumentTypeError(
            f"wait must be a number of seconds (or None), got {type(wait).__name__} "
            f"{wait!r}. Fix: pass e.g. wait=60.0 to wait a minute for the first writer."
        )
    seconds = float(wait)
    if math.isnan(seconds) or seconds < 0:
        raise InvalidArgumentError(
            f"wait must be >= 0 seconds (or None), got {wait!r}. Fix: pass e.g. wait=60.0, "
            "math.inf to wait without end, or None to open at once."
        )
    return seconds


def _open_waiting(
    path: str | os.PathLike[str], keys: Any, kwargs: dict[str, Any], seconds: float
) -> ReplaySource:
    """:func:`_open` once the store is there with a committed row, polled for ``seconds``."""
    start = time.monotonic()
    pause, polls = _FIRST_POLL, 0
    while True:
        polls += 1
        last = time.monotonic() - start >= seconds
        why = _not_yet(path)
        if why is None:
            try:
                source = _open(path, keys, kwargs)
            except (StoreNotFoundError, UnfinishedWriteError) as e:
                why = str(e)
            except InvalidStoreError:
                # made between the look and the open (a many-writer store's folders before
                # its replay_store.json, opened as a plain one): waited for, as seen now
                why = _not_yet(path)
                if why is None and not is_parts_store(os.fspath(path)):
                    raise
                why = why or "a writer was creating it"
            else:
                if len(source):
                    return source
                source.close()
                why = "it is there, but no writer has committed a row to it yet"
        if last:
            break
        left = seconds - (time.monotonic() - start)
        time.sleep(max(0.0, min(pause, left)))
        pause = min(2 * pause, _LAST_POLL)
    text = os.fspath(path)
    raise StoreNotFoundError(
        f"No replay store with a committed row at {shown_path(text)} after waiting "
        f"{time.monotonic() - start:.1f} s (open_source(wait={seconds:g}), {polls} looks): "
        f"{why}. Fix: start a writer of it (gr.ReplayWriter({text!r}, ...) appending and "
        "flushing, or gr.write), check the path (relative paths are from the working "
        f"directory {os.getcwd()}), or wait longer."
    )


def _not_yet(path: str | os.PathLike[str]) -> str | None:
    """Why a local store at ``path`` cannot be opened yet (None: try to open it)."""
    text = os.fspath(path)
    if is_url(text) or is_parts_store(text):
        return None
    if being_made(text):  # a many-writer store before its replay_store.json
        return (
            "it is a many-writer store a writer is creating (no replay_store.json yet), "
            "or an empty folder"
        )
    return None
