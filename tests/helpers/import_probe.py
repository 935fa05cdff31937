"""A source wrapper whose batches say which heavy modules the reading process has imported.

Spawned loader workers unpickle it by name: this module imports only the standard
library and numpy, so whatever heavy module a worker holds came from grain_replay.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

HEAVY = ("jax", "jaxlib", "grain", "orbax", "tensorflow", "torch")


class ImportProbe:
    """Reads ``source`` with ``read_batch``; a batch is ``{"data": ..., "heavy": ..., "pid": ...}``.

    ``heavy[r, i]`` says whether ``HEAVY[i]`` was in ``sys.modules`` of the process
    that read row ``r``; ``pid[r]`` is that process's id. With ``dump``, the
    reading process also writes its sorted ``sys.modules`` to ``dump/<pid>.txt``.
    """

    def __init__(self, source: Any, dump: str | None = None) -> None:
        self.source = source
        self.dump = dump

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"ImportProbe({self.source!r})"

    def read_batch(self, indices: Any, **kwargs: Any) -> Any:
        data = self.source.read_batch(indices, **kwargs)
        rows = len(indices)
        heavy = np.array([[name in sys.modules for name in HEAVY]] * rows, dtype=bool)
        if self.dump is not None:
            with open(os.path.join(self.dump, f"{os.getpid()}.txt"), "w") as f:
                f.write("\n".join(sorted(sys.modules)))
        return {"data": data, "heavy": heavy, "pid": np.full(rows, os.getpid(), np.int64)}
