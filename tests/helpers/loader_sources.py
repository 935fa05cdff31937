"""Sources the worker-path tests send to spawned workers (importable by name).

Sources only, and without grain: a worker that unpickles one imports this module and not
grain, whose import takes jax (~2 s of CPU a worker process). The operations (grain
transforms) are in loader_ops.
"""

from __future__ import annotations

import os
from typing import Any


class FailOnce:
    """Delegates to ``source``; in each process, the read of global batch ``bad_id`` fails once."""

    def __init__(self, source: Any, bad_id: int) -> None:
        self.source = source
        self.bad_id = bad_id
        self.failed: set[int] = set()

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"FailOnce({self.source!r}, {self.bad_id})"

    def read_batch(self, indices: Any) -> Any:
        batch = self.source.read_batch(indices)
        if self.bad_id in batch["id"] and os.getpid() not in self.failed:
            self.failed.add(os.getpid())
            raise OSError(f"flaky read of record {self.bad_id}")
        return batch


class Unreadable:
    """A source whose every read fails: the error must reach the consumer, named."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"Unreadable({self.source!r})"

    def read_batch(self, indices: Any) -> Any:
        raise KeyError("leaf 'obs' is missing in this test")


class SlowAfterFirst:
    """Delegates to ``source``; every read after the first in a process sleeps ``seconds``."""

    def __init__(self, source: Any, seconds: float) -> None:
        self.source = source
        self.seconds = seconds
        self.reads = 0

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"SlowAfterFirst({self.source!r}, {self.seconds})"

    def read_batch(self, indices: Any) -> Any:
        self.reads += 1
        if self.reads > 1:
            import time

            time.sleep(self.seconds)
        return self.source.read_batch(indices)


class MarkedInto:
    """Delegates to ``source``, but ``read_into`` adds ``offset`` to the ``id`` leaf: tells
    which batches a worker read straight into its slot."""

    def __init__(self, source: Any, offset: int = 1000) -> None:
        self.source = source
        self.offset = offset

    def __len__(self) -> int:
        return len(self.source)

    def __repr__(self) -> str:
        return f"MarkedInto({self.source!r}, {self.offset})"

    def read_batch(self, indices: Any) -> Any:
        return self.source.read_batch(indices)

    def read_into(self, indices: Any, out: Any) -> None:
        self.source.read_into(indices, out)
        out["id"] += self.offset


class IntoFails(MarkedInto):
    """``read_into`` always raises: the worker reads with ``read_batch`` instead."""

    def read_into(self, indices: Any, out: Any) -> None:
        raise ValueError("this source cannot read into arrays")
