"""The truncation guard on mapped reads: one fstat per mapped file per batch, same refusals."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.sources.reading.files import MappedFile


def _patch_sizes(
    monkeypatch: pytest.MonkeyPatch, src: Any, size: Callable[[MappedFile], int]
) -> None:
    """Every size check of ``src`` asks ``size(file)``: the batch's own (through
    ``size_call``) and the one that names the leaf. The handle's kept plans hold the
    old calls, so they are dropped (the next batch plans again)."""
    monkeypatch.setattr(MappedFile, "size", size)
    monkeypatch.setattr(MappedFile, "size_call", lambda self: functools.partial(size, self))
    handle = src._handle
    if handle is not None:
        handle._check_plans = None
        handle._last_check = None


def _count_sizes(monkeypatch: pytest.MonkeyPatch, src: Any) -> list[str]:
    calls: list[str] = []
    real = MappedFile.size

    def size(self: MappedFile) -> int:
        calls.append(self.path)
        return real(self)

    _patch_sizes(monkeypatch, src, size)
    return calls


def _npz(tmp_path: Any) -> str:
    path = str(tmp_path / "d.npz")
    np.savez(path, a=np.arange(1000.0), b=np.arange(1000), c=np.ones((1000, 3), np.float32))
    return path


def test_members_of_one_npz_are_checked_with_one_fstat_a_batch(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = gr.open_source(_npz(tmp_path))
    src.read_batch([0])
    calls = _count_sizes(monkeypatch, src)
    for _ in range(3):
        src.read_batch([1, 999, 5])
    assert len(calls) == 3  # three batches, one archive
    src.read_into([2], {"a": np.empty(1), "c": np.empty((1, 3), np.float32)})
    assert len(calls) == 4


def test_leaves_in_separate_files_are_each_checked(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = gr.write_npy(str(tmp_path / "s"), {"a": np.arange(10.0), "b": np.arange(10)})
    src = gr.open_source(store)
    src.read_batch([0])
    calls = _count_sizes(monkeypatch, src)
    src.read_batch([3])
    assert sorted(os.path.basename(c) for c in calls) == ["a.npy", "b.npy"]
    calls.clear()
    src.read_leaf("b", [3])  # a key set of its own: only its file
    assert [os.path.basename(c) for c in calls] == ["b.npy"]


def test_shrunk_archive_names_the_member_past_its_end(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One size for the archive, compared with each member's own end: only members
    reaching past the size are refused, and the error names the first of them."""
    path = _npz(tmp_path)
    src = gr.open_source(path)
    src.read_batch([0])
    files = src._get_handle().mapped_files
    ends = {k: files[k][0].needed for k in ("a", "b", "c")}
    order = sorted(ends, key=ends.get)  # type: ignore[arg-type]
    cut = ends[order[0]]  # the first member still fits, the other two do not
    _patch_sizes(monkeypatch, src, lambda self: cut)
    with pytest.raises(gr.InvalidStoreError, match=rf"d\.npz: leaf '{order[1]}'.*truncated"):
        src.read_batch([0])
    assert src.read_leaf(order[0], [4]).tolist() == src.read_leaf(order[0], [4]).tolist()
    with pytest.raises(gr.InvalidStoreError, match=rf"leaf '{order[2]}'.*truncated while open"):
        src.read_leaf(order[2], [4])


def test_groups_follow_a_reopened_handle(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _npz(tmp_path)
    src = gr.open_source(path)
    first = src.read_batch([7])
    src.close()  # the handle and its file groups are dropped
    calls = _count_sizes(monkeypatch, src)
    again = src.read_batch([7])
    assert len(calls) == 1
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
    handle = src._get_handle()
    handle.close_mapped()  # descriptors let go: nothing left to check, reads still work
    calls.clear()
    src.read_batch([8])
    assert calls == []


def test_npz_truncated_under_live_map_raises_instead_of_sigbus(tmp_path: Any) -> None:
    path = _npz(tmp_path)
    code = (
        "import os, sys, grain_replay as gr\n"
        f"src = gr.open_source({path!r})\n"
        "src.read_batch([0, 999])\n"
        f"os.truncate({path!r}, 4096)\n"
        "try:\n    src.read_batch([999])\nexcept gr.InvalidStoreError as e:\n"
        "    print('named error:', e)\nelse:\n    sys.exit(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != -signal.SIGBUS, "the reader died of SIGBUS"
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    assert path in out.stdout and "truncated while open" in out.stdout
