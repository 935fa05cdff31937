"""Resident replay's jitted programs, kept: an iterator like an earlier one compiles nothing.

jax keeps what it traced and compiled with the function object it was given, so a program
built afresh for every iterator (a closure over that iterator's layout, wrapped in a new
``shard_map`` and ``jit``) is traced, lowered and compiled again every time, though it is
the same program: 5-10 s on a CPU for the gather of a window of 64 batches of 5 leaves
(``benchmarks/probe_resident_compile.py``). So the programs are built here, once for each
layout (its public description: capacity, the leaves' shapes and device dtypes, the
buffers' groups, shapes and dtypes) and sharding, and the :data:`_KEPT` used last are
kept: the second iterator of a process over a store of the same shapes (a test file's
next test, a learner's next run) reuses the compiled programs. A program holds no store
(the buffers are its arguments), so closing an iterator still frees its device memory.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from grain_replay.device.lines import RowLayout

__all__ = ["clear", "gather_program", "layout_key", "load_programs", "traces"]

_KEPT = 32  # programs kept, the least recently used dropped first; 0: none kept

_lock = threading.Lock()
_programs: collections.OrderedDict[Hashable, Callable[..., Any]] = collections.OrderedDict()
_traced = 0


def layout_key(layout: RowLayout) -> tuple[Any, ...]:
    """What a program built on ``layout`` depends on: equal keys, the same program."""
    probe = layout.probe
    return (
        layout.capacity,
        tuple(probe.shapes),
        tuple(probe.dtypes),
        tuple((kind, lanes, tuple(members)) for kind, lanes, members in layout.groups),
        tuple(layout.shapes),
        tuple(layout.dtypes),
    )


def traces() -> int:
    """Programs of this module traced in this process (a trace is followed by a compile):
    one for each program and shape of its arguments, none for a program kept."""
    return _traced


def clear() -> None:
    """Drops the kept programs: the next iterator traces and compiles its own (a test that
    swaps a function a program calls while it is traced, ``row_dma.gather_rows`` say, clears
    them before and after: a kept program would not call its swap, nor keep it from others)."""
    with _lock:
        _programs.clear()


def _counted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, counting its calls: jax calls it once for each trace."""

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        global _traced
        with _lock:
            _traced += 1
        return fn(*args, **kwargs)

    return traced


def _kept(key: Hashable, build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """The program kept under ``key``, else ``build()`` (kept from now on)."""
    with _lock:
        program = _programs.get(key)
        if program is not None:
            _programs.move_to_end(key)
            return program
    program = build()  # outside the lock: tracing happens at the first call, not here
    with _lock:
        program = _programs.setdefault(key, program)  # a racing thread's, if it was first
        _programs.move_to_end(key)
        while len(_programs) > _KEPT:
            _programs.popitem(last=False)
    return program


def gather_program(layout: RowLayout, sharding: NamedSharding, dma: bool) -> Callable[..., Any]:
    """The jitted gather of a window: ``(store, ids)`` to a tuple of ``steps`` batches, each
    the list of leaves (leaf order, device dtypes, ``sharding``) of the rows ``ids[k]``.

    ``ids`` is ``(steps, rows)``, sharded ``PartitionSpec(None, axis)``: each device gathers
    its own slice of every batch from its replica of ``store``. One gather a batch, unrolled
    (not one gather of the window's rows then split): each batch's leaves are written where
    they are handed out, with no window-sized temporary, and a batch is its own arrays.
    """
    mesh, axis = sharding.mesh, sharding.spec[0] if sharding.spec else None

    def build() -> Callable[..., Any]:
        def gather(store: list[jax.Array], ids: jax.Array) -> tuple[list[jax.Array], ...]:
            # Per device: ids is (steps, this device's rows); store is the whole replica.
            return tuple(layout.gather(store, ids[k], dma=dma) for k in range(ids.shape[0]))

        return jax.jit(
            jax.shard_map(
                _counted(gather),
                mesh=mesh,
                in_specs=(PartitionSpec(), PartitionSpec(None, axis)),
                out_specs=PartitionSpec(axis),
            ),
            # The batch sharding itself: shard_map alone gives PartitionSpec() on a mesh
            # of one device, where the host pipeline gives this one.
            out_shardings=sharding,
        )

    return _kept(("gather", layout_key(layout), sharding, dma), build)


def load_programs(
    layout: RowLayout, replicated: NamedSharding
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The jitted ``layout.allocate`` and ``layout.write_rows`` (its buffers donated: updated
    in place), their buffers replicated over ``replicated``'s devices."""
    key = layout_key(layout)
    allocate = _kept(
        ("allocate", key, replicated),
        lambda: jax.jit(_counted(layout.allocate), out_shardings=replicated),
    )
    write_rows = _kept(
        ("write_rows", key, replicated),
        lambda: jax.jit(_counted(layout.write_rows), donate_argnums=0, out_shardings=replicated),
    )
    return allocate, write_rows
