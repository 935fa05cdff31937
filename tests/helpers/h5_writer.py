"""An HDF5 writer in a process of its own, holding its file open while a test reads it.

    python h5_writer.py PATH MODE [--gzip]

MODE: ``plain`` (h5py's defaults: holds HDF5's file lock), ``swmr`` (``libver='latest'``,
then ``f.swmr_mode = True``), ``latest`` (``libver='latest'``, not SWMR). Writes leaves
``obs`` (float32, rows of 3: row i is 3i, 3i+1, 3i+2) and ``act`` (int64: row i is i),
10 rows, flushes, and prints ``ready``. Then reads one command a line from stdin and
prints a line once it is done:

* ``grow LEAF N`` (LEAF: obs, act or all): extends to N rows, writes them, flushes: ``grown``;
* ``close``: closes the file: ``closed``;
* ``crash``: exits at once, the file left open (as a killed writer leaves it).

End of stdin closes the file and exits. Imports h5py and numpy only (starts fast).
"""

from __future__ import annotations

import os
import sys

import h5py
import numpy as np

LEAVES = ("obs", "act")


def rows(leaf: str, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of ``leaf``, as written (and as a reader must see them)."""
    if leaf == "obs":
        return np.arange(3 * start, 3 * stop, dtype=np.float32).reshape(-1, 3)
    return np.arange(start, stop, dtype=np.int64)


def _grow(f: h5py.File, leaf: str, n: int) -> None:
    d = f[leaf]
    start = d.shape[0]
    d.resize((n, *d.shape[1:]))
    d[start:n] = rows(leaf, start, n)
    if f.swmr_mode:
        d.flush()


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    gzip = "--gzip" in sys.argv[3:]
    f = h5py.File(path, "w", libver="latest" if mode in ("swmr", "latest") else None)
    f.create_dataset(
        "obs", shape=(0, 3), maxshape=(None, 3), chunks=(4, 3), dtype=np.float32,
        compression="gzip" if gzip else None,
    )  # fmt: skip
    f.create_dataset("act", shape=(0,), maxshape=(None,), chunks=(4,), dtype=np.int64)
    for leaf in LEAVES:
        _grow(f, leaf, 10)
    if mode == "swmr":
        f.swmr_mode = True
    f.flush()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "grow":
            for leaf in LEAVES if words[1] == "all" else (words[1],):
                _grow(f, leaf, int(words[2]))
            f.flush()
            print("grown", flush=True)
        elif words[0] == "close":
            f.close()
            print("closed", flush=True)
        elif words[0] == "crash":
            os._exit(0)
    if f.id.valid:
        f.close()


if __name__ == "__main__":
    main()
