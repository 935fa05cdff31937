"""The RLDS step index's cache: a shard's index arrays kept in an ``.npz`` file, signed.

Beside the dataset in ``.grain_replay_rlds/`` when the folder is writable, else in
``$XDG_CACHE_HOME/grain_replay/rlds/<hash>/`` (default ``~/.cache``). A file whose signature
(the shard's size and mtime, the features indexed, this layout's version) differs is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from grain_replay.datasets.rlds.features import Feature
from grain_replay.store.filesync import atomic_replace

__all__ = ["CACHE_FOLDER", "cache_dirs", "load_cached", "save_cached", "shard_signature"]

logger = logging.getLogger(__name__)

_VERSION = 1
CACHE_FOLDER = ".grain_replay_rlds"


def cache_dirs(root: str) -> list[str]:
    """Where the index of the dataset at ``root`` is cached, first choice first."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha1(os.path.abspath(root).encode()).hexdigest()[:16]
    return [os.path.join(root, CACHE_FOLDER), os.path.join(base, "grain_replay", "rlds", digest)]


def shard_signature(path: str, features: Sequence[Feature]) -> str:
    """What a cached index of the shard ``path`` must have been built from."""
    st = os.stat(path)
    feats = [[f.key, f.name, f.level, f.kind, f.dtype.str, list(f.shape)] for f in features]
    return json.dumps(
        {"v": _VERSION, "size": st.st_size, "mtime": st.st_mtime_ns, "features": feats}
    )


def _load(file: str, signature: str) -> dict[str, np.ndarray] | None:
    try:
        with np.load(file, allow_pickle=False) as z:
            if str(z["__signature__"]) != signature:
                return None
            return {k: z[k] for k in z.files if k != "__signature__"}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        logger.info("%s: unreadable RLDS index cache (%s); rebuilding it", file, e)
        return None


def load_cached(dirs: Sequence[str], name: str, signature: str) -> dict[str, np.ndarray] | None:
    """The index arrays of shard ``name`` cached with ``signature`` in the first of ``dirs``
    that has them, or None."""
    for d in dirs:
        got = _load(os.path.join(d, name + ".npz"), signature)
        if got is not None:
            return got
    return None


def save_cached(
    dirs: Sequence[str], name: str, arrays: dict[str, np.ndarray], signature: str
) -> None:
    """Keeps shard ``name``'s index arrays in the first of ``dirs`` writable (else nowhere)."""
    for d in dirs:
        file = os.path.join(d, name + ".npz")
        try:
            os.makedirs(d, exist_ok=True)
            # A cache: not fsync'ed, a crash at worst loses it (it is rebuilt).
            with atomic_replace(file, durable=False) as f:
                saved: dict[str, Any] = {"__signature__": np.str_(signature), **arrays}
                np.savez(f, **saved)
            return
        except OSError as e:
            logger.info("%s: cannot write the RLDS index cache here (%s)", d, e)
