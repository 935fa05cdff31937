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
from grain_replay.pipeline.state import handed_out_by_worker
from grain_replay.sources.reading.cache import share_cache_budget

__all__: list[str] = []

_ALIGN = 64  # leaf offsets inside a slot: cache-line aligned
_ROW = 512  # pipeline/lanes.py's row

# worker -> consumer: (kind, generation, element, slot, ...)
_BATCH, _PICKLED, _ERROR, _SLOT = range(4)
# consumer -> worker
_FREE, _SEEK, _STOP, _TASK, _DROP, _LANES = range(6)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a worker reads: its element ``k`` is global batch ``global_index(k)``."""

    worker: int
    workers: int
    shard_index: int
    shard_count: int
    length: int

    def local(self, k: int) -> int:
        return k * self.workers + self.worker

    def first_unread(self, handed_out: int) -> int:
        """This worker's first element not handed out after ``handed_out`` elements in all."""
        return handed_out_by_worker(handed_out, self.worker, self.workers)

    def global_index(self, k: int) -> int:
        return self.local(k) * self.shard_count + self.shard_index


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

    With ``tasked``, element ``k`` is ``read(task)`` for the task the consumer sent
    for it (``_TASK`` messages), instead of ``read(global index)``. The payload may
    carry ``read_into(global index, out) -> bool`` as a third item (no operations):
    then, once a batch showed the layout, each batch is read straight into its slot,
    laid out as the one before (no array of its own to fill and copy), and read and
    copied when ``read_into`` returns False; if it raises, never again. With ``lanes``
    (or from a ``_LANES`` message on), a batch is laid out as one packed transfer's buffer
    (``pipeline/lanes.py``); one whose elements are padded to whole rows is then read and
    copied, not read into the slot (a gather into rows that skip bytes is slower than both).
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

    def element(k: int, task: Any = None) -> Any:
        data = read(task) if tasked else read(plan.global_index(k))
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

    def read_direct(slot: int) -> bool:
        """Element ``k`` read into ``slot`` laid out as ``last_spec``; False if not read."""
        nonlocal read_into
        assert read_into is not None
        out = _views(slots.fit(slot, last_size, generation, k), last_spec)
        try:
            return bool(read_into(plan.global_index(k), out))
        except Exception:  # e.g. a layout the source's read_into refuses: read() says why
            read_into = None
            return False

    k = start
    stalled = False  # after an error: wait for a seek
    if load_error is not None:
        conn.send((_ERROR, generation, k, load_error))
        stalled = True

    def handle(msg: tuple[Any, ...]) -> bool:
        nonlocal k, generation, stalled, lanes, last_spec
        if msg[0] == _FREE:
            free.append(msg[1])
        elif msg[0] == _DROP:  # a slot given back by the consumer, not to be used again
            slots.drop(msg[1])
        elif msg[0] == _TASK:  # the pipe is ordered: a task sent before a seek is cleared by it
            tasks[msg[1]] = msg[2]
        elif msg[0] == _LANES:  # the next batch is read, laid out anew and its spec sent
            lanes, last_spec = True, None
        elif msg[0] == _SEEK:
            _, generation, k = msg
            tasks.clear()
            while pending:  # reads are pure: a running one finishes and is dropped
                pending.popleft()[1].cancel()
            stalled = load_error is not None
            if stalled:
                conn.send((_ERROR, generation, k, load_error))
        else:
            return False
        return True

    try:
        while True:
            while (
                conn.poll()
                or not free
                or stalled
                or plan.local(k) >= plan.length
                or (tasked and not pending and k not in tasks)
            ):
                if not handle(conn.recv()):
                    return
            if read_into is not None and last_spec is not None and direct:
                slot = free.pop()
                if read_direct(slot):
                    conn.send((_BATCH, generation, k, slot, None))
                    k += 1
                    continue
                free.append(slot)
            if pool is not None:  # keep read_threads reads in flight
                while len(pending) < read_threads and plan.local(k + len(pending)) < plan.length:
                    nxt = k + len(pending)
                    if tasked and nxt not in tasks:
                        break
                    pending.append((nxt, pool.submit(element, nxt, tasks.pop(nxt, None))))
            try:
                if pool is not None:
                    data = pending.popleft()[1].result()
                else:
                    data = element(k, tasks.pop(k, None))
            except Exception as e:
                conn.send((_ERROR, generation, k, _picklable(e, where)))
                stalled = True
                continue
            laid = _layout(data, lanes)
            slot = free.pop()  # a pickled batch holds a slot too: read-ahead stays bounded
            if laid is None:
                conn.send((_PICKLED, generation, k, slot, data))
                k += 1
                continue
            spec, arrays, size = laid
            buf = slots.fit(slot, size, generation, k)
            _write(buf, spec[1], arrays)
            del buf
            conn.send((_BATCH, generation, k, slot, None if spec == last_spec else spec))
            last_spec, last_size = spec, size
            direct = not any(f[4] for f in spec[1])
            k += 1
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the consumer is gone
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
