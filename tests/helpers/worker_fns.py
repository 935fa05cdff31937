"""Functions run inside spawned worker processes by the tests (importable by name)."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np


def read_in_worker(src: Any, indices: list[int]) -> dict[str, Any]:
    """Reads through a source in a fresh process and reports what happened there."""
    batch = src.read_batch(indices)
    records = [src[i] for i in indices]
    again = src.read_batch(indices[::-1])
    jax_backends = 0
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        jax_backends = len(xla_bridge._backends)
    return {
        "pid": os.getpid(),
        "opens": src._opens,
        "batch": batch,
        "records": records,
        "again": again,
        "jax_backends": jax_backends,
    }


def leaf_sum(batch: Any) -> float:
    return float(sum(np.asarray(v, dtype=np.float64).sum() for v in _leaves(batch)))


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [tree]
