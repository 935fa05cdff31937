"""How the .npz source maps its archive: random access, and huge pages where it fits in memory."""

from __future__ import annotations

import mmap
import os
import sys
from typing import Any

import numpy as np
import pytest

import grain_replay as gr

linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not hasattr(mmap, "MADV_HUGEPAGE")
    or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
    reason="the VMA flags of a map are read from Linux's /proc/self/smaps (THP kernels)",
)


def _write(tmp_path: Any) -> tuple[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    arrays = {
        "observations": rng.standard_normal((500, 7), dtype=np.float32),  # misaligned rows
        "actions": rng.integers(0, 18, 500),
        "terminals": rng.random(500) < 0.1,
    }
    path = str(tmp_path / "d.npz")
    np.savez(path, **arrays)
    return path, arrays


def _vm_flags(src: gr.NpzDataSource) -> set[str]:
    """The VmFlags of the map the source's stored members are read through."""
    src.read_batch([0])
    mapping = src._handle._mapping  # type: ignore[union-attr]
    addr = np.frombuffer(mapping, np.uint8).ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping at {addr:#x} in /proc/self/smaps")


def _assert_reads_equal(src: gr.NpzDataSource, arrays: dict[str, np.ndarray]) -> None:
    idx = np.random.default_rng(1).integers(0, 500, 64)
    got = src.read_flat(idx)
    for k, a in arrays.items():
        np.testing.assert_array_equal(got[k], a[idx], err_msg=k)


@linux_thp
def test_archive_that_fits_is_mapped_random_and_huge(tmp_path: Any) -> None:
    path, arrays = _write(tmp_path)
    with gr.NpzDataSource(path) as src:
        flags = _vm_flags(src)
        assert {"rr", "hg"} <= flags, flags
        _assert_reads_equal(src, arrays)


@linux_thp
def test_archive_over_half_the_memory_keeps_small_pages(tmp_path: Any, monkeypatch: Any) -> None:
    path, arrays = _write(tmp_path)
    real = os.sysconf

    def tiny_memory(name: str) -> int:  # 2 pages of memory: the archive does not fit
        return 2 if name == "SC_PHYS_PAGES" else real(name)

    monkeypatch.setattr(os, "sysconf", tiny_memory)
    with gr.NpzDataSource(path) as src:
        flags = _vm_flags(src)
        assert "rr" in flags and "hg" not in flags, flags
        _assert_reads_equal(src, arrays)


@linux_thp
def test_unknown_memory_size_keeps_small_pages(tmp_path: Any, monkeypatch: Any) -> None:
    path, arrays = _write(tmp_path)

    def unknown(name: str) -> int:
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(os, "sysconf", unknown)
    with gr.NpzDataSource(path) as src:
        assert "hg" not in _vm_flags(src)
        _assert_reads_equal(src, arrays)


@linux_thp
def test_refused_huge_page_advice_falls_back_to_small_pages(
    tmp_path: Any, monkeypatch: Any
) -> None:
    path, arrays = _write(tmp_path)
    # Advice the kernel refuses (EINVAL), as a kernel without THP refuses MADV_HUGEPAGE.
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)
    with gr.NpzDataSource(path) as src:
        flags = _vm_flags(src)
        assert "rr" in flags and "hg" not in flags, flags
        _assert_reads_equal(src, arrays)


def test_platform_without_the_advice_reads_the_same(tmp_path: Any, monkeypatch: Any) -> None:
    path, arrays = _write(tmp_path)
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)
    monkeypatch.delattr(mmap, "MADV_RANDOM", raising=False)
    with gr.NpzDataSource(path) as src:
        _assert_reads_equal(src, arrays)
