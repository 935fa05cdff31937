"""Timing, memory sampling, page-cache control and the result records shared by the sections."""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = [
    "Case",
    "Config",
    "Ratio",
    "RssSampler",
    "SectionResult",
    "PAGE_CACHE",
    "PageCache",
    "drop_page_cache",
    "files_under",
    "index_batches",
    "rss_anon_mb",
    "time_steps",
    "warm_page_cache",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """Knobs of one run, set by the command line."""

    quick: bool
    data_dir: str
    out_dir: str
    only: str | None
    sections: tuple[str, ...]
    transitions: int
    image_records: int
    batch_size: int = 256
    repeats: int = 5
    seed: int = 0
    # Target seconds of one timed repeat; the batch count per repeat follows from it.
    target_s: float = 0.25
    max_batches: int = 400
    loader_workers: tuple[int, ...] = (0, 2)
    # A case whose batches are so slow that the repeats would take longer than
    # this runs fewer repeats (at least MIN_REPEATS); None: always ``repeats``.
    case_budget_s: float | None = 25.0

    def wants(self, name: str) -> bool:
        return self.only is None or self.only in name


@dataclasses.dataclass
class Case:
    """One timed case: ``repeats`` repeats of ``batches`` batches (or writes) each."""

    name: str
    section: str
    dataset: str
    fmt: str  # npy | hdf5 | zarr | arrayrecord | memory | none
    layout: str
    method: str
    kind: str  # limit | ceiling | source | baseline | pipeline
    records_per_batch: int
    bytes_per_record: int
    batches: int
    repeat_s: list[float]
    note: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.repeat_s)

    @property
    def records_per_s(self) -> float:
        return self.batches * self.records_per_batch / self.median_s

    @property
    def mb_per_s(self) -> float:
        return self.records_per_s * self.bytes_per_record / 1e6

    @property
    def spread(self) -> float:
        """(max - min) / median of the repeats: how noisy the number is."""
        return (max(self.repeat_s) - min(self.repeat_s)) / self.median_s

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            median_s=self.median_s,
            records_per_s=self.records_per_s,
            mb_per_s=self.mb_per_s,
            ms_per_batch=1e3 * self.median_s / self.batches,
            spread=self.spread,
        )
        return d


@dataclasses.dataclass
class Ratio:
    """``num`` over ``den`` (rates), with an optional target it must reach."""

    name: str
    num: str
    den: str
    value: float
    target: float | None = None
    group: str = ""

    @property
    def passed(self) -> bool | None:
        return None if self.target is None else self.value >= self.target

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["passed"] = self.passed
        return d


@dataclasses.dataclass
class SectionResult:
    name: str
    cases: list[Case] = dataclasses.field(default_factory=list)
    ratios: list[Ratio] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    peak_rss_anon_mb: float = 0.0
    wall_s: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    log: Callable[[str], None] | None = dataclasses.field(default=None, repr=False)

    def add(self, case: Case | None, at: int | None = None) -> Case | None:
        if case is not None:
            self.cases.insert(len(self.cases) if at is None else at, case)
            if self.log is not None:
                self.log(
                    f"  {case.name}: {case.records_per_s:,.0f} rec/s, {case.mb_per_s:,.1f} MB/s "
                    f"({1e3 * case.median_s / case.batches:.3g} ms/batch, "
                    f"{case.batches}x{len(case.repeat_s)})"
                )
        return case

    def get(self, name: str) -> Case | None:
        for c in self.cases:
            if c.name == name:
                return c
        return None

    def ratio(
        self,
        name: str,
        num: str | Case | None,
        den: str | Case | None,
        target: float | None = None,
        group: str = "",
    ) -> Ratio | None:
        """Adds ``rate(num) / rate(den)`` when both cases ran (``--only`` may skip some)."""
        a = self.get(num) if isinstance(num, str) else num
        b = self.get(den) if isinstance(den, str) else den
        if a is None or b is None:
            return None
        r = Ratio(name, a.name, b.name, a.records_per_s / b.records_per_s, target, group)
        self.ratios.append(r)
        return r

    def to_json(self) -> dict[str, Any]:
        return {
            "cases": [c.to_json() for c in self.cases],
            "ratios": [r.to_json() for r in self.ratios],
            "notes": self.notes,
            "peak_rss_anon_mb": self.peak_rss_anon_mb,
            "wall_s": self.wall_s,
            **self.extra,
        }


MIN_REPEATS = 3


def index_batches(n: int, cfg: Config) -> np.ndarray:
    """Enough batches of uniform random record ids (with replacement) for one case, int64.

    Every case of a dataset reads the same sequence: warm-up (at most
    ``max_batches`` steps, see :func:`time_steps`), then the timed repeats.
    """
    count = (cfg.repeats + 1) * cfg.max_batches + 8
    rng = np.random.default_rng(cfg.seed)
    return rng.integers(0, n, size=(count, cfg.batch_size), dtype=np.int64)


def time_steps(
    step: Callable[[int], Any],
    cfg: Config,
    *,
    warmup: int = 1,
    warmup_s: float | None = None,
    min_batches: int = 1,
    max_batches: int | None = None,
    target_s: float | None = None,
    before_repeat: Callable[[], Any] | None = None,
    batches: int | None = None,
) -> tuple[int, list[float]]:
    """Times ``step(i)`` for a fixed number of steps per repeat, after a warm-up.

    The warm-up runs at least ``warmup`` steps and, after the first, at least
    ``warmup_s`` seconds (default ``target_s / 5``; for a loader, long enough
    that its prefetch buffers drain and the timed steps see its steady state).
    The warm-up also sizes the repeat: steps per repeat =
    ``target_s`` over the warm-up's time per step (the steps after the first when
    there are several), clamped to ``[min_batches, max_batches]``; the same for
    every repeat, or ``batches`` when given. ``step`` gets a running step number
    to pick fresh indices. A case slower than ``cfg.case_budget_s`` for all its
    repeats runs fewer of them (never fewer than ``MIN_REPEATS``).

    Returns:
      ``(steps per repeat, seconds of each repeat)``.
    """
    target_s = cfg.target_s if target_s is None else target_s
    max_batches = cfg.max_batches if max_batches is None else max_batches
    if warmup_s is None:
        warmup_s = target_s / 5
    if before_repeat is not None:
        before_repeat()
    i = 0
    warm: list[float] = []
    t_first = 0.0
    while True:
        t0 = time.perf_counter()
        step(i)
        t1 = time.perf_counter()
        warm.append(t1 - t0)
        i += 1
        if i == 1:
            t_first = t1
        if i >= max(1, warmup) and (t1 - t_first >= warmup_s or i >= max_batches):
            break
    est = statistics.fmean(warm[1:]) if len(warm) > 1 else warm[0]
    if batches is not None:
        k = batches
    else:
        k = int(min(max_batches, max(min_batches, round(target_s / max(est, 1e-9)))))
    repeats = cfg.repeats
    if cfg.case_budget_s is not None and est * k * repeats > cfg.case_budget_s:
        repeats = max(min(MIN_REPEATS, repeats), int(cfg.case_budget_s // (est * k)))
    times = []
    for _ in range(repeats):
        if before_repeat is not None:
            before_repeat()
        t0 = time.perf_counter()
        for _ in range(k):
            step(i)
            i += 1
        times.append(time.perf_counter() - t0)
    return k, times


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
