"""Zeroed byte ranges over every file of stores written by ``gr.write``: named errors, never raw.

The sweep (``tests/helpers/zero_sweep.py``) zeroes a window of one file of one
store (HDF5 plain, gzip and nested; Zarr plain and zstd; ``.npy``: superblock,
object headers, B-trees, heaps, the metadata attribute and JSON files, ``.npy``
headers, chunks and data), opens the copy with ``gr.open_source`` and reads every
row, each case in a child process watched for hangs. Every case must end in the
written values, other values where the window hits data bytes (reads do not check
checksums; ``grain-replay verify`` does), or a ``gr.GrainReplayError`` naming the
store. The cases that hang must be exactly the known HDF5 C library hang (a global
heap object header zeroed: SECURITY.md), so a new hang fails the test.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import zero_sweep

import grain_replay as gr

pytestmark = pytest.mark.timeout(600)


def _sweep(root: str, dense: bool) -> tuple[list[zero_sweep.Case], dict[str, Any], float]:
    zero_sweep.write_stores(root)
    cases = zero_sweep.sweep_cases(root, dense=dense)
    t0 = time.perf_counter()
    results = zero_sweep.run_sweep(root, cases)
    return cases, zero_sweep.summarize(root, cases, results), time.perf_counter() - t0


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], dict[str, Any]]:
    cases, summary, took = _sweep(str(tmp_path_factory.mktemp("zeroed")), dense=False)
    print(f"\n{len(cases)} zeroed ranges in {took:.1f} s: {summary['counts']}")
    return cases, summary


def _check(cases: list[Any], summary: dict[str, Any]) -> None:
    assert len(summary["bad"]) == 0, "\n".join(f"{n}: {r}" for n, r in summary["bad"])
    assert summary["hangs"] == summary["known_hangs"], (
        f"new hangs: {sorted(summary['hangs'] - summary['known_hangs'])}; "
        f"known hangs that no longer hang: {sorted(summary['known_hangs'] - summary['hangs'])}"
    )
    assert sum(summary["counts"].values()) == len(cases)


def test_zeroed_range_gives_written_values_or_named_error_when_swept(swept: Any) -> None:
    cases, summary = swept
    _check(cases, summary)


def test_sweep_covers_every_format_and_every_outcome(swept: Any) -> None:
    cases, summary = swept
    assert {c.store for c in cases} == set(zero_sweep.STORES)
    assert len(cases) >= 600
    for outcome in ("same", "differs", "named"):
        assert summary["counts"].get(outcome, 0) >= 50, summary["counts"]
    # The known HDF5 hang is within the fast sweep's windows: its watchdog is exercised.
    assert summary["known_hangs"], "no window hits a global heap object header"


@pytest.mark.slow
def test_zeroed_range_gives_written_values_or_named_error_when_swept_densely(
    tmp_path: Any,
) -> None:
    """64-byte windows every 16 bytes over the first 64 KiB of every file."""
    cases, summary, took = _sweep(str(tmp_path), dense=True)
    print(f"\n{len(cases)} zeroed ranges in {took:.1f} s: {summary['counts']}")
    _check(cases, summary)


def test_known_hang_predicate_matches_heap_layout(tmp_path: Any) -> None:
    """The known hang: a global heap object header (index and size) zeroed, collection intact."""
    zero_sweep.write_stores(str(tmp_path))
    headers = zero_sweep.heap_object_headers(zero_sweep.store_path(str(tmp_path), "hdf5"))
    assert [i for _, _, i in headers] == [1, 0]  # the metadata string, then free space
    gcol, string, _ = headers[0]
    free = headers[1][1]

    def case(off: int, length: int) -> zero_sweep.Case:
        return zero_sweep.Case("hdf5", "", off, length)

    assert zero_sweep.known_hang(case(free + 8, 8), headers)  # free space: size 0
    assert zero_sweep.known_hang(case(string, 16), headers)  # the string: index 0, size 0
    assert not zero_sweep.known_hang(case(string + 8, 8), headers)  # index 1, size 0: refused
    assert not zero_sweep.known_hang(case(gcol, 512), headers)  # no collection: refused
    assert not zero_sweep.known_hang(case(string + 16, 64), headers)  # the JSON: refused


def test_zeroed_symbol_table_names_file_and_fix_when_user_report_range(tmp_path: Any) -> None:
    """The report: bytes 800-2048 of a gr.write file zeroed gave a raw RuntimeError."""
    path = str(tmp_path / "store.h5")
    gr.write(path, zero_sweep.base_tree(256))
    with open(path, "r+b") as f:
        f.seek(800)
        f.write(bytes(2048 - 800))
    with pytest.raises(gr.InvalidStoreError) as info:
        gr.open_source(path).read_batch(np.arange(256))
    msg = str(info.value)
    assert os.path.abspath(path) in msg and "restore it from a copy or re-write it" in msg
    assert f"grain-replay verify {os.path.abspath(path)}" in msg
    assert info.value.__cause__ is not None
