"""The worker process of WorkerLoaderIterator: the slot protocol, batch layout and main loop.

Each worker owns a few anonymous shared-memory slots (``memfd``, handed over once
through the pipe), writes a whole batch into one, and sends a small tuple naming
the slot; the consumer (``pipeline/workers.py``) hands it out as views of the slot
and gives it back once they are dropped, giving another slot meanwhile (``_FREE``
of an id not seen yet: the worker makes it at its first use), and takes back
slots it no longer needs (``_DROP``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import mmap
import multiprocessing.connection
import multiprocessing.reduction
import os
import pickle
import signal
import tempfile
import traceback
from typing import Any

import cloudpickle
import numpy as np

from grain_replay import tree as tree_lib
from grain_replay.errors import GrainReplayError
from grain_replay.pipeline.lanes import lane_fields
from grain_replay.sources.reading.cache import share_cache_budget

__all__: list[str] = []

_ALIGN = 64  # leaf offsets inside a slot: cache-line aligned
_ROW = 512  # pipeline/lanes.py's row

# worker -> consumer: (kind, generation, element, slot, ...); a _GROUP message is
# (_GROUP, generation, first element, slot, spec or None, count, bytes a batch): ``count``
# batches of one layout back to back in the slot
_BATCH, _PICKLED, _ERROR, _SLOT, _GROUP = range(5)
# consumer -> worker
_FREE, _SEEK, _STOP, _TASK, _DROP, _LANES = range(6)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a worker reads: the groups of ``group`` consecutive elements of this process
    ``q`` with ``q % workers == worker`` (``group`` 1: elements ``worker``, ``worker +
    workers``, ...); element ``j`` is global batch ``global_index(j)``."""

    worker: int
    workers: int
    shard_index: int
    shard_count: int
    length: int
    group: int = 1

    def first_unread(self, handed_out: int) -> int:
        """This worker's first element at or after element ``handed_out`` (the elements
        before it were handed out): inside its group, a resume reads the group's rest."""
        q = handed_out // self.group
        if q % self.workers == self.worker:
            return handed_out
        return (q + (self.worker - q) % self.workers) * self.group

    def after(self, j: int) -> int:
        """This worker's element after its element ``j``."""
        j += 1
        return j if j % self.group else j + (self.workers - 1) * self.group

    def group_end(self, j: int) -> int:
        """The end (exclusive) of the group of element ``j``."""
        return min((j // self.group + 1) * self.group, self.length)

    def global_index(self, j: int) -> int:
        return j * self.shard_count + self.shard_index


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(batch: Any, lanes: bool = False) -> tuple[Any, list[np.ndarray], int] | None:
    """``(spec, leaves, bytes)`` of a batch of plain arrays; None if it must be pickled.

    ``spec`` is ``(treedef, fields, rows)``, a field ``(key, dtype, shape, offset,
    stride)``: ``stride`` 0 for a C-contiguous leaf, else the bytes between its elements.
    With ``lanes``, the leaves lie as one packed transfer's buffer of ``rows`` rows
    (``pipeline/lanes.py``); else ``rows`` is 0.
    """
    try:
        leaves, treedef = tree_lib.flatten(batch)
    except GrainReplayError:
        return None
    arrays, fields, offset = [], [], 0
    for leaf in leaves.values():
        if type(leaf) is not np.ndarray or leaf.dtype.hasobject:
            return None
        arrays.append(leaf)
    if lanes and all(a.ndim for a in arrays):  # a 0-d leaf has no rows to lay out
        laid, rows = lane_fields([(a.dtype, a.shape) for a in arrays])
        for key, a, f in zip(leaves, arrays, laid, strict=True):
            padded = f.per_element and a.nbytes != a.shape[0] * f.per_element * _ROW
            fields.append((key, a.dtype, a.shape, f.offset, f.per_element * _ROW if padded else 0))
        return (treedef, tuple(fields), rows), arrays, rows * _ROW
    for key, leaf in zip(leaves, arrays, strict=True):
        # The dtype itself, not its .str: bfloat16 (ml_dtypes) would come back as void.
        fields.append((key, leaf.dtype, leaf.shape, offset, 0))
        offset = _round_up(offset + leaf.nbytes)
    return (treedef, tuple(fields), 0), arrays, offset


def _write(buf: np.ndarray, fields: Any, arrays: list[np.ndarray]) -> None:
    """Copies ``arrays`` into the slot ``buf`` at their fields."""
    for (_, _, shape, offset, stride), array in zip(fields, arrays, strict=True):
        if stride:  # each element on rows of its own
            n = shape[0]
            data = np.ascontiguousarray(array).reshape(n, -1).view(np.uint8)
            buf[offset : offset + n * stride].reshape(n, stride)[:, : data.shape[1]] = data
        else:
            buf[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)


def _new_slot(size: int) -> tuple[int, mmap.mmap]:
    """An anonymous shared file of ``size`` bytes and its map; the fd travels to the consumer."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("grain_replay_batch", os.MFD_CLOEXEC)
    else:  # macOS: an unlinked temporary file
        fd, name = tempfile.mkstemp(prefix="grain_replay_batch_")
        os.unlink(name)
    os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size)


class _SlotMaps:
    """The worker's side of its slots: their maps, grown (and sent again) when too small."""

    def __init__(self, conn: multiprocessing.connection.Connection):
        self.conn = conn
        self.maps: dict[int, mmap.mmap] = {}

    def fit(self, slot: int, size: int, generation: int, k: int) -> np.ndarray:
        """``slot`` as bytes, at least ``size`` of them (a new map, sent first, if smaller)."""
        maps = self.maps
        if slot not in maps or len(maps[slot]) < size:
            if slot in maps:
                # Arrays a read_into kept still view it: it is unmapped with the last of them.
                with contextlib.suppress(BufferError):
                    maps[slot].close()
            fd, maps[slot] = _new_slot(max(size, _ALIGN) + size // 4)
            self.conn.send((_SLOT, generation, k, slot, len(maps[slot])))
            multiprocessing.reduction.send_handle(self.conn, fd, os.getppid())
            os.close(fd)
        return np.frombuffer(maps[slot], np.uint8)

    def drop(self, slot: int) -> None:
        dropped = self.maps.pop(slot, None)
        if dropped is not None:
            with contextlib.suppress(BufferError):
                dropped.close()


def _views(buf: np.ndarray, spec: Any) -> dict[str, np.ndarray]:
    """The leaves of layout ``spec`` as arrays over the slot ``buf``."""
    out = {}
    for key, dtype, shape, offset, stride in spec[1]:
        if stride:
            n = shape[0]
            element = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            rows = buf[offset : offset + n * stride].reshape(n, stride)[:, :element]
            out[key] = rows.view(dtype).reshape(shape)
            continue
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[key] = buf[offset : offset + n].view(dtype).reshape(shape)
    return out


def _picklable(error: BaseException, where: str) -> BaseException:
    """``error`` with the worker's traceback as a note, or a RuntimeError that says it all."""
    text = "".join(traceback.format_exception(error))
    try:
        error.add_note(f"Raised in {where}:\n{text}")
        pickle.dumps(error)
        return error
    except Exception:  # an exception that does not pickle: keep its text
        return RuntimeError(f"{type(error).__name__} raised in {where} (unpicklable):\n{text}")


def _worker_main(
    conn: multiprocessing.connection.Connection,
    payload: bytes,
    plan: _Plan,
    slot_count: int,
    read_threads: int,
    generation: int,
    start: int,
    tasked: bool = False,
    lanes: bool = False,
) -> None:
    """A worker: reads its elements into free slots until told to stop or the pipe closes.

    With ``tasked``, element ``j`` is ``read(task)`` for the task the consumer sent
    for it (``_TASK`` messages), instead of ``read(global index)``. The payload may
    carry ``read_into(global index, out) -> bool`` as a third item (no operations):
    then, once a batch showed the layout, each batch is read straight into its slot,
    laid out as the one before (no array of its own to fill and copy), and read and
    copied when ``read_into`` returns False; if it raises, never again. With ``lanes``
    (or from a ``_LANES`` message on), a batch is laid out as one packed transfer's buffer
    (``pipeline/lanes.py``); one whose elements are padded to whole rows is then read and
    copied, not read into the slot (a gather into rows that skip bytes is slower than both).

    With ``plan.group`` above 1 (set by a ``_SEEK``), the batches of one group go back to
    back into one slot, sent as one ``_GROUP`` message (never laid out in lanes); a batch
    of another layout (a short last batch, one that must be pickled) ends the message
    early and starts the next, and a read error ends it and follows it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    where = f"grain_replay loader worker {plan.worker} (pid {os.getpid()})"
    share_cache_budget(plan.workers)  # the workers split the default cache's memory
    load_error: BaseException | None = None
    read_into = None
    try:
        read, maps, *rest = cloudpickle.loads(payload)
        read_into = rest[0] if rest and not maps and not tasked and read_threads <= 0 else None
    except Exception as e:  # every element fails with it, again after each seek
        load_error = _picklable(e, where)
        read, maps = None, ()

    tasks: dict[int, Any] = {}

    def element(j: int, task: Any = None) -> Any:
        data = read(task) if tasked else read(plan.global_index(j))
        for op in maps:
            data = op.map(data)
        return data

    pool = concurrent.futures.ThreadPoolExecutor(read_threads) if read_threads > 0 else None
    pending: collections.deque[tuple[int, concurrent.futures.Future[Any]]] = collections.deque()
    free = list(range(slot_count))
    slots = _SlotMaps(conn)
    last_spec: Any = None
    last_size = 0
    direct = False  # last_spec's leaves are contiguous: read_into may fill them
    carry: tuple[int, Any] | None = None  # an element read that did not join its group

    def read_direct(out: dict[str, np.ndarray]) -> bool:
        """Element ``j`` read into ``out`` (views of a slot); False if not read."""
        nonlocal read_into
        assert read_into is not None
        try:
            return bool(read_into(plan.global_index(j), out))
        except Exception:  # e.g. a layout the source's read_into refuses: read() says why
            read_into = None
            return False

    def next_data() -> Any:
        """Element ``j``'s batch (its read error raised), read ahead on the pool if any."""
        nonlocal carry
        if carry is not None and carry[0] == j:
            data, carry = carry[1], None
            return data
        if pool is None:
            return element(j, tasks.pop(j, None))
        while len(pending) < read_threads:  # keep read_threads reads in flight
            nxt = plan.after(pending[-1][0]) if pending else j
            if nxt >= plan.length or (tasked and nxt not in tasks):
                break
            pending.append((nxt, pool.submit(element, nxt, tasks.pop(nxt, None))))
        return pending.popleft()[1].result()

    j = start
    stalled = False  # after an error: wait for a seek
    if load_error is not None:
        conn.send((_ERROR, generation, j, load_error))
        stalled = True

    def handle(msg: tuple[Any, ...]) -> bool:
        nonlocal j, generation, stalled, lanes, last_spec, plan, carry
        if msg[0] == _FREE:
            free.append(msg[1])
        elif msg[0] == _DROP:  # a slot given back by the consumer, not to be used again
            slots.drop(msg[1])
        elif msg[0] == _TASK:  # the pipe is ordered: a task sent before a seek is cleared by it
            tasks[msg[1]] = msg[2]
        elif msg[0] == _LANES:  # the next batch is read, laid out anew and its spec sent
            lanes, last_spec = True, None
        elif msg[0] == _SEEK:
            _, generation, j, group = msg
            if group != plan.group:
                plan = dataclasses.replace(plan, group=group)
            tasks.clear()
            carry = None
            while pending:  # reads are pure: a running one finishes and is dropped
                pending.popleft()[1].cancel()
            stalled = load_error is not None
            if stalled:
                conn.send((_ERROR, generation, j, load_error))
        else:
            return False
        return True

    def send_group() -> None:
        """Reads the rest of element ``j``'s group into a free slot and sends it."""
        nonlocal j, stalled, last_spec, last_size, direct, carry
        first, end, slot = j, plan.group_end(j), free.pop()
        spec: Any = None
        size = n = 0
        buf: np.ndarray | None = None
        error: BaseException | None = None
        while j < end:
            if read_into is not None and direct and carry is None and spec in (None, last_spec):
                if buf is None:
                    buf = slots.fit(slot, (end - first) * last_size, generation, first)
                if read_direct(_views(buf[n * last_size :], last_spec)):
                    spec, size, n, j = last_spec, last_size, n + 1, j + 1
                    continue
                if n == 0:
                    buf = None  # fitted to the batch read next
            try:
                data = next_data()
            except Exception as e:
                error = e
                break
            laid = _layout(data)
            if laid is None and n == 0:  # alone, pickled; it holds the slot
                buf = None
                conn.send((_PICKLED, generation, j, slot, data))
                j = plan.after(j)
                return
            if laid is None or (spec is not None and laid[0] != spec):
                carry = (j, data)  # the first of the next message
                break
            if spec is None:
                spec, size = laid[0], laid[2]
            if buf is None:
                buf = slots.fit(slot, (end - first) * size, generation, first)
            _write(buf[n * size :], spec[1], laid[1])
            n, j = n + 1, j + 1
        buf = None
        if n:
            conn.send(
                (_GROUP, generation, first, slot, None if spec == last_spec else spec, n, size)
            )
            last_spec, last_size = spec, size
            direct = not any(f[4] for f in spec[1])
        else:
            free.append(slot)
        if error is not None:
            conn.send((_ERROR, generation, j, _picklable(error, where)))
            stalled = True
        elif j == end:
            j = plan.after(end - 1)

    try:
        while True:
            while (
                conn.poll()
                or not free
                or stalled
                or j >= plan.length
                or (tasked and not pending and j not in tasks)
            ):
                if not handle(conn.recv()):
                    return
            if plan.group > 1:
                send_group()
                continue
            if read_into is not None and last_spec is not None and direct:
                slot = free.pop()
                buf = slots.fit(slot, last_size, generation, j)
                done = read_direct(_views(buf, last_spec))
                del buf
                if done:
                    conn.send((_BATCH, generation, j, slot, None))
                    j = plan.after(j)
                    continue
                free.append(slot)
            try:
                data = next_data()
            except Exception as e:
                conn.send((_ERROR, generation, j, _picklable(e, where)))
                stalled = True
                continue
            laid = _layout(data, lanes)
            slot = free.pop()  # a pickled batch holds a slot too: read-ahead stays bounded
            if laid is None:
                conn.send((_PICKLED, generation, j, slot, data))
                j = plan.after(j)
                continue
            spec, arrays, size = laid
            buf = slots.fit(slot, size, generation, j)
            _write(buf, spec[1], arrays)
            del buf
            conn.send((_BATCH, generation, j, slot, None if spec == last_spec else spec))
            last_spec, last_size = spec, size
            direct = not any(f[4] for f in spec[1])
            j = plan.after(j)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the consumer is gone
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
