"""A ReplayWriter's writes and commits handed to its background thread (device appends)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from grain_replay.errors import GrainReplayError
from grain_replay.writers.device.background import BackgroundWriter
from grain_replay.writers.object_parts import ObjectPartWriter
from grain_replay.writers.parts_writer import PartWriter
from grain_replay.writers.store_writer import StoreWriter

__all__ = ["QueuedWrites"]


class QueuedWrites:
    """The trees and commits a :class:`~grain_replay.ReplayWriter` queues for its background
    thread (:class:`~grain_replay.writers.device.background.BackgroundWriter`), which starts
    on the first device append or ``flush(wait=False)``: ``thread`` is None until then.

    Args:
      store: the writer's store, which the thread writes and commits.
      who: the store, as errors name it.
      max_inflight: bytes queued before an append waits.
      path: the writer's path, as the error after a failure names it.
    """

    def __init__(
        self, store: PartWriter | StoreWriter | ObjectPartWriter, who: str, max_inflight: int,
        path: str,
    ):  # fmt: skip
        self._store, self._who, self._max_inflight, self._path = store, who, max_inflight, path
        self.thread: BackgroundWriter | None = None

    def wants(self, arrays: dict[str, Any], is_device: Callable[[Any], bool] | None) -> bool:
        """Whether a checked tree goes to the thread: it holds device arrays, or device
        appends before it are still queued (rows keep append order)."""
        if self.thread is not None and self.thread.busy:
            return True
        return is_device is not None and any(is_device(a) for a in arrays.values())

    def queue(
        self,
        arrays: dict[str, Any],
        n: int,
        first: int,
        is_device: Callable[[Any], bool] | None,
        tree: Any,
    ) -> None:
        """Queues a checked tree of ``n`` rows, the writer's rows ``first`` on."""
        self.start().submit(arrays, n, first, self._write, is_device or (lambda _: False), tree)

    def queue_commit(
        self, upto: int, done: Callable[[int], None], committed: Callable[[], int]
    ) -> None:
        """Queues a commit of every row queued so far (``upto`` rows in all): the thread
        commits them and passes the committed N to ``done``. ``committed``: the rows
        committed before it (for the error's message)."""
        store = self._store
        self.start().submit_commit(lambda: done(store.flush()), upto, committed)

    def start(self) -> BackgroundWriter:
        """The background threads, started on the first call."""
        if self.thread is None:
            sync = None
            if isinstance(self._store, PartWriter):
                sync = self._store.commit_filled
                self._store.defer_evictions = True  # removed by the sync thread
            self.thread = BackgroundWriter(self._who, self._max_inflight, sync)
        return self.thread

    def _write(self, arrays: dict[str, np.ndarray], n: int) -> None:
        """The background thread's write of a queued tree (host arrays by now)."""
        self._store.write(arrays, n, by_leaf=True)

    def raise_failed(self) -> None:
        """Raises the thread's failure: the first call after it as BackgroundWriteError,
        later ones as the GrainReplayError saying that the writer stopped."""
        assert self.thread is not None
        self.thread.raise_pending()
        raise GrainReplayError(
            f"{self._path}: this ReplayWriter stopped after a failed background write or "
            "commit (raised earlier as BackgroundWriteError). Fix: close() it and reopen the "
            "store with gr.ReplayWriter to append after its committed rows."
        )
