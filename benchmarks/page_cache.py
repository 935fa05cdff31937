"""Memory and page-cache control for the benchmarks: RSS sampling, warming and dropping files."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

__all__ = [
    "PAGE_CACHE",
    "PageCache",
    "RssSampler",
    "drop_page_cache",
    "files_under",
    "rss_anon_mb",
    "warm_page_cache",
]


def rss_anon_mb(pid: int | str = "self") -> float:
    """A process's anonymous resident memory (``RssAnon`` of /proc/PID/status), MB; 0 if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class RssSampler:
    """Samples ``RssAnon`` in a daemon thread to report the peak of each section."""

    def __init__(self, interval_s: float = 0.02):
        self._interval = interval_s
        self._peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, rss_anon_mb())

    def reset(self) -> None:
        self._peak = rss_anon_mb()

    def peak(self) -> float:
        return max(self._peak, rss_anon_mb())

    def stop(self) -> None:
        self._stop.set()


def files_under(path: str) -> list[str]:
    """Every regular file of a store (a file, or a directory walked recursively)."""
    if os.path.isfile(path):
        return [path]
    out = []
    for dirpath, _, names in os.walk(path):
        out.extend(os.path.join(dirpath, n) for n in sorted(names))
    return out


def warm_page_cache(paths: Iterable[str]) -> int:
    """Reads every file once so that later reads come from the page cache; returns bytes."""
    total = 0
    buf = bytearray(8 << 20)
    for path in paths:
        for file in files_under(path):
            with open(file, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return total


class PageCache:
    """Keeps only the stores under test in the page cache.

    The datasets together are larger than this machine's memory; without this,
    warming one store can evict another's pages, or its own (a single
    sequential pass lands on the kernel's inactive list), and "page-cached"
    reads silently go to the disk.
    """

    # Stores smaller than this stay cached: together they fit in memory, and
    # dropping and re-reading stores of tens of thousands of chunk files is slow.
    BIG_BYTES = 1 << 30

    def __init__(self) -> None:
        self.resident: set[str] = set()
        self.sizes: dict[str, int] = {}

    def track(self, sizes: dict[str, int]) -> None:
        """Stores (path -> bytes) that may be cached now: all of them, after generation."""
        self.sizes.update(sizes)
        self.resident.update(p for p, n in sizes.items() if n >= self.BIG_BYTES)

    def keep_only(self, paths: Iterable[str]) -> None:
        """Drops the other big stores, then reads ``paths`` (big ones twice, to make them stick)."""
        keep = set(paths)
        drop_page_cache(sorted(self.resident - keep))
        warm_page_cache(sorted(keep))
        big = sorted(p for p in keep if self.sizes.get(p, 0) >= self.BIG_BYTES)
        warm_page_cache(big)
        self.resident = set(big)

    def touched(self, path: str) -> None:
        if self.sizes.get(path, 0) >= self.BIG_BYTES:
            self.resident.add(path)


PAGE_CACHE = PageCache()


def drop_page_cache(paths: Iterable[str]) -> None:
    """Asks the kernel to drop the cached pages of every file (``POSIX_FADV_DONTNEED``).

    Pages still mapped by a live memory map stay resident, so callers close
    their sources and memory maps first.
    """
    for path in paths:
        for file in files_under(path):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
