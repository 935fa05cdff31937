"""Windows of consecutive rows, read in one go: what a view's sequences and n-step reads ask
a store for (:class:`WindowReads`, a part of :class:`~grain_replay.sources.base.ReplaySource`)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from grain_replay.errors import GrainReplayError, InvalidStoreError, UnknownLeafError
from grain_replay.sources.checks import window_starts
from grain_replay.sources.keys import Layout
from grain_replay.sources.reading.readers import Handle
from grain_replay.sources.reading.windows import fix_windows

__all__ = ["STORE_READ_FAULTS", "WindowReads"]

# Reads' damaged-store failures (not IndexError: unchecked reads pass the caller's indices).
STORE_READ_FAULTS = (OSError, ValueError, RuntimeError, KeyError, EOFError, zlib.error)


class WindowReads:
    """Window reads over a store's handle; the store gives its layout, handle and errors."""

    _path: str
    _keys: list[str]
    _layout: Layout

    if TYPE_CHECKING:  # what the store it is part of gives it

        def __len__(self) -> int: ...
        def _get_handle(self) -> Handle: ...
        def _corrupt(self, key: str | None, error: BaseException) -> InvalidStoreError: ...

    def read_windows(
        self, key: str, starts: Sequence[int] | np.ndarray, length: int, *, check: bool = True
    ) -> np.ndarray:
        """``length`` consecutive rows of leaf ``key`` from each of ``starts``, in one read.

        A memory-mapped or in-memory leaf copies each window as one block (a
        ``.npy`` store: about 0.6x the time of ``read_leaf`` of the same rows);
        other readers take the ``len(starts) * length`` rows at once.

        Args:
          key: the leaf.
          starts: first row of each window, ``0 <= start <= N - length``.
          length: rows per window, at least 1.
          check: False skips checking ``starts`` for a caller that computed
            them in range; one out of range then raises numpy's ``IndexError``
            (no read leaves the store).

        Returns:
          ``(len(starts), length, *leaf_shape)``.

        Raises:
          UnknownLeafError: no leaf ``key``.
          RecordIndexError: a window reaches outside the store.
        """
        if key not in self._layout.spec:
            raise UnknownLeafError(f"{self._path}: no leaf {key!r}; leaves: {self._keys}")
        length = int(length)
        idx = window_starts(starts, length, len(self), self._path) if check else np.asarray(starts)
        handle = self._get_handle()
        handle.check_mapped([key])
        return self._take_windows(handle, key, idx, length)

    def read_windows_flat(
        self, windows: Mapping[str, tuple[Sequence[int] | np.ndarray, int]], *, check: bool = True
    ) -> dict[str, np.ndarray]:
        """:meth:`read_windows` of several leaves in one call, with one handle and one
        truncation check for all of them (a batch of sequences reads its leaves so).

        Args:
          windows: leaf key -> ``(starts, length)``, as :meth:`read_windows` takes them.
          check: as for :meth:`read_windows`.

        Returns:
          Leaf key -> ``(len(starts), length, *leaf_shape)``, in the order given.

        Raises:
          UnknownLeafError: no leaf of a key.
          RecordIndexError: a window reaches outside the store.
        """
        if getattr(self.read_windows, "__func__", None) is not WindowReads.read_windows:
            # A subclass reads windows its own way (its records are not consecutive rows).
            return {k: self.read_windows(k, s, n, check=check) for k, (s, n) in windows.items()}
        spec = self._layout.spec
        asked = {}
        for key, (starts, length) in windows.items():
            if key not in spec:
                raise UnknownLeafError(f"{self._path}: no leaf {key!r}; leaves: {self._keys}")
            n = int(length)
            idx = window_starts(starts, n, len(self), self._path) if check else np.asarray(starts)
            asked[key] = (idx, n)
        handle = self._get_handle()
        handle.check_mapped(asked)
        return {
            key: self._take_windows(handle, key, starts, n) for key, (starts, n) in asked.items()
        }

    def read_windows_fixed(
        self, windows: Mapping[str, tuple[np.ndarray, int, np.ndarray | None, np.ndarray | None]]
    ) -> dict[str, np.ndarray]:
        """:meth:`read_windows_flat` with ``check=False`` and a fix-up per leaf: leaf key ->
        ``(starts, length, near, at)``; window ``near[i]`` takes at its position ``j`` the
        row ``starts[near[i]] + at[i, j]`` (``near``/``at`` None: none). For the views'
        windowed reads (``rl/_sequence_windows.py``); the starts and ``at`` are in range."""
        if getattr(self.read_windows, "__func__", None) is not WindowReads.read_windows:
            got = self.read_windows_flat({k: (w[0], w[1]) for k, w in windows.items()}, check=False)
            for key, (_, _, near, at) in windows.items():
                fix_windows(got[key], near, at)
            return got
        spec = self._layout.spec
        for key in windows:
            if key not in spec:
                raise UnknownLeafError(f"{self._path}: no leaf {key!r}; leaves: {self._keys}")
        handle = self._get_handle()
        handle.check_mapped(windows)
        out = {}
        for key, (starts, n, near, at) in windows.items():
            try:
                out[key] = handle.readers[key].take_windows_fixed(starts, n, near, at)
            except GrainReplayError:
                raise
            except STORE_READ_FAULTS as e:
                raise self._corrupt(key, e) from e
        return out

    def _take_windows(
        self, handle: Handle, key: str, starts: np.ndarray, length: int
    ) -> np.ndarray:
        try:
            return handle.readers[key].take_windows(starts, length)
        except GrainReplayError:
            raise
        except STORE_READ_FAULTS as e:
            raise self._corrupt(key, e) from e
