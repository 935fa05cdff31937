"""The surface every source shares, stores and RL views alike, and the Protocol loaders read."""

from __future__ import annotations

import abc
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, Self, TypeVar, runtime_checkable

import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.sources.checks import check_out
from grain_replay.store.layout import LeafSpec

__all__ = ["BatchSource", "SourceSurface"]

T = TypeVar("T")

# This process's id, kept by a fork hook: ``os.getpid()`` is a system call (glibc
# does not cache it), and every batch read asks which process it runs in, to
# find that process's handle. A child started by ``os.fork`` (multiprocessing's
# "fork" included) sets its own in the hook; a spawned one imports afresh.
_PID = [os.getpid()]


def _pid_after_fork() -> None:
    _PID[0] = os.getpid()


os.register_at_fork(after_in_child=_pid_after_fork)


def current_pid() -> int:
    """``os.getpid()`` without the system call (see ``_PID``)."""
    return _PID[0]


@runtime_checkable
class BatchSource(Protocol):
    """What ``make_data_loader`` and the RL views read: a length and batched reads.

    Every grain_replay source and view satisfies it; so does any object with
    these two methods (``isinstance(x, BatchSource)`` checks them by name).
    """

    def __len__(self) -> int: ...

    def read_batch(self, indices: Sequence[int] | np.ndarray) -> Any:
        """The records ``indices`` as one tree with a leading batch axis."""
        ...


class SourceSurface(abc.ABC):
    """The surface every grain_replay source shares, stores and RL views alike.

    A grain ``RandomAccessDataSource`` structurally (``__len__``,
    ``__getitem__``, ``_getitems``), plus ``read_batch`` (one vectorized read
    per leaf), ``spec``/``keys``/``treedef``, ``close()`` and the context
    manager, and pickling that carries no per-process state.

    Subclasses implement :meth:`read_flat`, ``__len__``, ``__getitem__``,
    :meth:`close`, ``spec`` and ``treedef``, keep a ``threading.Lock`` in
    ``_lock`` and the compiled unflatten of ``treedef`` in ``_build``, and list
    in ``_PER_PROCESS`` the attributes a pickle resets (handles, indexes).
    """

    _PER_PROCESS: ClassVar[dict[str, Any]] = {}
    _lock: threading.Lock
    _pid: int | None
    _build: Callable[[Mapping[str, np.ndarray]], Any]

    @abc.abstractmethod
    def __len__(self) -> int:
        """The number of records N."""

    @abc.abstractmethod
    def __getitem__(self, index: int) -> Any:
        """Record ``index`` (negative counts from the end) as a tree of numpy arrays."""

    @abc.abstractmethod
    def read_flat(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Like :meth:`read_batch` but returns ``{key: array}`` instead of the tree."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases this process's handle; reading again reopens it."""

    @property
    @abc.abstractmethod
    def spec(self) -> Mapping[str, LeafSpec]:
        """Leaf key -> per-record ``LeafSpec(dtype, shape)``, in tree order."""

    @property
    @abc.abstractmethod
    def treedef(self) -> dict[str, Any]:
        """The record's tree structure (see :mod:`grain_replay.tree`)."""

    @property
    def keys(self) -> list[str]:
        """The leaf keys, in tree order."""
        return list(self.spec)

    # A source with a handle keeps it in ``_handle`` and counts its opens in ``_opens``
    # (a view: properties that ask the source it wraps); these name them publicly.
    @property
    def open_handle(self) -> Any:
        """The handle this object holds on its files (None: not opened yet, or closed)."""
        return getattr(self, "_handle", None)

    @property
    def handle_opens(self) -> int:
        """How many handles this object opened, reopens included (a pickle starts at 0)."""
        return int(getattr(self, "_opens", 0))

    def read_batch(self, indices: Sequence[int] | np.ndarray) -> Any:
        """Reads records ``indices`` with one vectorized read per leaf.

        Args:
          indices: record indices in any order; duplicates and negative indices
            are allowed.

        Returns:
          The record tree with a leading batch axis of ``len(indices)``, rows in
          the order given.

        Raises:
          RecordIndexError: an index is outside ``[-N, N)``.
        """
        return self._build(self.read_flat(indices))

    def read_into(
        self,
        indices: Sequence[int] | np.ndarray,
        out: Mapping[str, np.ndarray],
        *,
        check: bool = True,
    ) -> None:
        """Reads records ``indices`` of the leaves named in ``out`` into those arrays.

        What :meth:`read_flat` returns, written in place instead of into new
        arrays: a mixture reads each source's rows into its slice of one batch.

        Args:
          indices: as for :meth:`read_batch`.
          out: leaf key -> a writeable array of shape ``(len(indices), *spec.shape)``
            and the leaf's dtype; leaves not named are not read.
          check: False skips checking ``out`` (the caller allocated it from ``spec``).

        Raises:
          UnknownLeafError: ``out`` names a leaf the source lacks.
          InvalidArgumentError: an array of the wrong shape or dtype, or read-only.
          RecordIndexError: an index is outside ``[-N, N)``.
        """
        if check:
            check_out(out, self.spec, len(np.asarray(indices).reshape(-1)), repr(self))
        flat = self.read_flat(indices)
        for k, dst in out.items():
            dst[...] = flat[k]

    def _getitems(self, indices: Sequence[int]) -> list[Any]:
        """grain's batched-read protocol: the list of records ``indices``."""
        flat = self.read_flat(indices)
        return [self._build({k: v[j] for k, v in flat.items()}) for j in range(len(indices))]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _per_process(self, name: str, make: Callable[[], T]) -> T:
        """Attribute ``name``, made by ``make()`` once per process (double-checked lock).

        After a fork the parent's value is dropped and the lock replaced: the
        parent's lock may have been held at fork time.
        """
        pid = _PID[0]
        value = getattr(self, name)
        if value is not None and self._pid == pid:
            return value
        if self._pid is not None and self._pid != pid:
            self._lock = threading.Lock()
            setattr(self, name, None)
        with self._lock:
            value = getattr(self, name)
            if value is None:
                value = make()
                setattr(self, name, value)
                self._pid = pid
            return value

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"], state["_build"]
        state.update(self._PER_PROCESS)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._build = tree_lib.compile_unflatten(self.treedef)
