"""Counting what a device append costs in jax calls and lock acquisitions, thread by thread.

Used by ``bench_device_writes.py`` (the jax calls per append row) and
``probe_device_append_calls.py``. :func:`counting` installs counting wrappers (for the
``with`` block only; nothing in the library is changed) around every way the device
writer reaches jax, and counts each call once, by the thread that made it (a call jax
makes inside a counted one is jax's own):

- ``jit``: calls of the writer's jitted stacking function (``pack._packer``);
- ``Array.copy_to_host_async``, ``block_until_ready``, ``delete``;
- ``np.asarray``/``np.array`` of a ``jax.Array`` in the writer's modules (the buffer
  protocol on CPU devices, ``__array__`` on an accelerator);
- ``jax.device_get``, ``jax.device_put``;

which are the dispatches (:func:`jax_calls`), and apart from them ``Array.is_deleted``
(``"check: ..."``), the liveness check of an append: a C++ accessor of the array, no
dispatch, no wait;

and, with ``locks=True``, the acquisitions of the lock a ``BackgroundWriter`` made inside
the block shares with its two conditions (``notify`` tries it once: a ``Condition`` on a
plain lock does) and of the packer's. Each jax call costs ~0.1 ms of host CPU on the TPU v5e
host (13 times this VM's): their count per append transfers from one host to another,
CPU times do not.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

from grain_replay.writers.device import background
from grain_replay.writers.device import pack as device_pack

__all__ = ["counting", "group", "jax_calls"]

_INSIDE = threading.local()  # within a counted jax call: the calls it makes are jax's own
_METHODS = ("copy_to_host_async", "block_until_ready", "delete")


def group() -> str:
    """The calling thread's group: ``caller`` (the main thread), or the writer's threads
    (``device-writes``, ``device-syncs``, ``fsync``) by name."""
    name = threading.current_thread().name
    if name == "MainThread":
        return "caller"
    for prefix in ("grain_replay-device-writes", "grain_replay-device-syncs", "grain_replay-fsync"):
        if name.startswith(prefix):
            return prefix.removeprefix("grain_replay-")
    return name


def jax_calls(counts: collections.Counter[tuple[str, str]], who: str, kind: str = "jax:") -> int:
    """The jax calls (dispatches; ``kind="check:"``: the liveness checks) of thread group
    ``who`` in ``counts`` (what :func:`counting` gave)."""
    return sum(c for (g, what), c in counts.items() if g == who and what.startswith(kind))


class _CountingLock:
    """A lock counting its acquisitions by thread group (``Condition`` falls back to
    ``acquire(False)`` for ``_is_owned``, as on the plain lock it replaces)."""

    def __init__(self, counts: collections.Counter[tuple[str, str]], what: str) -> None:
        self._lock = threading.Lock()
        self._counts = counts
        self._what = what

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self._counts[group(), self._what] += 1
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def counting(locks: bool = False) -> Iterator[collections.Counter[tuple[str, str]]]:
    """Counts ``(thread group, "jax: what")`` calls (``"check: ..."``, ``"lock: whose"``)
    in the block."""
    import jax
    import numpy as np

    counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def counted_call(what: str, fn: Any, *a: Any, **k: Any) -> Any:
        if getattr(_INSIDE, "on", False):
            return fn(*a, **k)
        counts[group(), what] += 1
        _INSIDE.on = True
        try:
            return fn(*a, **k)
        finally:
            _INSIDE.on = False

    undo: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    array_type = type(jax.numpy.zeros(1))
    for name in _METHODS:
        orig = getattr(array_type, name, None)
        if orig is not None:
            patch(array_type, name, _method(counted_call, f"jax: Array.{name}", orig))
    orig = array_type.is_deleted
    patch(array_type, "is_deleted", _method(counted_call, "check: Array.is_deleted", orig))
    shim = types.ModuleType("numpy_counting")
    shim.__dict__.update(np.__dict__)
    for name in ("asarray", "array"):
        setattr(shim, name, _np_call(counted_call, jax.Array, name, getattr(np, name)))
    for mod in [m for n, m in sorted(sys.modules.items()) if n.startswith(_DEVICE_WRITERS)]:
        if getattr(mod, "np", None) is np:
            patch(mod, "np", shim)
    for name in ("device_get", "device_put"):
        patch(jax, name, _function(counted_call, f"jax: jax.{name}", getattr(jax, name)))
    # The writer's jitted stacking function, made (and compiled) or not yet.
    packer = device_pack._packer
    if packer is not None:
        patch(device_pack, "_packer", _function(counted_call, "jax: jit pack()", packer))
    else:
        make = device_pack._make_packer
        patch(
            device_pack, "_make_packer", lambda: _function(counted_call, "jax: jit pack()", make())
        )
    if locks:
        threads = types.ModuleType("threading_counting")
        threads.__dict__.update(threading.__dict__)
        threads.Lock = lambda: _CountingLock(counts, "lock: writer's")  # type: ignore[attr-defined]
        patch(background, "threading", threads)
        patch(device_pack, "_lock", _CountingLock(counts, "lock: packer's"))
    try:
        yield counts
    finally:
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)
        if packer is None and device_pack._packer is not None:
            device_pack._packer = None  # the counting one: made again, uncounted, when needed


_DEVICE_WRITERS = "grain_replay.writers.device"


def _method(counted_call: Any, what: str, orig: Any) -> Any:
    def counted(self: Any, *a: Any, **k: Any) -> Any:
        return counted_call(what, orig, self, *a, **k)

    return counted


def _function(counted_call: Any, what: str, orig: Any) -> Any:
    def counted(*a: Any, **k: Any) -> Any:
        return counted_call(what, orig, *a, **k)

    return counted


def _np_call(counted_call: Any, array_type: type, name: str, orig: Any) -> Any:
    what = f"jax: np.{name}(jax.Array)"

    def call(a: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(a, array_type):
            return counted_call(what, orig, a, *args, **kw)
        return orig(a, *args, **kw)

    return call
