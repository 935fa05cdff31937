"""grain.DataLoader checkpoint bytes, written and read without grain (workers import this).

A loader state is grain's ``DataLoader`` iterator state (version 2), byte for byte:
per worker the global index of the last element it handed out, the worker count,
and ``repr`` of the sampler and of the data source, which grain compares on
restore. Everything here is written from that format alone, with no grain
internals: grain's iterator and ours read each other's bytes.

The data source is a :class:`~grain_replay.pipeline.batches.BatchedReads`, whose
``repr`` names the per-process batch size and the process count. That makes a
state self-describing: from one process's state, the number of global steps taken
follows, whatever process saved it. A loader over the same global stream (same
store, seed, epochs and global batch size) on another number of processes resumes
there (elastic resume); with the same number of processes grain's own checks apply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Any

from grain_replay.errors import CheckpointMismatchError

__all__ = [
    "EncodedIdentity",
    "LoaderIdentity",
    "StreamShape",
    "handed_out_by_worker",
    "handed_out_from_state",
    "loader_state_bytes",
    "stream_repr",
]

_VERSION = 2


def handed_out_by_worker(j: int, worker: int, workers: int) -> int:
    """How many of the first ``j`` elements are worker ``worker``'s (element i is i % workers's)."""
    return max(0, -(-(j - worker) // workers))


@dataclasses.dataclass(frozen=True)
class StreamShape:
    """The global stream of a loader and how it is cut between processes.

    Two loaders with equal :attr:`stream` yield the same global batches; their
    processes may differ in number (``shard_count``) and in per-process batch size.
    """

    source: str
    batch_size: int
    shuffle: bool
    seed: int
    num_epochs: int | None
    drop_remainder: bool
    batches_per_epoch: int
    shard_count: int

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.shard_count

    @property
    def stream(self) -> tuple[Any, ...]:
        """What the global stream depends on (not the process count)."""
        return (
            self.source,
            self.shuffle,
            self.seed,
            self.num_epochs,
            self.drop_remainder,
            self.global_batch_size,
        )

    def describe(self) -> str:
        return (
            f"{self.shard_count} process(es) x batch_size {self.batch_size} = global batch "
            f"{self.global_batch_size}, seed {self.seed}, shuffle {self.shuffle}, "
            f"num_epochs {self.num_epochs}, drop_remainder {self.drop_remainder}, "
            f"source {self.source}"
        )


def stream_repr(shape: StreamShape) -> str:
    """``repr`` of a ``BatchedReads``: grain validates states against it; :func:`parse` reads it."""
    return (
        f"BatchedReads(source={shape.source}, batch_size={shape.batch_size}, "
        f"shuffle={shape.shuffle}, seed={shape.seed}, num_epochs={shape.num_epochs}, "
        f"drop_remainder={shape.drop_remainder}, batches_per_epoch={shape.batches_per_epoch}, "
        f"shard_count={shape.shard_count})"
    )


# The fields after the source are ours: anchored at the end, the source may hold anything.
_STREAM_RE = re.compile(
    r"BatchedReads\(source=(?P<source>.*), batch_size=(?P<batch_size>\d+), "
    r"shuffle=(?P<shuffle>True|False), seed=(?P<seed>\d+), num_epochs=(?P<num_epochs>\d+|None), "
    r"drop_remainder=(?P<drop_remainder>True|False), batches_per_epoch=(?P<bpe>\d+), "
    r"shard_count=(?P<shard_count>\d+)\)",
    re.DOTALL,
)


def parse(text: str) -> StreamShape | None:
    """The shape named by a ``BatchedReads`` repr; None for any other data source."""
    m = _STREAM_RE.fullmatch(text)
    if m is None:
        return None
    epochs = m["num_epochs"]
    return StreamShape(
        source=m["source"],
        batch_size=int(m["batch_size"]),
        shuffle=m["shuffle"] == "True",
        seed=int(m["seed"]),
        num_epochs=None if epochs == "None" else int(epochs),
        drop_remainder=m["drop_remainder"] == "True",
        batches_per_epoch=int(m["bpe"]),
        shard_count=int(m["shard_count"]),
    )


@dataclasses.dataclass(frozen=True)
class LoaderIdentity:
    """What a loader's state names and is checked against, and where this process reads.

    ``sampler`` and ``data_source`` are the ``repr`` strings grain writes into
    the state; ``worker_count`` is the loader's (0: no worker processes).
    """

    worker_count: int
    sampler: str
    data_source: str
    shard_index: int
    shard_count: int


def _last_seen(j: int, worker: int, ident: LoaderIdentity) -> int:
    """The global index grain records as worker ``worker``'s last element after ``j`` elements."""
    if ident.worker_count == 0:
        return ident.shard_index + (j - 1) * ident.shard_count
    span = ident.worker_count * ident.shard_count
    seen = handed_out_by_worker(j, worker, ident.worker_count)
    return ident.shard_index - span + worker * ident.shard_count + seen * span


class EncodedIdentity:
    """The JSON-encoded strings of a state, computed once per iterator."""

    def __init__(self, ident: LoaderIdentity) -> None:
        self.sampler = json.dumps(ident.sampler)
        self.data_source = json.dumps(ident.data_source)


def loader_state_bytes(
    ident: LoaderIdentity, handed_out: int, encoded: EncodedIdentity | None = None
) -> bytes:
    """What ``get_state()`` of grain's own iterator of the loader returns after ``handed_out``.

    grain assigns element ``j`` of a process to worker ``j % worker_count`` and
    writes ``json.dumps(state, indent=4)``; its pure-Python indenting encoder costs
    ~30 us, paid on every batch under ``sharded_device_put``, so the same bytes are
    spelled out here (tests pin them against grain's).
    """
    enc = encoded if encoded is not None else EncodedIdentity(ident)
    workers = ident.worker_count
    seen = ",\n".join(
        f'        "{w}": {_last_seen(handed_out, w, ident)}' for w in range(max(workers, 1))
    )
    last_worker = handed_out % workers - 1 if workers else -1
    return (
        f'{{\n    "version": {_VERSION},\n    "last_seen_indices": {{\n{seen}\n    }},\n'
        f'    "last_worker_index": {last_worker},\n    "worker_count": {workers},\n'
        f'    "sampler": {enc.sampler},\n    "data_source": {enc.data_source}\n}}'
    ).encode()


def _decode(state: Any) -> dict[str, Any]:
    if isinstance(state, str):
        state = state.encode()
    if not isinstance(state, (bytes, bytearray)):
        raise CheckpointMismatchError(
            f"A loader state is the bytes get_state() returned, got {type(state).__name__}. "
            "Fix: pass the bytes get_state() returned, unchanged."
        )
    try:
        decoded = json.loads(bytes(state).decode())
        if not isinstance(decoded, dict):
            raise TypeError(f"a JSON {type(decoded).__name__}, not an object")
        seen = decoded["last_seen_indices"]
        workers = decoded["worker_count"]
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(f"worker_count {workers!r}")
        for w in range(max(workers, 1)):
            if not isinstance(seen[str(w)], int):
                raise ValueError(f"last_seen_indices[{str(w)!r}] = {seen[str(w)]!r}")
        for key in ("sampler", "data_source"):
            if not isinstance(decoded[key], str):
                raise ValueError(f"{key} {decoded[key]!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointMismatchError(
            f"This is not a grain DataLoader iterator state ({type(e).__name__}: {e}). "
            "Fix: pass the bytes get_state() returned, unchanged."
        ) from None
    return decoded


def _check_like_grain(ident: LoaderIdentity, state: dict[str, Any]) -> None:
    """grain's ``DataLoader`` checks on restore, with grain's messages."""
    if state["worker_count"] != ident.worker_count:
        raise CheckpointMismatchError(
            "Worker count in checkpoint does not match dataloader worker count.\n"
            f"worker count in checkpoint: {state['worker_count']}\n"
            f"worker count in dataloader: {ident.worker_count}"
        )
    if state["sampler"] != ident.sampler:
        raise CheckpointMismatchError(
            "Sampler in checkpoint does not match dataloader sampler.\n"
            f"sampler in checkpoint: {state['sampler']}\n"
            f"sampler in dataloader: {ident.sampler}\n"
            "Grain uses `repr(sampler)` to validate the sampler, so you "
            "may need to implement a custom `__repr__`."
        )
    if state["data_source"] != ident.data_source:
        raise CheckpointMismatchError(
            "DataSource in checkpoint does not match datasource in dataloader.\n"
            f"data source in checkpoint: {state['data_source']}\n"
            f"data source in dataloader: {ident.data_source}\n"
            "Grain uses `repr(data_source)` to validate the source, so you "
            "may need to implement a custom `__repr__`."
        )


def _steps(state: dict[str, Any], shard_count: int) -> int:
    """Elements each process had handed out when ``state`` was saved, by any one process."""
    workers = state["worker_count"]
    seen = [state["last_seen_indices"][str(w)] for w in range(max(workers, 1))]
    shard_index = seen[0] % shard_count  # the saving process's
    if workers == 0:
        return (seen[0] - shard_index) // shard_count + 1
    span = workers * shard_count
    counts = []
    for w, last in enumerate(seen):
        count, rest = divmod(last - shard_index - w * shard_count + span, span)
        counts.append(count if rest == 0 else -1)
    j = sum(counts)
    if any(c != handed_out_by_worker(j, w, workers) for w, c in enumerate(counts)):
        raise CheckpointMismatchError(
            f"The loader state's last_seen_indices {seen} are not those of {workers} workers "
            f"handing out elements in turn on {shard_count} process(es): the state was edited "
            "or belongs to another loader. Fix: pass the bytes get_state() returned, unchanged."
        )
    return j


def _elastic_mismatch(saved: StreamShape, ours: StreamShape) -> str:
    g, p = saved.global_batch_size, ours.shard_count
    if g % p:
        fix = f"its global batch of {g} does not split over {p} processes: resume on a process "
        fix += f"count that divides {g}."
    else:
        fix = f"pass batch_size={g // p} (the global batch of {g} over {p} processes) and the "
        fix += "saved run's seed, shuffle, num_epochs and drop_remainder, on the same store."
    return (
        "The checkpoint was saved on another number of processes, for another global stream.\n"
        f"saved by: {saved.describe()}\nthis loader: {ours.describe()}\n"
        f"A resume on another process count continues the same global stream. Fix: {fix}"
    )


def handed_out_from_state(ident: LoaderIdentity, state: Any) -> int:
    """How many elements this process resumes after, from a state of this stream.

    A state saved with this loader's process count must pass grain's checks (same
    worker count, sampler and source). A state saved on another number of
    processes resumes at the same global step if it names the same global stream:
    same store, shuffle, seed, num_epochs, drop_remainder and global batch size
    (per-process batch size times process count); the worker count may differ.

    Raises:
      CheckpointMismatchError: (a ``ValueError``) ``state`` is not a loader state,
        or belongs to another stream or loader.
    """
    decoded = _decode(state)
    saved, ours = parse(decoded["data_source"]), parse(ident.data_source)
    if saved is not None and ours is not None and saved.shard_count != ours.shard_count:
        if saved.stream != ours.stream:
            raise CheckpointMismatchError(_elastic_mismatch(saved, ours))
        return _steps(decoded, saved.shard_count)
    _check_like_grain(ident, decoded)
    return _steps(decoded, ident.shard_count)


def _process_file(directory: Any) -> Any:
    """Where grain's Orbax handler keeps this process's state in a checkpoint directory."""
    # Orbax's own view of the processes (it calls this module's save and restore): this
    # module imports no jax, as spawned loader workers import it.
    from orbax.checkpoint import multihost

    return directory / f"process_{multihost.process_index()}-of-{multihost.process_count()}.json"


_PROCESS_FILE_RE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def _saved_file(directory: Any) -> Any:
    """This process's state file; from a save on another process count, the one that maps to it.

    Any process's state resumes every process of the same global stream, so process
    ``i`` takes ``process_<i mod m>-of-<m>.json`` of a checkpoint written by ``m``.
    """
    own = _process_file(directory)
    if own.exists():
        return own
    names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
    counts = {int(m[2]) for m in map(_PROCESS_FILE_RE.fullmatch, names) if m is not None}
    if len(counts) != 1:
        raise CheckpointMismatchError(
            f"File {own} does not exist, and {directory} holds states of "
            f"{sorted(counts) or 'no'} process count(s). Fix: restore from the directory the "
            "iterator was saved to."
        )
    saved = counts.pop()
    from orbax.checkpoint import multihost

    return directory / f"process_{multihost.process_index() % saved}-of-{saved}.json"


async def save_text(directory: Any, text: str) -> None:
    """Writes a state into an Orbax ``PathAwaitingCreation``, named as grain's handler names it."""
    path = _process_file(await directory.await_creation())
    await asyncio.to_thread(path.write_text, text)


async def load_text(directory: Any, *, elastic: bool) -> str:
    """Reads this process's state from a checkpoint directory.

    Args:
      directory: the directory :func:`save_text` wrote into.
      elastic: a loader state, which any process's state can stand in for: a
        directory saved on another process count is read at ``i mod m``.
    """
    path = await asyncio.to_thread(_saved_file, directory) if elastic else _process_file(directory)
    if not await asyncio.to_thread(path.exists):
        raise CheckpointMismatchError(
            f"File {path} does not exist. Fix: restore from the directory the iterator "
            "was saved to, with as many processes as saved it."
        )
    return await asyncio.to_thread(path.read_text)
