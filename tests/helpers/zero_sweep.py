"""Zeroed byte ranges over stores written by ``gr.write``, each opened and read under a watchdog.

``write_stores(root)`` writes the pristine stores (HDF5 plain, gzip and nested;
Zarr plain and zstd; ``.npy``). ``sweep_cases(root, dense)`` lists the cases: a
window of bytes zeroed in one file of one store (every file of a store, its first
64 KiB). ``run_sweep(root, cases)`` opens each case with ``gr.open_source`` and
reads every row, in a few child processes; it returns each case's outcome:

``same``      read back with the written values (the bytes were unused)
``differs``   read back, other values (allowed only where the window hits data bytes)
``named``     a ``gr.GrainReplayError`` (its type and message are kept)
``raw``       any other exception: a bug
``hang``      no answer: the child spun ``CPU_LIMIT_S`` of CPU (``KNOWN_HANG_CPU_S`` on a
              case ``known_hang`` predicts; or ``WALL_LIMIT_S``) on the case and was
              killed; a fresh child takes the remaining cases
``crash``     the child died (signal or exit code)

A hang is watched from the parent: the HDF5 C library spins holding the GIL, so
no thread of the child could notice. The parent reads the child's CPU time from
``/proc`` (wall time where there is none), so a loaded machine does not pass for
a hang.

Known hangs (``known_hang``): the HDF5 C library (2.0, and 1.x before it) loops
forever parsing a global heap collection ("GCOL", where h5py keeps the
variable-length string of the metadata attribute) whose object header reads index
0 (free space) with size 0: the loop never advances. Zeroing the 16-byte header of
the free-space object after the metadata string, or of the string object itself
(index and size), while the collection's own header stays intact, hangs
``h5py.File(p).attrs["grain_replay"]``, plain h5py included. SECURITY.md
documents it. Nothing else may hang.

Run ``python tests/helpers/zero_sweep.py [--dense]`` for a summary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

N = 64
SWEPT_BYTES = 64 << 10
# A case spinning this much CPU (or waiting this long) is a hang; a normal one takes ~10 ms.
CPU_LIMIT_S = 2.0
# A case known_hang predicts: the loop it spins in never ends, so half a second of CPU
# tells it (a predicted case that no longer hangs answers in ~10 ms, as any other: the
# child opens each pristine store once first, so no import counts against a case).
KNOWN_HANG_CPU_S = 0.5
WALL_LIMIT_S = 30.0
# Where a child spends its first seconds: importing, before any case starts.
START_LIMIT_S = 120.0

# The windows over each file's first 64 KiB. Fast: 32 bytes at a time over the first KiB
# (headers, JSON), then 512-byte windows every 256 bytes, coarser past 64 windows (a
# Zarr chunk of 1 MiB is all data: 1 KiB windows). Dense (the slow variant): 64-byte
# windows every 16 bytes everywhere.
HEAD = 1024
TAIL_WINDOWS = 64


def base_tree(n: int = N) -> dict[str, Any]:
    return {
        "obs": np.repeat(np.arange(n, dtype=np.float32)[:, None], 4, axis=1),
        "act": np.arange(n, dtype=np.int64),
    }


def nested_tree(n: int = N) -> dict[str, Any]:
    r = np.arange(n)
    return {
        "obs": {
            "pixels": (r[:, None, None, None] + np.zeros((1, 8, 8, 3), np.int64)).astype(np.uint8),
            "vec": np.repeat(r[:, None].astype(np.float32), 17, axis=1),
        },
        "act": r.astype(np.int64),
        "rew": r.astype(np.float32) / 2,
        "done": r % 7 == 0,
    }


# name -> (the store's file name, tree, gr.write keyword arguments)
STORES: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "hdf5": ("store.h5", base_tree, {}),
    "hdf5_gzip": ("store.h5", base_tree, {"compression": "gzip"}),
    "hdf5_nested": ("store.h5", nested_tree, {}),
    "zarr": ("store.zarr", base_tree, {}),
    "zarr_zstd": ("store.zarr", nested_tree, {"compression": "zstd"}),
    "npy": ("store", nested_tree, {"format": "npy"}),
}


@dataclasses.dataclass(frozen=True)
class Case:
    store: str  # a key of STORES
    file: str  # relative to the store ("" for a single-file store)
    offset: int
    length: int

    @property
    def name(self) -> str:
        return f"{self.store}:{self.file or '.'}@{self.offset}+{self.length}"


def store_path(root: str, store: str) -> str:
    return os.path.join(root, store, STORES[store][0])


def write_stores(root: str) -> None:
    """Writes every pristine store under ``root`` (with gr.write)."""
    import grain_replay as gr

    for name, (file, tree, kwargs) in STORES.items():
        os.makedirs(os.path.join(root, name), exist_ok=True)
        gr.write(os.path.join(root, name, file), tree(), **kwargs)


def _files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [""]
    found = [
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    ]  # fmt: skip
    return sorted(found)


def sweep_cases(root: str, dense: bool = False) -> list[Case]:
    """Every window of every file of every pristine store under ``root``."""
    cases = []
    for store in STORES:
        path = store_path(root, store)
        for rel in _files(path):
            size = min(os.path.getsize(os.path.join(path, rel) if rel else path), SWEPT_BYTES)
            for off, length in _windows(size, dense):
                cases.append(Case(store, rel, off, length))
    return cases


def _windows(size: int, dense: bool) -> list[tuple[int, int]]:
    if dense:
        plan = [(0, size, 64, 16)]
    else:
        stride = max(256, -(-(size - HEAD) // TAIL_WINDOWS // 256) * 256)
        plan = [(0, HEAD, 32, 32), (HEAD, size, max(512, stride), stride)]
    spans = {
        (off, min(w, size - off))
        for lo, hi, w, step in plan
        for off in range(lo, min(hi, size), step)
    }
    return sorted(spans)


# -- what the bytes are: data (zeroing may change values) and HDF5's global heap ---------


def data_ranges(root: str, store: str) -> dict[str, list[tuple[int, int]]]:
    """``{file: [(start, stop), ...]}``: the bytes holding array values."""
    path = store_path(root, store)
    if store.startswith("hdf5"):
        import h5py

        spans: list[tuple[int, int]] = []
        with h5py.File(path, "r") as f:

            def visit(_: str, d: Any) -> None:
                if not isinstance(d, h5py.Dataset):
                    return
                if d.chunks is None:
                    off = d.id.get_offset()
                    if off is not None:
                        spans.append((int(off), int(off) + int(d.id.get_storage_size())))
                    return
                for i in range(d.id.get_num_chunks()):
                    info = d.id.get_chunk_info(i)
                    spans.append((int(info.byte_offset), int(info.byte_offset + info.size)))

            f.visititems(visit)
        return {"": spans}
    out = {}
    for rel in _files(path):
        full = os.path.join(path, rel)
        if store.startswith("zarr") and f"{os.sep}c{os.sep}" in f"{os.sep}{rel}":
            out[rel] = [(0, os.path.getsize(full))]
        elif rel.endswith(".npy"):
            with open(full, "rb") as fh:
                np.lib.format.read_magic(fh)
                np.lib.format.read_array_header_1_0(fh)
                out[rel] = [(fh.tell(), os.path.getsize(full))]
    return out


def heap_object_headers(path: str) -> list[tuple[int, int, int]]:
    """``(collection, header offset, index)`` of every object of every global heap
    collection ("GCOL") in the HDF5 file, in file order, up to its free space."""
    with open(path, "rb") as f:
        data = f.read()
    out = []
    pos = data.find(b"GCOL")
    while pos >= 0:
        end = pos + int.from_bytes(data[pos + 8 : pos + 16], "little")
        p = pos + 16
        while p + 16 <= min(end, len(data)):
            index = int.from_bytes(data[p : p + 2], "little")
            out.append((pos, p, index))
            if index == 0:  # free space: the rest of the collection
                break
            p += 16 + -(-int.from_bytes(data[p + 8 : p + 16], "little") // 8) * 8
        pos = data.find(b"GCOL", pos + 4)
    return out


def known_hang(case: Case, headers: list[tuple[int, int, int]]) -> bool:
    """Whether zeroing ``case``'s window hangs HDF5: see the module docstring."""
    lo, hi = case.offset, case.offset + case.length
    for gcol, h, index in headers:
        if lo < gcol + 16 and hi > gcol:
            return False  # the collection's header is hit: HDF5 refuses the collection
        if lo < h + 16 and hi > h:  # the first object header the window touches decides
            zero_index = index == 0 or (lo <= h and hi >= h + 2)
            return zero_index and lo <= h + 8 and hi >= h + 16
    return False


def allowed_to_differ(case: Case, ranges: dict[str, list[tuple[int, int]]]) -> bool:
    lo, hi = case.offset, case.offset + case.length
    return any(lo < b and hi > a for a, b in ranges.get(case.file, []))


# -- the child: one case after another -----------------------------------------------------


def _probe(path: str, expect: dict[str, np.ndarray]) -> dict[str, Any]:
    import grain_replay as gr

    try:
        src = gr.open_source(path)
        try:
            got = src.read_flat(np.arange(len(src)))
        finally:
            src.close()
    except gr.GrainReplayError as e:
        return {"outcome": "named", "error": type(e).__name__, "message": str(e)[:1500]}
    except BaseException as e:
        return {"outcome": "raw", "error": type(e).__name__, "message": str(e)[:1500]}
    same = set(got) == set(expect) and all(
        np.asarray(got[k]).shape == expect[k].shape and np.array_equal(got[k], expect[k])
        for k in expect
    )
    return {"outcome": "same" if same else "differs"}


def _child_main(spec_file: str) -> None:
    from grain_replay import tree as tree_lib

    with open(spec_file) as f:
        spec = json.load(f)
    root, cases = spec["root"], [Case(**c) for c in spec["cases"]]
    expect = {s: tree_lib.flatten(STORES[s][1]())[0] for s in STORES}
    for store in {c.store for c in cases}:  # the formats' libraries imported before a case
        _probe(store_path(root, store), expect[store])
    scratch = tempfile.mkdtemp(prefix="sweep-", dir=spec["scratch"])
    copies: dict[str, str] = {}
    for i, case in enumerate(cases):
        if case.store not in copies:  # this child's own copy, zeroed and restored in place
            copies[case.store] = os.path.join(scratch, case.store)
            shutil.copytree(os.path.join(root, case.store), copies[case.store])
        # A fresh path per case (hard links to the copy): no cache keyed by path carries over.
        where = os.path.join(scratch, f"case{i}")
        shutil.copytree(copies[case.store], where, copy_function=os.link)
        path = os.path.join(where, STORES[case.store][0])
        victim = os.path.join(path, case.file) if case.file else path
        with open(victim, "r+b") as f:
            f.seek(case.offset)
            saved = f.read(case.length)
            f.seek(case.offset)
            f.write(bytes(len(saved)))
        print("START " + case.name, flush=True)
        result = _probe(path, expect[case.store])
        print("RESULT " + json.dumps({"name": case.name, "path": path, **result}), flush=True)
        with open(victim, "r+b") as f:
            f.seek(case.offset)
            f.write(saved)
        shutil.rmtree(where)
    shutil.rmtree(scratch)


# -- the parent: children, watchdog ------------------------------------------------------


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _run_child(
    root: str, cases: list[Case], results: dict[str, Any], scratch: str, predicted: set[str]
) -> str | None:
    """Runs one child over ``cases``; returns the case it hung or died on (recorded), or None."""
    spec = os.path.join(scratch, f"spec-{threading.get_ident()}.json")
    with open(spec, "w") as f:
        json.dump({"root": root, "scratch": scratch, "cases": [vars(c) for c in cases]}, f)
    env = dict(os.environ, JAX_PLATFORMS="cpu", MALLOC_ARENA_MAX="2")
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", spec],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env,
        )  # fmt: skip
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, started, cpu0 = None, time.monotonic(), 0.0
        outcome = None
        while True:
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                waited = time.monotonic() - started
                cpu = _cpu_s(proc.pid)
                limit = KNOWN_HANG_CPU_S if current in predicted else CPU_LIMIT_S
                spun = cpu is not None and current is not None and cpu - cpu0 > limit
                if spun or waited > (WALL_LIMIT_S if current else START_LIMIT_S):
                    proc.kill()
                    proc.wait()
                    outcome = "hang"
                    break
                continue
            if line is None:
                rc = proc.wait()
                outcome = None if rc == 0 and current is None else f"crash (rc {rc})"
                break
            if line.startswith("START "):
                current, started = line[6:].strip(), time.monotonic()
                cpu0 = _cpu_s(proc.pid) or 0.0
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r.pop("name")] = r
                current = None
        err.seek(0)
        stderr = err.read().decode(errors="replace")[-2000:]
    if outcome is None:
        return None
    if current is None:
        raise RuntimeError(f"sweep child failed outside a case ({outcome}):\n{stderr}")
    results[current] = {"outcome": outcome.split()[0], "message": outcome, "stderr": stderr}
    return current


def run_sweep(root: str, cases: list[Case], children: int = 2) -> dict[str, dict[str, Any]]:
    """Every case's outcome (see the module docstring), in ``children`` processes at once."""
    results: dict[str, dict[str, Any]] = {}
    failures: list[BaseException] = []

    def deal(share: list[Case], scratch: str) -> None:
        try:
            while share:
                _run_child(root, share, results, scratch, predicted)
                share = [c for c in share if c.name not in results]
        except BaseException as e:
            failures.append(e)

    heaps = {s: heap_object_headers(store_path(root, s)) for s in STORES if s.startswith("hdf5")}
    predicted = {c.name for c in cases if c.store in heaps and known_hang(c, heaps[c.store])}
    # The predicted hangs last in each share: a hang kills its child, and no case is left
    # behind it but other predicted hangs (no child started again for the others).
    shares = [
        sorted(cases[i::children], key=lambda c: c.name in predicted) for i in range(children)
    ]
    with tempfile.TemporaryDirectory() as scratch:
        threads = [threading.Thread(target=deal, args=(share, scratch)) for share in shares]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if failures:
        raise failures[0]
    return results


def summarize(root: str, cases: list[Case], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts per outcome, and the cases that break the contract (``bad``)."""
    ranges = {s: data_ranges(root, s) for s in STORES}
    heaps = {s: heap_object_headers(store_path(root, s)) for s in STORES if s.startswith("hdf5")}
    counts: dict[str, int] = {}
    bad, hangs, known = [], set(), set()
    for case in cases:
        r = results[case.name]
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        if case.store in heaps and known_hang(case, heaps[case.store]):
            known.add(case.name)
        if r["outcome"] == "hang":
            hangs.add(case.name)
        elif r["outcome"] in ("raw", "crash"):
            bad.append((case.name, r))
        elif r["outcome"] == "differs" and not allowed_to_differ(case, ranges[case.store]):
            bad.append((case.name, {**r, "why": "values changed by damage outside the data"}))
        elif r["outcome"] == "named" and r["path"] not in r["message"]:
            bad.append((case.name, {**r, "why": "the message does not name the store"}))
    return {"counts": counts, "bad": bad, "hangs": hangs, "known_hangs": known}


def _iter_report(summary: dict[str, Any]) -> Iterator[str]:
    yield f"outcomes: {summary['counts']}"
    yield f"hangs: {sorted(summary['hangs'])}"
    yield f"known hangs: {sorted(summary['known_hangs'])}"
    for name, r in summary["bad"]:
        yield f"BAD {name}: {r}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child_main(sys.argv[2])
    else:
        with tempfile.TemporaryDirectory() as d:
            write_stores(d)
            todo = sweep_cases(d, dense="--dense" in sys.argv)
            t0 = time.perf_counter()
            res = run_sweep(d, todo)
            print(f"{len(todo)} cases in {time.perf_counter() - t0:.1f} s")
            print("\n".join(_iter_report(summarize(d, todo, res))))
