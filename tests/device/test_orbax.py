"""Every iterator grain_replay hands out round-trips through grain's Orbax handler.

``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore`` in an
``orbax.checkpoint.CheckpointManager``, as a training loop saves its data
iterator next to the model. Also: the ``grain.DataLoaderIterator`` methods our
iterators define, and Orbax's ``StatefulCheckpointable`` protocol (save/load).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np
import pytest
from conformance import make_tree

import grain_replay as gr
from grain_replay.device.put import ShardedDevicePutIterator
from grain_replay.pipeline.grain_iterator import GrainStateIterator
from grain_replay.pipeline.in_process import InProcessLoaderIterator
from grain_replay.pipeline.workers import WorkerLoaderIterator

ocp = pytest.importorskip("orbax.checkpoint")  # in the test extra

NO_SHARDING = grain.sharding.NoSharding()
N, B = 100, 8  # 12 batches a epoch; 8 divides over the 8 test devices


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tree = make_tree(N)
    tree["id"] = np.arange(N, dtype=np.int64)
    p = str(tmp_path_factory.mktemp("orbax") / "s.h5")
    gr.write(p, tree)
    return p


def _loader(path: str, **kwargs: Any) -> grain.DataLoader:
    kwargs.setdefault("shard_options", NO_SHARDING)
    return gr.make_data_loader(gr.open_source(path), batch_size=B, seed=7, num_epochs=2, **kwargs)


def _dataset(path: str) -> grain.IterDataset:
    return gr.replay_dataset(
        gr.open_source(path), batch_size=B, seed=7, num_epochs=2, shard_options=NO_SHARDING
    )


def _ids(batch: Any) -> list[int]:
    return np.asarray(batch["id"]).tolist()


MAKERS: dict[str, Callable[[str], Iterator[Any]]] = {
    "loader": lambda p: iter(_loader(p)),
    "loader-read-ahead": lambda p: iter(_loader(p, read_options=grain.ReadOptions(2, 4))),
    "loader-workers": lambda p: iter(_loader(p, worker_count=2)),
    "device-put-loader": lambda p: gr.sharded_device_put(_loader(p)),
    "device-put-loader-sync": lambda p: gr.sharded_device_put(_loader(p), prefetch=0),
    "device-put-workers": lambda p: gr.sharded_device_put(_loader(p, worker_count=2)),
    "dataset": lambda p: iter(_dataset(p)),
    "device-put-dataset": lambda p: gr.sharded_device_put(_dataset(p)),
    "device-put-dataset-iterator": lambda p: gr.sharded_device_put(iter(_dataset(p))),
}


def _manager(directory: Path) -> Any:
    return ocp.CheckpointManager(directory, item_names=("data",))


@pytest.mark.parametrize("name", list(MAKERS))
def test_orbax_save_and_restore_resume_the_stream(path: str, tmp_path: Path, name: str) -> None:
    make = MAKERS[name]
    it = make(path)
    for _ in range(5):
        next(it)
    with _manager(tmp_path / "ckpt") as mgr:
        mgr.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mgr.wait_until_finished()
    rest = [_ids(b) for b in it]
    assert len(rest) == 2 * (N // B) - 5

    fresh = make(path)
    with _manager(tmp_path / "ckpt") as mgr:
        restored = mgr.restore(
            5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh))
        )
    assert restored["data"] is fresh
    assert [_ids(b) for b in fresh] == rest
    for x in (it, fresh):
        close = getattr(x, "close", None)
        if close is not None:
            close()


def test_orbax_checkpoint_moves_between_grain_and_our_iterators(path: str, tmp_path: Path) -> None:
    loader = _loader(path)
    ours = gr.sharded_device_put(loader)
    for _ in range(3):
        next(ours)
    with _manager(tmp_path / "ckpt") as mgr:
        mgr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(ours)))
        mgr.wait_until_finished()
    theirs = grain.DataLoader.__iter__(loader)  # grain's own iterator of the same loader
    assert not isinstance(theirs, GrainStateIterator)
    with _manager(tmp_path / "ckpt") as mgr:
        mgr.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(theirs)))
    assert [_ids(b) for b in theirs] == [_ids(b) for b in ours]
    ours.close()


def test_sharded_device_put_over_a_dataset_is_a_dataset_iterator(path: str) -> None:
    over_dataset = gr.sharded_device_put(_dataset(path))
    over_loader = gr.sharded_device_put(_loader(path))
    assert isinstance(over_dataset, ShardedDevicePutIterator)
    assert isinstance(over_dataset, grain.DatasetIterator)  # the handler saves a dict as JSON
    assert not isinstance(over_loader, grain.DatasetIterator)  # ... and bytes as text
    assert isinstance(over_dataset.get_state(), dict)
    assert isinstance(over_loader.get_state(), bytes)
    over_dataset.close()
    over_loader.close()


def test_start_prefetch_starts_the_producer_and_keeps_the_position(path: str) -> None:
    it = gr.sharded_device_put(_loader(path), prefetch=2)
    want = [_ids(b) for b in gr.sharded_device_put(_loader(path), prefetch=0)]
    it.start_prefetch()
    it.start_prefetch()  # idempotent
    assert [_ids(b) for b in it] == want
    it.start_prefetch()  # after the end: nothing starts
    with pytest.raises(StopIteration):
        next(it)


def test_our_iterators_define_every_method_of_grains_iterator() -> None:
    """grain.DataLoaderIterator.__init__ is not called, so no method of it may run."""
    theirs = {
        name
        for name, value in vars(grain.DataLoaderIterator).items()
        if inspect.isfunction(value) or isinstance(value, property)
    }
    assert {"__next__", "get_state", "set_state", "start_prefetch", "save", "load"} <= theirs
    for cls in (InProcessLoaderIterator, WorkerLoaderIterator):
        for name in theirs:
            owner = next(c for c in cls.__mro__ if name in vars(c))
            assert owner.__module__.startswith("grain_replay"), (cls, name, owner)


class _Creating:
    """Orbax's ``PathAwaitingCreation``: a directory that exists once awaited."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def await_creation(self) -> Any:
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path


@pytest.mark.parametrize(
    "name", ["loader", "loader-workers", "device-put-loader", "device-put-dataset"]
)
def test_stateful_checkpointable_save_and_load(path: str, tmp_path: Path, name: str) -> None:
    """Orbax's newer protocol: ``await it.save(dir)`` / ``await it.load(dir)``."""
    it = MAKERS[name](path)
    for _ in range(4):
        next(it)

    async def save() -> None:
        await (await it.save(_Creating(tmp_path / "it")))  # type: ignore[attr-defined]

    asyncio.run(save())
    written = (tmp_path / "it" / "process_0-of-1.json").read_text()
    state = it.get_state()  # type: ignore[attr-defined]
    assert json.loads(written) == (json.loads(state) if isinstance(state, bytes) else state)
    rest = [_ids(b) for b in it]

    fresh = MAKERS[name](path)

    async def load(directory: Path) -> None:
        await (await fresh.load(directory))  # type: ignore[attr-defined]

    asyncio.run(load(tmp_path / "it"))
    assert [_ids(b) for b in fresh] == rest
    with pytest.raises(ValueError, match=r"process_0-of-1\.json does not exist"):
        asyncio.run(load(tmp_path / "nothing"))
    for x in (it, fresh):
        x.close()  # type: ignore[attr-defined]


def test_stateful_checkpointable_load_of_a_save_on_two_processes(path: str, tmp_path: Path) -> None:
    """Written by 2 processes (batch 4 each), loaded by this one (batch 8): the same step."""
    directory = tmp_path / "two"
    directory.mkdir()
    for p in range(2):
        shards = grain.sharding.ShardOptions(shard_index=p, shard_count=2, drop_remainder=True)
        it = iter(
            gr.make_data_loader(
                gr.open_source(path), batch_size=B // 2, seed=7, num_epochs=2, shard_options=shards
            )
        )
        for _ in range(3):
            next(it)
        (directory / f"process_{p}-of-2.json").write_bytes(it.get_state())
    want = [_ids(b) for b in _loader(path)][3:]
    fresh = iter(_loader(path))

    async def load() -> None:
        await (await fresh.load(directory))

    asyncio.run(load())
    assert [_ids(b) for b in fresh] == want
