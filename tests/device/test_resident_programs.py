"""Resident replay's programs kept for the process: a second iterator of the same shapes
traces (and so compiles) nothing; one that differs in anything its program depends on
traces its own, and yields the host pipeline's batches."""

from __future__ import annotations

import os

# Must precede the first jax import: 8 fake CPU devices, as `make test` runs.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import grain_replay as gr
from grain_replay.device import resident as resident_module
from grain_replay.device import resident_programs

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 JAX devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
    "before JAX is first imported",
)

N = 64


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Any:
    """No program kept from an earlier test; windows of 4 batches (a quick compile)."""
    monkeypatch.setattr(resident_module, "_MAX_WINDOW", 4)
    resident_programs.clear()
    yield
    resident_programs.clear()


def _store(tmp_path: Path, name: str, dtype: Any = np.float32) -> str:
    rng = np.random.default_rng(1)
    path = str(tmp_path / name)
    gr.write(
        path,
        {
            "x": (rng.standard_normal((N, 3)) * 1000).astype(dtype),
            "done": rng.random(N) < 0.5,
        },
        format="npy",
    )
    return path


def _same_as_host(loader: Any, sharding: Any = None) -> list[Any]:
    """The resident batches of ``loader``, checked against the host pipeline's."""
    host = list(gr.sharded_device_put(loader, sharding))
    resident = list(gr.sharded_device_put(loader, sharding, resident=True))
    assert len(resident) == len(host) > 0
    for h, r in zip(host, resident, strict=True):
        for a, b in zip(jax.tree.leaves(h), jax.tree.leaves(r), strict=True):
            assert a.dtype == b.dtype and a.sharding == b.sharding
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return resident


def test_second_iterator_of_the_same_shapes_traces_nothing(tmp_path: Path) -> None:
    src = gr.open_source(_store(tmp_path, "a"))
    before = resident_programs.traces()
    _same_as_host(gr.make_data_loader(src, batch_size=16, num_epochs=2, seed=1))
    assert resident_programs.traces() - before == 3  # allocate, write_rows, the gather

    # Another loader (seed, epochs) and another source object over the same store, then a
    # store of its own with the same shapes: the kept programs, their batches the host's.
    traced = resident_programs.traces()
    _same_as_host(gr.make_data_loader(src, batch_size=16, num_epochs=3, seed=2))
    again = gr.open_source(_store(tmp_path, "b"))
    _same_as_host(gr.make_data_loader(again, batch_size=16, seed=3))
    assert resident_programs.traces() == traced


def test_iterator_that_differs_traces_its_own_and_yields_host_batches(tmp_path: Path) -> None:
    src = gr.open_source(_store(tmp_path, "a"))
    _same_as_host(gr.make_data_loader(src, batch_size=16))

    # int32 records of float32's shapes: the same buffers of words; another unpacking.
    ints = gr.open_source(_store(tmp_path, "ints", np.int32))
    traced = resident_programs.traces()
    (first, *_) = _same_as_host(gr.make_data_loader(ints, batch_size=16))
    assert first["x"].dtype == np.int32
    assert resident_programs.traces() - traced == 3

    # Another batch size: the gather at its new shape (the store's programs kept).
    traced = resident_programs.traces()
    _same_as_host(gr.make_data_loader(src, batch_size=8))
    assert resident_programs.traces() - traced == 1

    # Another sharding (the batch axis over the mesh's second axis): programs of its own.
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    traced = resident_programs.traces()
    _same_as_host(
        gr.make_data_loader(src, batch_size=16), NamedSharding(mesh, PartitionSpec("model"))
    )
    assert resident_programs.traces() - traced == 3


def test_keeps_the_programs_used_last_and_none_at_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = gr.make_data_loader(gr.open_source(_store(tmp_path, "a")), batch_size=16)
    b = gr.make_data_loader(gr.open_source(_store(tmp_path, "b", np.int32)), batch_size=16)
    monkeypatch.setattr(resident_programs, "_KEPT", 3)  # one iterator's programs
    _same_as_host(a)
    _same_as_host(b)  # drops a's
    traced = resident_programs.traces()
    _same_as_host(b)
    assert resident_programs.traces() == traced
    _same_as_host(a)
    assert resident_programs.traces() - traced == 3

    monkeypatch.setattr(resident_programs, "_KEPT", 0)  # every iterator its own programs
    resident_programs.clear()
    traced = resident_programs.traces()
    _same_as_host(a)
    _same_as_host(a)
    assert resident_programs.traces() - traced == 6
