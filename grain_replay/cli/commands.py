"""The store commands: grain-replay convert | verify | stats (``info`` is ``cli/info.py``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from grain_replay.cli.info import cmd_info, fmt_bytes, size_on_disk
from grain_replay.cli.remote import storage_options, verify_object_store
from grain_replay.cli.stores import open_store

__all__ = [
    "cmd_convert",
    "cmd_info",
    "cmd_stats",
    "cmd_verify",
    "fmt_bytes",
    "open_store",
    "size_on_disk",
    "verify_isolated",
]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool, unit: str = "records") -> Any:
    """A tqdm bar on stderr counting ``unit`` (``"B"``: bytes, shown as KiB/MiB)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the cli extra is optional
        enabled = False
    if not enabled:
        return _NoBar()
    divisor = 1024 if unit == "B" else 1000  # 1000: tqdm's default
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=divisor, file=sys.stderr
    )


def _leaf_bytes(specs: Iterable[Any]) -> list[int]:
    """Bytes of one row of each leaf."""
    return [s.dtype.itemsize * int(np.prod(s.shape, dtype=np.int64)) for s in specs]


def _storable(spec: Any) -> Any:
    """``spec`` as written: fixed-width bytes (RLDS text) become uint8 ``(*shape, width)``."""
    from grain_replay.store import layout as layout_lib

    if spec.dtype.kind == "S":
        return layout_lib.LeafSpec(np.dtype(np.uint8), (*spec.shape, spec.dtype.itemsize))
    return layout_lib.LeafSpec(spec.dtype, tuple(spec.shape))


def _as_storable(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "S":
        return np.ascontiguousarray(a).view(np.uint8).reshape(*a.shape, a.dtype.itemsize)
    return a


def cmd_convert(args: argparse.Namespace) -> int:
    """Streams SRC into a new store at DST, bit-exactly, in bounded memory."""
    from grain_replay import tree as tree_lib
    from grain_replay.errors import StoreExistsError
    from grain_replay.store import layout as layout_lib
    from grain_replay.store.formats import format_from_path
    from grain_replay.writers.oneshot import write_blocks

    if os.path.lexists(args.dst) and not args.overwrite:
        raise StoreExistsError(
            f"{os.path.abspath(args.dst)} exists. Fix: pass --overwrite to replace it, or "
            "choose another destination."
        )
    src = open_store(args.src, storage_options(args.src, args.storage_option))
    n = len(src)
    fmt = args.format or format_from_path(args.dst)
    leaves = {k: _storable(v) for k, v in src.spec.items()}
    row_bytes = sum(_leaf_bytes(leaves.values()))
    block = max(1, args.block_bytes // max(1, row_bytes))
    probe = src.read_batch(np.arange(min(n, 1)))
    treedef = tree_lib.flatten(probe)[1]
    text = [k for k, v in src.spec.items() if v.dtype.kind == "S"]
    if text:
        print(
            f"text leaves {text} are written as uint8 arrays of their bytes (NUL-padded); "
            "read one back with bytes(row).rstrip(b'\\0')",
            file=sys.stderr,
        )
    meta = layout_lib.StoreMetadata(n, leaves, treedef)
    t = time.perf_counter()
    bar: Any = None  # drawn with the first block: the writer checks its options before that

    def blocks() -> Any:
        nonlocal bar
        bar = _progress(n, f"convert to {fmt}", not args.quiet, "records")
        for start in range(0, n, block):
            rows = src.read_batch(np.arange(start, min(start + block, n)))
            flat = tree_lib.flatten(rows)[0]
            bar.update(min(block, n - start))
            yield start, {k: _as_storable(np.asarray(v)) for k, v in flat.items()}

    try:
        out = write_blocks(
            args.dst, meta, blocks(), format=fmt, chunk_rows=args.chunk_rows,
            compression=args.compression, overwrite=args.overwrite,
        )  # fmt: skip
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: {args.dst} was not written (no partial store left)",
            file=sys.stderr,
        )
        return 130
    finally:
        if bar is not None:
            bar.close()
    dt = time.perf_counter() - t
    print(f"wrote {out}: {n:,} records, {fmt}, {fmt_bytes(n * row_bytes / max(dt, 1e-9))}/s")
    return 0


def verify_isolated(path: str | os.PathLike[str], timeout: float = 30.0) -> Any:
    """Opens ``path`` in a child process killed after ``timeout`` s: an
    :class:`~grain_replay.cli.isolated.IsolatedCheck` (``ok``, ``hung``, ``message``)."""
    from grain_replay.cli.isolated import verify_isolated as run

    return run(path, timeout)


def cmd_verify(args: argparse.Namespace) -> int:
    """Checks metadata, lengths and every leaf's recorded checksums.

    A store on the file system is first opened in a child process killed after
    ``--timeout`` s (a hostile HDF5 file can hang the HDF5 C library); only if that
    answers is it opened here. A many-writer store on S3 is checked by
    :func:`~grain_replay.cli.remote.verify_object_store`.
    """
    import grain_replay as gr
    from grain_replay.sources import PartsDataSource
    from grain_replay.store.formats import is_url
    from grain_replay.store.integrity import verify_source

    opts = storage_options(args.path, getattr(args, "storage_option", None))
    timeout = getattr(args, "timeout", 30.0)
    # The child guards against HDF5 files that hang the library: a file, not an URL.
    if timeout and timeout > 0 and not is_url(args.path):
        check = verify_isolated(args.path, timeout)
        if check.hung or (not check.ok and not check.error):
            print(f"CORRUPT {check.path}: {check.message}", file=sys.stderr)
            return 1
    src = open_store(args.path, opts)
    if isinstance(src, PartsDataSource):
        return _verify_parts(src, args)
    if isinstance(src, gr.ObjectPartsDataSource):
        return verify_object_store(src, args.path, opts)
    n = len(src)
    # verify_source checks the leaves one after another, reporting rows: count bytes.
    leaf_bytes = _leaf_bytes(src.spec.values())
    bar = _progress(n * sum(leaf_bytes), "verify (bytes read)", not args.quiet, "B")
    done = [0]  # rows checked over all leaves

    def progress(rows: int) -> None:
        leaf = min(done[0] // max(n, 1), len(leaf_bytes) - 1)
        done[0] += rows
        bar.update(rows * leaf_bytes[leaf])

    try:
        report = verify_source(src, getattr(src, "checksums", None), progress=progress)
    finally:
        bar.close()
    if report.ok:
        what = "checksums match" if report.has_checksums else "readable (no checksums recorded)"
        print(
            f"OK {report.path}: {report.num_records:,} records, {len(src.spec)} leaves, "
            f"{report.blocks_checked} blocks, {what}"
        )
        return 0
    print(f"CORRUPT {report.path}: {report.problem}", file=sys.stderr)
    return 1


def _verify_parts(src: Any, args: argparse.Namespace) -> int:
    """Verifies every live segment of every writer of a many-writer store, and the manifests."""
    import grain_replay as gr
    from grain_replay.errors import GrainReplayError
    from grain_replay.store.integrity import verify_source

    problems = []
    for m in src.writers:
        firsts = [s.first for s in m.segments]
        want = list(range(firsts[0], firsts[0] + len(firsts) * m.segment_rows, m.segment_rows))
        short = [s.first for s in m.segments[:-1] if s.rows != m.segment_rows]
        end = m.segments[-1].first + m.segments[-1].rows if m.segments else 0
        if firsts != want or short or end != m.committed:
            problems.append(
                f"writer {m.writer_id!r}: manifest lists segments {firsts} (short: {short}) "
                f"ending at row {end}, committed {m.committed}"
            )
    blocks = 0
    segments = src.segments()
    bar = _progress(len(segments), "verify (segments)", not args.quiet, "segments")
    for writer_id, _first, rows, path in segments:
        try:
            with gr.open_source(path) as seg:
                if len(seg) < rows:
                    problems.append(
                        f"writer {writer_id!r}: segment {path} holds {len(seg)} rows, the "
                        f"manifest commits {rows}"
                    )
                    continue
                report = verify_source(seg, seg.checksums)
        except (GrainReplayError, OSError) as e:
            problems.append(f"writer {writer_id!r}: segment {path}: {e}")
            continue
        finally:
            bar.update(1)
        blocks += report.blocks_checked
        if not report.ok:
            problems.append(f"writer {writer_id!r}: segment {path}: {report.problem}")
    bar.close()
    if problems:
        for p in problems:
            print(f"CORRUPT {src.path}: {p}", file=sys.stderr)
        return 1
    print(
        f"OK {src.path}: {len(src):,} live records of {len(src.writers)} writers, "
        f"{len(segments)} segments, {blocks} blocks, checksums match"
    )
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """Per-leaf count, mean, std, min, max and quantiles (cached beside the store)."""
    from grain_replay.stats import compute_stats, iter_json

    src = open_store(args.path, storage_options(args.path, args.storage_option))
    with _progress(len(src), "stats", not (args.quiet or args.json)) as bar:
        stats = compute_stats(
            src, keys=args.keys, quantiles=args.quantiles, cache=not args.no_cache,
            progress=bar.update,
        )  # fmt: skip
    leaves = dict(iter_json(stats))
    if args.json:
        # Strict JSON: NaN and infinities (a NaN in the data propagates) become null.
        def strict(v: Any) -> Any:
            if isinstance(v, list):
                return [strict(x) for x in v]
            return v if not isinstance(v, float) or np.isfinite(v) else None

        out = {
            "path": src.path,
            "num_records": len(src),
            "leaves": {k: {n: strict(v) for n, v in d.items()} for k, d in leaves.items()},
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"{src.path}: {len(src):,} records")
    with np.printoptions(precision=4, threshold=8, edgeitems=3, linewidth=1000):
        for key, d in leaves.items():
            spec = src.spec[key]
            print(f"  {key or '<root>'}  {spec.dtype} {tuple(spec.shape)}")
            for name, value in d.items():
                if name != "count":
                    print(f"    {name:<5} {np.asarray(value).ravel()}")
    return 0
