"""Child process of the crash-safety tests: writes a store until it is SIGKILLed.

Run as a script (``tests/reliability/test_crash.py`` starts it with ``subprocess.Popen``)::

    python crash_child.py write  PATH FORMAT SEED VERSION [--die-at HOOK:K]
    python crash_child.py append PATH FORMAT SEED [--flush-every B] [--max-rows R]
                                 [--chunk-rows C] [--compression Z] [--die-at HOOK:K]

``write`` overwrites the store at PATH with ``gr.write`` again and again, with
versions VERSION+1, VERSION+2, ... (see :func:`version_tree`). ``append`` opens
a ``gr.ReplayWriter`` on PATH and appends blocks of rows whose values follow
from the row index (see :func:`make_rows`), flushing every B blocks.

The parent reads one marker per line on stdout (each written with one
unbuffered ``os.write``) to tell where the kill landed:

    ready N jax=0|1   imports done, store opened (N: committed rows / version on disk)
    W v  /  w v       gr.write of version v begins / returned
    A s k  /  a e     append of rows [s, s+k) begins / returned, e = len(writer)
    F n  /  C n       flush of the first n rows begins / returned, n committed
    X HOOK K          the child is about to SIGKILL itself (``--die-at``)
    idle              --max-rows reached; the child sleeps until killed

``--die-at HOOK:K[:after]`` SIGKILLs the child itself at the K-th call of
``os.HOOK`` (``fsync``, ``replace``, ``pwrite``, ``truncate``, ``rename``),
of ``h5py.File.flush`` (HOOK ``h5flush``), of grain_replay's atomic
directory swap (HOOK ``exchange``) of the ``os.replace`` that commits the
store's metadata file (HOOK ``commitmeta``: ``zarr.json`` / ``grain_replay.json``
at the store's root), or of the HDF5 flushes and attribute creates/deletes
from the moment a commit starts growing the metadata attribute on (HOOK
``grow``), before the call or just after it; it hits commit windows that a
timed kill rarely lands in. ``--checksum-block-bytes`` shrinks the checksum
blocks so the metadata grows quickly.

This module imports neither jax nor pytest; the parent imports it for
:func:`make_rows`, :func:`version_tree` and :func:`check_rows`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import zlib
from typing import Any

import numpy as np

# Rows of version v of the one-shot store start at v * VERSION_STRIDE.
VERSION_STRIDE = 10_000_000
VEC_SHAPE = (4, 3)
PIXEL_SHAPE = (8,)
HOOKS = (
    "fsync",
    "replace",
    "pwrite",
    "truncate",
    "rename",
    "h5flush",
    "exchange",
    "commitmeta",
    "grow",
)
# The HDF5 attribute a commit writes first when the metadata outgrows its attribute.
METADATA_ATTR_NEXT = "grain_replay.next"


def _checksum(vec: np.ndarray, pixels: np.ndarray, action: np.ndarray, index: np.ndarray) -> Any:
    return np.array(
        [
            zlib.crc32(b"".join((vec[r].tobytes(), pixels[r].tobytes(), action[r].tobytes())))
            ^ (int(index[r]) & 0xFFFFFFFF)
            for r in range(len(index))
        ],
        dtype=np.uint32,
    )


def make_rows(start: int, stop: int) -> dict[str, Any]:
    """Rows ``[start, stop)``: every value follows from the row index, plus a crc per row."""
    i = np.arange(start, stop, dtype=np.int64)
    vec = np.broadcast_to((i % 65536).astype(np.float32)[:, None, None], (len(i), *VEC_SHAPE))
    vec = np.ascontiguousarray(vec)
    pixels = ((i[:, None] * 7 + np.arange(PIXEL_SHAPE[0])) % 251).astype(np.uint8)
    action = (i % 1_000_003).astype(np.int32)
    return {
        "obs": {"vec": vec, "pixels": pixels},
        "action": action,
        "index": i,
        "checksum": _checksum(vec, pixels, action, i),
    }


def version_num_rows(version: int) -> int:
    return 200 + (version % 7) * 50


def version_tree(version: int) -> dict[str, Any]:
    """The whole tree ``gr.write`` writes as version ``version`` (lengths differ by version)."""
    start = version * VERSION_STRIDE
    return make_rows(start, start + version_num_rows(version))


def check_rows(flat: dict[str, np.ndarray], start: int = 0) -> list[str]:
    """Problems with rows read back as ``{leaf key: array}`` that should be rows from ``start``.

    Returns an empty list when every row is intact: values follow from the
    index and every row's checksum matches.
    """
    n = len(flat["index"])
    want = make_rows(start, start + n)
    problems = []
    for key, w in (
        ("obs/vec", want["obs"]["vec"]),
        ("obs/pixels", want["obs"]["pixels"]),
        ("action", want["action"]),
        ("index", want["index"]),
        ("checksum", want["checksum"]),
    ):
        got = np.asarray(flat[key])
        if got.dtype != w.dtype or got.shape != w.shape:
            problems.append(f"{key}: got {got.dtype}{got.shape}, want {w.dtype}{w.shape}")
            continue
        bad = np.flatnonzero((got != w).reshape(n, -1).any(axis=1)) if n else []
        if len(bad):
            problems.append(f"{key}: {len(bad)} bad rows, first {start + int(bad[0])}")
    return problems


def _say(text: str) -> None:
    os.write(1, (text + "\n").encode())


def _install_die_at(spec: str, path: str) -> None:
    """SIGKILLs this process at the K-th call of the hooked function."""
    parts = spec.split(":")
    hook, k = parts[0], int(parts[1])
    after = len(parts) > 2 and parts[2] == "after"
    if hook not in HOOKS:
        raise SystemExit(f"unknown hook {hook!r}; pick one of {HOOKS}")
    calls = [0]
    # commitmeta: only the rename that commits the store's metadata counts.
    meta_files = {os.path.join(path, "zarr.json"), os.path.join(path, "grain_replay.json")}
    growing = [False]

    def wrap(real: Any) -> Any:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            if hook == "commitmeta" and os.path.abspath(os.fspath(args[1])) not in meta_files:
                return real(*args, **kwargs)
            if hook == "grow":
                name = args[1] if len(args) > 1 else None
                if isinstance(name, bytes):
                    name = name.decode()
                growing[0] = growing[0] or name == METADATA_ATTR_NEXT
                if not growing[0]:
                    return real(*args, **kwargs)
            calls[0] += 1
            if calls[0] == k and not after:
                _say(f"X {hook} {k}")
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if calls[0] == k and after:
                _say(f"X {hook} {k} after")
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return hooked

    if hook == "h5flush":
        import h5py

        h5py.File.flush = wrap(h5py.File.flush)
    elif hook == "exchange":
        from grain_replay.writers import atomic

        atomic._exchange = wrap(atomic._exchange)
    elif hook == "commitmeta":
        os.replace = wrap(os.replace)
    elif hook == "grow":
        # Every HDF5 flush and attribute create/delete, counted from the first create of
        # the second metadata attribute (a commit growing the metadata) on.
        import h5py

        h5py.File.flush = wrap(h5py.File.flush)
        h5py.h5a.create = wrap(h5py.h5a.create)
        h5py.h5a.delete = wrap(h5py.h5a.delete)
    else:
        setattr(os, hook, wrap(getattr(os, hook)))


def _run_write(args: argparse.Namespace) -> None:
    import grain_replay as gr

    _say(f"ready {args.version} jax={int('jax' in sys.modules)}")
    version = args.version
    while True:
        version += 1
        tree = version_tree(version)
        _say(f"W {version}")
        gr.write(args.path, tree, format=args.format, overwrite=True)
        _say(f"w {version}")


def _run_append(args: argparse.Namespace) -> None:
    import grain_replay as gr

    rng = np.random.default_rng(args.seed)
    writer = gr.ReplayWriter(
        args.path, args.format, chunk_rows=args.chunk_rows, compression=args.compression
    )
    start = writer.committed
    _say(f"ready {start} jax={int('jax' in sys.modules)}")
    blocks = 0
    sizes = np.array([0, 1, 2, 3, 5, 8, 13, 21, 34, 55])
    while len(writer) - start < args.max_rows:
        k = int(rng.choice(sizes))
        s = len(writer)
        _say(f"A {s} {k}")
        writer.append(make_rows(s, s + k))
        _say(f"a {len(writer)}")
        blocks += 1
        if blocks % args.flush_every == 0:
            _say(f"F {len(writer)}")
            _say(f"C {writer.flush()}")
    _say("idle")
    while True:
        time.sleep(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("write", "append"))
    p.add_argument("path")
    p.add_argument("format", choices=("hdf5", "npy", "zarr"))
    p.add_argument("seed", type=int)
    p.add_argument("version", type=int, nargs="?", default=0)
    p.add_argument("--flush-every", type=int, default=3)
    p.add_argument("--max-rows", type=int, default=3000)
    p.add_argument("--chunk-rows", type=int, default=None)
    p.add_argument("--compression", default=None)
    p.add_argument("--die-at", default=None)
    p.add_argument("--checksum-block-bytes", type=int, default=None)
    args = p.parse_args(argv)
    if args.checksum_block_bytes:
        # Tiny checksum blocks: the metadata grows fast (HDF5: past its attribute).
        from grain_replay.store import integrity

        integrity.CHECKSUM_BLOCK_BYTES = args.checksum_block_bytes
    if args.die_at:
        _install_die_at(args.die_at, os.path.abspath(args.path))
    if args.mode == "write":
        _run_write(args)
    else:
        _run_append(args)


if __name__ == "__main__":
    main()
