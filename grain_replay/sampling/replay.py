"""Uniform replay: rows drawn with replacement from the committed rows of a (growing) store."""

from __future__ import annotations

import dataclasses
import operator
import os
import pickle
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from grain_replay.errors import InvalidSamplingError
from grain_replay.sampling.draws import integers

__all__ = ["UniformReplay", "UniformSampler", "RowReader", "StoreLength", "check_refresh_every"]


def check_refresh_every(value: Any, owner: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise InvalidSamplingError(f"{owner}: refresh_every must be an int or None, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise InvalidSamplingError(
            f"{owner}: refresh_every must be an int or None, got {value!r}"
        ) from None
    if value <= 0:
        raise InvalidSamplingError(
            f"{owner}: refresh_every must be positive (batches between looks for new rows) "
            f"or None (only on refresh()), got {value}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class UniformReplay:
    """Uniform sampling with replacement over the rows committed so far.

    Batch ``t`` of process ``p`` is ``batch_size`` row indices drawn uniformly from
    ``[0, n_t)``, a pure function of ``(seed, p, t, n_t)``, where ``n_t`` is the
    store's length as last seen: the loader looks for newly committed rows (a
    ``ReplayWriter`` appending in this or another process) every ``refresh_every``
    batches and when the iterator's ``refresh()`` is called. No epochs and no
    array of size N: a draw is O(batch).

    Args:
      refresh_every: batches between looks for new rows (re-reading the store's
        metadata, ~a file read); None looks only when ``refresh()`` is called.

    Example:
      >>> loader = gr.make_data_loader(src, batch_size=256, sampling=gr.UniformReplay())
    """

    refresh_every: int | None = 16

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "refresh_every", check_refresh_every(self.refresh_every, "UniformReplay")
        )


class StoreLength:
    """The committed length of a source, re-read on a schedule of steps or on request.

    The length is read from a copy of the source that never reads rows (its
    ``refresh()`` re-reads the metadata only), so looking costs no reopening of the
    store's files; the reading copy refreshes only when a drawn row is past its end
    (:class:`RowReader`). A scheduled look at a local store first compares the
    store's ``stat`` (a commit replaces the metadata file, which changes the
    directory's or the file's mtime) and re-reads the metadata only on a change;
    ``refresh()`` always re-reads.
    """

    def __init__(self, source: Any, refresh_every: int | None) -> None:
        self._every = refresh_every
        self._forced = False
        self.n = len(source)
        self._stamp: tuple[int, int, int] | None = None
        self._probe = source
        if callable(getattr(source, "refresh", None)):
            try:  # grain_replay's sources pickle without handles: an independent copy
                self._probe = pickle.loads(pickle.dumps(source))
            except Exception:
                self._probe = source

    def _changed(self) -> bool:
        """False only when the local store's stat is what it was at the last look."""
        path = getattr(self._probe, "path", None)
        if not isinstance(path, str) or "://" in path:
            return True
        try:
            st = os.stat(path)
        except OSError:
            return True
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        # A coarse-grained clock could hide a second commit within the same tick.
        recent = time.time_ns() - st.st_mtime_ns < 2_000_000_000
        if stamp == self._stamp and not recent:
            return False
        self._stamp = stamp
        return True

    def request(self) -> None:
        """The next draw re-reads the length."""
        self._forced = True

    def at(self, step: int) -> int:
        """The length to draw step ``step`` from (re-read when due)."""
        due = self._forced or (
            self._every is not None and step % self._every == 0 and self._changed()
        )
        if due:
            self._forced = False
            refresh = getattr(self._probe, "refresh", None)
            # A reader never goes back: a store is only appended to.
            self.n = max(self.n, int(refresh()) if callable(refresh) else len(self._probe))
        return self.n


class UniformSampler:
    """Consumer side of :class:`UniformReplay`: the row indices of each step."""

    def __init__(
        self,
        source: Any,
        options: UniformReplay,
        batch_size: int,
        *,
        seed: int,
        shard_index: int = 0,
    ) -> None:
        self._length = StoreLength(source, options.refresh_every)
        self._batch_size = batch_size
        self._seed = seed
        self._stream = shard_index
        self._step = 0
        self._source = source

    def refresh(self) -> None:
        self._length.request()

    def draw(self) -> np.ndarray:
        n = self._length.at(self._step)
        if n == 0:
            raise InvalidSamplingError(
                f"{self._source!r} has no committed rows to replay. Fix: append and flush rows "
                "with a ReplayWriter before the first batch."
            )
        ids = integers(self._seed, self._stream, self._step, self._batch_size, n)
        self._step += 1
        return ids

    def state(self) -> dict[str, Any]:
        return {"step": self._step, "n": self._length.n}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._step = int(state["step"])
        self._length.n = int(state["n"])


class RowReader:
    """Worker side: ``read_batch`` of a step's rows, looking for new rows when one is past the end.

    The rows were drawn in the consuming process, which may have seen rows that
    this process's copy of the source has not yet.
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self, rows: np.ndarray) -> Any:
        if len(rows) and int(rows.max()) >= len(self.source):
            refresh = getattr(self.source, "refresh", None)
            if callable(refresh):
                refresh()
        return self.source.read_batch(rows)

    def __repr__(self) -> str:
        return f"RowReader({self.source!r})"
