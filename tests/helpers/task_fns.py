"""Picklable read functions for the per-task worker tests (imported by spawned workers)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


class EchoTask:
    """Reads a task ``(j, rows)`` into a batch that says which task and which process."""

    def __call__(self, task: Any) -> dict[str, np.ndarray]:
        j, rows = task
        return {"j": np.array([j]), "rows": np.asarray(rows), "pid": np.array([os.getpid()])}
