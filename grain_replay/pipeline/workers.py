"""The worker_count > 0 iterator of make_data_loader: batches cross processes in shared memory.

grain's worker path moves every leaf of every element through a shared-memory
file of its own and a pickling queue with a reader thread: ~0.7 ms of the
consuming process's CPU per batch of transitions, ten times the read itself.
Here each worker owns a few anonymous shared-memory slots (``memfd``, handed
over once through the pipe), writes a whole batch into one, and sends a small
tuple naming the slot; the consumer hands the batch out as arrays viewing the
slot and gives the worker another slot meanwhile (``pipeline/slots.py``: the
slot is reused only once the user dropped every view of it). Asked to
(``hand_over(group)``, by ``sharded_device_put`` moving several batches a transfer), a
worker writes ``group`` consecutive batches into one slot and sends one message for
them: the receive, the views and the slot given back are paid once a group. The stream,
the operations and the checkpoint bytes are those of grain's own iterator with the
same ``worker_count``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import cloudpickle
import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import ArgumentTypeError, InvalidArgumentError, WorkerDiedError
from grain_replay.pipeline import shutdown
from grain_replay.pipeline.grain_iterator import GrainStateIterator
from grain_replay.pipeline.lanes import LaneField, lane_fields
from grain_replay.pipeline.slots import Field, Slots
from grain_replay.pipeline.spawn_check import GUARD_FIX, main_guard_missing, start_process
from grain_replay.pipeline.state import LoaderIdentity
from grain_replay.pipeline.worker_main import (
    _BATCH,
    _DROP,
    _ERROR,
    _FREE,
    _GROUP,
    _LANES,
    _PICKLED,
    _SEEK,
    _SLOT,
    _STOP,
    _TASK,
    _Plan,
    _worker_main,
)

__all__ = ["TASK_NOT_READY", "WorkerLoaderIterator"]

# What a task function returns for an element it cannot give yet (see WorkerLoaderIterator).
TASK_NOT_READY: object = object()

_JOIN_S = 5.0  # how long close() waits for a worker before killing it


class _Worker:
    """The consumer's side of one worker: its process, pipe, slot maps and last layout."""

    def __init__(
        self, process: Any, conn: multiprocessing.connection.Connection, slot_count: int
    ) -> None:
        self.process = process
        self.conn = conn
        self.slots = Slots(slot_count)
        self.spec: Any = None
        self.fields: list[Field] = []
        self.unpack: Callable[[dict[str, Any]], Any] | None = None
        self.lanes: tuple[int, list[LaneField]] | None = None  # a batch laid out in lanes
        self.heard = False  # any message received: the worker got past its start-up

    def set_spec(self, spec: Any) -> None:
        self.spec = spec
        self.fields = [
            (key, np.dtype(dtype), shape, int(np.prod(shape, dtype=np.int64)), offset, stride)
            for key, dtype, shape, offset, stride in spec[1]
        ]
        self.unpack = tree_lib.compile_unflatten(spec[0])
        rows = spec[2]
        laid = [(np.dtype(dtype), shape) for _, dtype, shape, _, _ in spec[1]]
        self.lanes = (rows, lane_fields(laid)[0]) if rows else None


def _tell(w: _Worker, msg: tuple[Any, ...]) -> None:
    """Sends ``msg`` to a worker; one that died meanwhile is reported by the next receive
    from it (``WorkerDiedError``, and new workers at the next call), not here."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        w.conn.send(msg)


def _give_back(w: _Worker, slot: int, kind: int = _FREE) -> None:
    """Gives (or with ``_DROP``, takes) a slot to its worker."""
    # A batch it wrote before dying is still whole in the slot and is handed out.
    _tell(w, (kind, slot))


def _shutdown(workers: list[_Worker]) -> None:
    """Stops the workers (ask, wait, then kill) and unmaps their slots; safe to call twice."""
    for w in workers:
        with contextlib.suppress(OSError, ValueError):
            w.conn.send((_STOP,))
    deadline = time.monotonic() + _JOIN_S  # one wait for all, not one per worker
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
        if w.process.is_alive():  # busy in a long read, or hung: it would only be waited for
            w.process.kill()
            w.process.join(_JOIN_S)
        w.conn.close()
        w.slots.close()  # batches the user holds stay valid: their slots stay mapped
    workers.clear()


class _Pool:
    """Started workers, all at one generation; stale messages are dropped by generation.

    Registered with :mod:`grain_replay.pipeline.shutdown` while the workers run: they are
    stopped at interpreter exit (ask, wait, kill) if nobody closed the iterator.
    """

    def __init__(
        self,
        payload: bytes,
        plans: Sequence[_Plan],
        slot_count: int,
        read_threads: int,
        handed_out: int,
        tasked: bool = False,
        lanes: bool = False,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.generation = 0
        self.group = plans[0].group if plans else 1
        # the batches of a group received and not handed out yet, and the element of the first
        self.ready: collections.deque[Any] = collections.deque()
        self.ready_at = 0
        self.sent = handed_out  # tasked: the first element whose task is not sent yet
        self.broken = False
        self.workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)
        shutdown.register(self, _Pool.close)
        for plan in plans:
            ours, theirs = ctx.Pipe(duplex=True)
            start = plan.first_unread(handed_out)
            process = ctx.Process(
                target=_worker_main,
                args=(theirs, payload, plan, slot_count, read_threads, 0, start, tasked, lanes),
                name=f"grain_replay_loader_worker_{plan.worker}",
                daemon=True,
            )
            start_process(process)
            theirs.close()
            self.workers.append(_Worker(process, ours, slot_count))

    def lay_out_lanes(self) -> None:
        for w in self.workers:
            _tell(w, (_LANES,))

    def seek(self, handed_out: int, plans: Sequence[_Plan]) -> None:
        self.generation += 1
        self.broken = False
        self.sent = handed_out
        self.group = plans[0].group
        self.ready.clear()  # their slot goes back once nothing else views it
        for w, plan in zip(self.workers, plans):
            # past a dead worker too: the others must hear it, or their messages stay stale
            _tell(w, (_SEEK, self.generation, plan.first_unread(handed_out), plan.group))

    def next_batch(self, j: int) -> Any:
        """Element ``j``: the next of a group received, or received from its worker.

        Anything raised here but a worker's reported error (a Ctrl-C while a message, its
        fd or a group was half taken) closes the pool: the pipe may be mid-message and the
        group taken is lost, so the next call starts new workers at element ``j``.
        """
        try:
            if self.ready:
                if self.ready_at == j:
                    self.ready_at += 1
                    return self.ready.popleft()
                self.ready.clear()  # not the next one (a broken order): received again
            return self.receive((j // self.group) % len(self.workers), j)
        except BaseException:
            if not self.broken:  # broken: a worker's error, the next call seeks back to j
                self.close()
            raise

    def receive(self, index: int, k: int) -> Any:
        w = self.workers[index]
        while True:
            msg = self._recv(index, w)
            kind, generation, element = msg[0], msg[1], msg[2]
            if kind == _SLOT:  # a new or larger slot: its fd follows the message
                fd = self._recv_fd(index, w)
                try:
                    w.slots.add_map(msg[3], fd, msg[4])
                finally:
                    os.close(fd)
                continue
            if kind in (_BATCH, _GROUP) and msg[4] is not None:
                w.set_spec(msg[4])
            if generation != self.generation:
                if kind in (_BATCH, _PICKLED, _GROUP):
                    _give_back(w, msg[3])
                continue
            if element != k:  # a broken protocol, not a user error
                raise RuntimeError(f"worker {index} sent element {element}, expected {k}")
            if kind == _ERROR:
                self.broken = True  # the next call seeks back to the failed batch
                raise msg[3]
            if kind == _PICKLED:
                _give_back(w, msg[3])
                return msg[4]
            if kind == _GROUP:
                return self._unpack_group(w, msg[3], msg[5], msg[6], k)
            return self._unpack(w, msg[3])

    def _unpack(self, w: _Worker, slot: int) -> Any:
        for s in w.slots.collect():  # released beyond what is kept for reuse
            _give_back(w, s, _DROP)
        leaves, give = w.slots.take(slot, w.fields, w.lanes)
        for s in give:  # the worker keeps its slot_count slots to read ahead into
            _give_back(w, s)
        assert w.unpack is not None
        return w.unpack(leaves)

    def _unpack_group(self, w: _Worker, slot: int, count: int, size: int, k: int) -> Any:
        """The first batch of a group; the others wait in :attr:`ready` (one lease: the
        slot goes back once every batch of it is dropped)."""
        for s in w.slots.collect():
            _give_back(w, s, _DROP)
        groups, give = w.slots.take_group(slot, w.fields, size, count)
        for s in give:
            _give_back(w, s)
        unpack = w.unpack
        assert unpack is not None
        self.ready.extend(unpack(leaves) for leaves in groups[1:])
        self.ready_at = k + 1
        return unpack(groups[0])

    def _recv(self, index: int, w: _Worker) -> tuple[Any, ...]:
        try:
            # poll() first: wait() builds a selector per call, 20 us a batch.
            if w.conn.poll() or w.conn in multiprocessing.connection.wait(
                [w.conn, w.process.sentinel]
            ):
                msg = w.conn.recv()
                w.heard = True
                return msg
        except (EOFError, ConnectionResetError):
            pass
        self._died(index, w)

    def _recv_fd(self, index: int, w: _Worker) -> int:
        """The fd that follows a ``_SLOT`` message; a worker killed between the two died."""
        try:
            return multiprocessing.reduction.recv_handle(w.conn)
        except (EOFError, ConnectionResetError):
            self._died(index, w)

    def _died(self, index: int, w: _Worker) -> NoReturn:
        w.process.join(_JOIN_S)
        self.close()
        if not w.heard and w.process.exitcode == 1 and main_guard_missing():
            raise WorkerDiedError(
                f"grain_replay loader worker {index} (pid {w.process.pid}) exited with code 1 "
                'while starting: the main script has no `if __name__ == "__main__":` guard, '
                "so each spawned worker ran the script's loader again. " + GUARD_FIX
            )
        raise WorkerDiedError(
            f"grain_replay loader worker {index} (pid {w.process.pid}) was terminated "
            f"unexpectedly with exit code {w.process.exitcode}. A negative code is the "
            "signal that killed it (-9: SIGKILL, often the kernel's out-of-memory killer). "
            "The next call to next() starts new workers at the same batch."
        )

    def close(self) -> None:
        shutdown.unregister(self)
        self.ready.clear()
        self._finalizer()


class WorkerLoaderIterator(GrainStateIterator):
    """Reads global batches in ``worker_count`` spawned processes, in grain's order.

    Element ``j`` of this process is global batch ``j * shard_count + shard_index``,
    read and mapped by worker ``j % worker_count`` (as grain assigns it), which keeps
    up to ``buffer_size`` finished batches in shared memory ahead of the consumer.
    ``get_state`` returns the bytes grain's iterator would; the state counts only
    batches handed out, so a checkpoint moves between the two iterators.

    With ``task``, element ``j`` is ``read(task(j))`` instead: ``task`` runs here, in
    the consuming process, in order of ``j``, at most ``worker_count * buffer_size``
    elements ahead of the element handed out (``task(j)`` for ``j < handed out +
    worker_count * buffer_size``); a seek or a restart asks for the tasks of the
    elements not handed out again, so ``task`` must return the same for the same ``j``.
    ``task`` may return :data:`TASK_NOT_READY` for an element ahead of the one handed
    out next (sending stops there until the next element is asked for).

    With ``read_into(j, out) -> bool`` (no ``maps``, no ``task``, no ``read_threads``:
    ``read(j)`` written into ``out``, leaf key -> array, or False when it cannot), a
    worker reads each batch after its first straight into its shared-memory slot.
    """

    def __init__(
        self,
        identity: LoaderIdentity,
        read: Callable[[int], Any],
        *,
        length: int,
        maps: Sequence[Any] = (),
        buffer_size: int = 2,
        read_threads: int = 0,
        task: Callable[[int], Any] | None = None,
        read_into: Callable[[int, dict[str, np.ndarray]], bool] | None = None,
    ) -> None:
        super().__init__(identity, length=length)
        worker_count, shard_index, shard_count = (
            identity.worker_count,
            identity.shard_index,
            identity.shard_count,
        )
        if worker_count <= 0:
            raise ValueError(f"worker_count must be positive, got {worker_count}")
        try:  # fail here, not in the workers
            self._payload = cloudpickle.dumps((read, tuple(maps), read_into))
        except Exception as e:
            raise ArgumentTypeError(
                f"make_data_loader(worker_count={worker_count}) sends the source and the "
                f"operations to worker processes, but they do not pickle: {e}. Fix: give "
                "them __getstate__/__setstate__ that drop handles and locks (as grain_replay's "
                "sources do), or use worker_count=0."
            ) from e
        self._plans = [
            _Plan(w, worker_count, shard_index, shard_count, length) for w in range(worker_count)
        ]
        self._slots = max(1, int(buffer_size))
        self._read_threads = max(0, int(read_threads))
        self._task = task
        self._lanes = False
        self._pool: _Pool | None = None

    def _ready_pool(self) -> _Pool:
        pool = self._pool
        if pool is None or not pool.workers:
            pool = self._pool = _Pool(
                self._payload,
                self._plans,
                self._slots,
                self._read_threads,
                self._next_index,
                tasked=self._task is not None,
                lanes=self._lanes,
            )
        elif pool.broken:
            pool.seek(self._next_index, self._plans)
        if self._task is not None:
            limit = min(self._next_index + self._worker_count * self._slots, self._length)
            while pool.sent < limit:
                j = pool.sent
                payload = self._task(j)
                if payload is TASK_NOT_READY:
                    break  # not drawn yet (a rate limit); asked again at the next element
                _tell(pool.workers[j % self._worker_count], (_TASK, j, payload))
                pool.sent = j + 1
        return pool

    def __next__(self) -> Any:
        j = self._next_index
        if j >= self._length:
            self.close()  # nothing left to read; set_state() starts workers again
            raise StopIteration
        batch = self._ready_pool().next_batch(j)
        self._next_index = j + 1
        return batch

    def lay_out_lanes(self) -> None:
        """From now on, hand out batches whose leaves lie in their slot as one packed
        transfer's buffer (``pipeline/lanes.py``): ``sharded_device_put`` then puts the
        slot's bytes as they are. Batches the workers wrote before keep their layout."""
        self._lanes = True
        if self._plans[0].group > 1:  # a laid-out batch is put alone: one a hand-over
            self._plans = [dataclasses.replace(p, group=1) for p in self._plans]
            self._seek()
        if self._pool is not None and self._pool.workers:
            self._pool.lay_out_lanes()

    def hand_over(self, group: int) -> None:
        """From now on, hand batches over from the workers ``group`` at a time: a worker
        reads ``group`` consecutive batches into one slot and sends one message, and the
        next ``group - 1`` calls of ``next()`` take the batches received (``1``: one a
        batch, the default). The stream and the checkpoint bytes are unchanged; workers
        running drop what they read ahead. A loader with tasks (replay sampling), or asked
        to :meth:`lay_out_lanes` (whose batches go one a transfer), keeps 1.

        Raises:
          InvalidArgumentError: ``group`` is not a positive int.
        """
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise InvalidArgumentError(
                f"hand_over(group) takes the batches a hand-over as a positive int, got "
                f"{group!r}. Fix: pass an int >= 1 (1: one batch a hand-over)."
            )
        if self._task is not None or self._lanes or group == self._plans[0].group:
            return
        self._plans = [dataclasses.replace(p, group=group) for p in self._plans]
        if self._pool is not None and self._pool.workers:
            self._pool.seek(self._next_index, self._plans)

    def _seek(self) -> None:
        if self._pool is not None and self._pool.workers:
            self._pool.seek(self._next_index, self._plans)

    def start_prefetch(self) -> None:
        """Starts the workers, which begin reading the next batches."""
        self._ready_pool()

    def close(self) -> None:
        """Stops the workers and drops the batches they read ahead; the position is kept."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
