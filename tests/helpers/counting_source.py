"""A source wrapper that records the rows of every ``read_batch`` call (resident loads)."""

from __future__ import annotations

from typing import Any


class CountingSource:
    """A source that records the rows of every read_batch call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        return self.inner[i]

    def read_batch(self, ids: Any) -> Any:
        self.reads.append(len(ids))
        return self.inner.read_batch(ids)

    def __repr__(self) -> str:
        return f"CountingSource({self.inner!r})"
