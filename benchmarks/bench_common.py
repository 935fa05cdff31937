"""Timing, the result records, and running the peers: what the benchmark sections share.

Memory sampling and page-cache control are ``page_cache.py`` (re-exported here).
Peer scripts (``bench_*_peer(s).py``) run in their own interpreters and import
only numpy and this module from here.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from page_cache import (
    PAGE_CACHE,
    PageCache,
    RssSampler,
    drop_page_cache,
    files_under,
    rss_anon_mb,
    warm_page_cache,
)

__all__ = [
    "Case",
    "Config",
    "PeerError",
    "Ratio",
    "RssSampler",
    "SectionResult",
    "PAGE_CACHE",
    "PageCache",
    "drop_page_cache",
    "files_under",
    "index_batches",
    "peer_env",
    "rss_anon_mb",
    "run_peer",
    "time_calls",
    "time_steps",
    "transitions",
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


def time_calls(
    fn: Callable[[], Any], repeats: int, per_repeat: int, warmup: int = 3
) -> list[float]:
    """Seconds per call of ``repeats`` repeats of ``per_repeat`` calls, after a warm-up of
    ``max(warmup, per_repeat // 4)`` calls (for the peers and the sections timed by call)."""
    for _ in range(max(warmup, per_repeat // 4)):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_repeat):
            fn()
        out.append((time.perf_counter() - start) / per_repeat)
    return out


def transitions(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` rows of 525 B: obs and next_obs (64 float32), action, reward, done."""
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n, 64), dtype=np.float32),
        "action": rng.integers(0, 18, n).astype(np.int64),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "next_obs": rng.standard_normal((n, 64), dtype=np.float32),
        "done": rng.random(n) < 0.01,
    }


# -- peers: other libraries, each in its own virtual environment ------------------------


class PeerError(RuntimeError):
    """A peer's script failed, timed out or printed nothing; the message says how."""


def peer_env(**extra: str) -> dict[str, str]:
    """This environment less what points into ours (PYTHONPATH, XLA_FLAGS), TensorFlow quiet."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.update(extra)
    return env


def run_peer(
    python: str, script: str, args: Iterable[str], *, timeout: float | None = None, **env: str
) -> str:
    """Runs ``python script *args`` (a peer's benchmark) and returns its last line of stdout.

    The peer prints its result last (a JSON object, or a path). ``env`` adds to
    :func:`peer_env`.

    Raises:
      PeerError: it exited non-zero (with the end of its stderr), ran past ``timeout``
        seconds, or printed nothing.
    """
    cmd = [python, script, *args]
    name = os.path.basename(script)
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=peer_env(**env), timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise PeerError(f"{name} timed out after {timeout:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " / ".join((proc.stderr or "").strip().splitlines()[-3:])
        raise PeerError(f"{name} failed (exit {proc.returncode}): {tail}")
    return lines[-1]
