"""Section ``formats_extra``: page-cached random batch reads of .npz, torchrl dumps and Vaults.

The target (issue 25): ``read_batch`` at >= 0.9x the in-memory numpy gather (``np.take`` of
every leaf from arrays in RAM), each ratio measured in the same run. The stores are written
here: ``np.savez`` (members mapped in place; as written, and again with its page cache
dropped and then filled by the source's own page faults: ``npz-faulted``) and
``np.savez_compressed`` (inflated once), a
torchrl dump as ``ReplayBuffer.dumps`` lays it out (wrapped, so reads go through the
oldest-first reorder) and a flashbax Vault (through tensorstore, decoded once).

Alone: ``python benchmarks/bench_formats_extra.py [--quick] [--formats npz,npz-faulted]``;
in the suite: ``run.py --sections formats_extra``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))  # the layout writers

from bench_common import Case, Config, SectionResult  # noqa: E402

import grain_replay as gr  # noqa: E402

__all__ = ["LIMIT_TARGET", "run_formats_extra"]

LIMIT_TARGET = 0.9

# The timed reads are page-cached and run on the calling thread (tensorstore's on its own
# threads): the process's CPU time is their time on an idle machine, and unlike the wall
# clock it does not count the time the process waits for a core on a loaded one. ``--clock
# wall`` (and the suite, run.py) use the wall clock.
_CLOCK: list[Callable[[], float]] = [time.perf_counter]


def _arrays(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The suite's ``transitions`` records (525 B: 64-float observations), under D4RL's names
    as offline-RL .npz files, Vaults and torchrl buffers hold them."""
    rng = np.random.default_rng(seed)
    states = rng.standard_normal((n + 1, 64), dtype=np.float32)
    return {
        "actions": rng.integers(0, 18, n, dtype=np.int64),
        "next_observations": states[1:].copy(),
        "observations": states[:-1].copy(),
        "rewards": (rng.random(n, dtype=np.float32) < 0.05).astype(np.float32),
        "terminals": rng.random(n) < 0.001,
    }


def _write_stores(root: str, arrays: dict[str, np.ndarray]) -> dict[str, str]:
    from torchrl_fixture import write_dump

    n = len(arrays["rewards"])
    if os.path.isdir(root):
        shutil.rmtree(root)
    os.makedirs(root)
    paths = {"npz": os.path.join(root, "d.npz"), "npz-deflated": os.path.join(root, "c.npz")}
    # The .npy source on the same data: what a memory-mapped source reaches on this machine.
    paths["npy-reference"] = gr.write_npy(os.path.join(root, "npy"), arrays)
    np.savez(paths["npz"], **arrays)
    np.savez_compressed(paths["npz-deflated"], **arrays)
    # The same archive, its page cache dropped first and filled by the source's own faults
    # (as after a reboot or eviction): where the map's huge-page advice shows.
    paths["npz-faulted"] = paths["npz"]
    # Wrapped: the writer's cursor at a third, so every read goes through the reorder.
    paths["torchrl"] = write_dump(
        os.path.join(root, "rb"), arrays, cursor=n // 3, write_count=n + n // 3
    )
    try:
        from vault_fixture import write_vault

        rows = 8 if n % 8 == 0 else 1
        exp = {k: v.reshape(rows, n // rows, *v.shape[1:]) for k, v in arrays.items()}
        paths["vault"] = write_vault(os.path.join(root, "vault", "uid"), exp)
    except ImportError:  # tensorstore missing: the vault case is left out
        pass
    return paths


def _drop_page_cache(path: str) -> bool:
    """Writes ``path`` back and drops its page cache; False where the OS cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _paired(cfg: Config, steps: list[Callable[[int], Any]]) -> tuple[int, list[list[float]]]:
    """Times ``steps`` in alternation, one repeat of each in turn, so that load on a shared
    machine falls on all of them alike (their ratio is what is reported)."""
    for step in steps:  # warm-up, and the batches per repeat from the slowest step
        step(0)
    t0 = time.perf_counter()
    for i in range(5):
        for step in steps:
            step(i)
    per_step = (time.perf_counter() - t0) / (5 * len(steps))
    batches = max(1, min(cfg.max_batches, int(cfg.target_s / max(per_step, 1e-9))))
    times: list[list[float]] = [[] for _ in steps]
    clock = _CLOCK[0]
    for _ in range(cfg.repeats):
        for j, step in enumerate(steps):
            t = clock()
            for i in range(batches):
                step(i)
            times[j].append(clock() - t)
    return batches, times


def _case(
    cfg: Config, name: str, fmt: str, kind: str, batches: int, times: list[float], rec_bytes: int
) -> Case:
    return Case(
        f"formats_extra/transitions/{fmt}/{name}", "formats_extra", "transitions", fmt, fmt,
        name, kind, cfg.batch_size, rec_bytes, batches, times,
    )  # fmt: skip


def run_formats_extra(
    cfg: Config,
    stores: Any,
    res: SectionResult,
    log: Any,
    formats: frozenset[str] | None = None,
) -> None:
    n = cfg.transitions
    arrays = _arrays(n, cfg.seed)
    rec_bytes = sum(a[0].nbytes for a in arrays.values())
    paths = _write_stores(os.path.join(cfg.data_dir, "formats_extra"), arrays)
    rng = np.random.default_rng(1)
    batches = [
        rng.integers(0, n, cfg.batch_size).astype(np.int64) for _ in range(cfg.max_batches * 4)
    ]

    def pick(i: int) -> np.ndarray:
        return batches[i % len(batches)]

    for fmt, path in paths.items():
        if formats is not None and fmt not in formats:
            continue
        if fmt == "npz-faulted" and not _drop_page_cache(path):
            continue
        src = gr.open_source(path)
        src.read_batch(np.arange(min(n, 4096)))  # opened and decoded before timing
        # Page-cached: every page of the store touched once before the timed reads.
        src.read_batch(np.arange(n))
        if fmt == "torchrl":  # records are oldest first: the same rows, reordered
            start = n // 3
            mem = {k: np.concatenate([v[start:], v[:start]]) for k, v in arrays.items()}
        else:
            mem = arrays
        # The same leaves in RAM, in the source's order: the numpy gather limit.
        limit_arrays = [mem[k] for k in src.keys]

        def limit(i: int, arrs: list[np.ndarray] = limit_arrays) -> Any:
            idx = pick(i)
            return [a.take(idx, axis=0) for a in arrs]

        def read(i: int, s: Any = src) -> Any:
            return s.read_batch(pick(i), check=False)

        batches_per_repeat, (t_lim, t_read) = _paired(cfg, [limit, read])
        lim = res.add(
            _case(cfg, "numpy gather", fmt, "limit", batches_per_repeat, t_lim, rec_bytes)
        )
        got = res.add(
            _case(cfg, "read_batch", fmt, "source", batches_per_repeat, t_read, rec_bytes)
        )
        target = None if fmt == "npy-reference" else LIMIT_TARGET
        res.ratio(f"{fmt}: read_batch / numpy gather", got, lim, target, "vs limit")
        src.close()


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--transitions", type=int, default=0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument(
        "--formats",
        default="",
        help="comma-separated cases to run (npz,npz-faulted,npz-deflated,npy-reference,"
        "torchrl,vault); default all",
    )
    args = p.parse_args(argv)
    _CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(
            quick=args.quick,
            data_dir=tmp,
            out_dir=tmp,
            only=None,
            sections=("formats_extra",),
            image_records=0,
            transitions=args.transitions or (20_000 if args.quick else 1_000_000),
            repeats=args.repeats,
            batch_size=64 if args.quick else 256,
            target_s=0.01 if args.quick else 0.25,
            max_batches=20 if args.quick else 400,
        )
        res = SectionResult("formats_extra", log=lambda m: print(m, flush=True))
        formats = frozenset(args.formats.split(",")) if args.formats else None
        run_formats_extra(cfg, {}, res, print, formats)
    print(
        f"\nformats_extra, {cfg.transitions:,} transitions, batch {cfg.batch_size}, "
        f"{args.repeats} repeats (medians, {args.clock} time), {time.perf_counter() - t0:.0f}s"
    )
    for r in res.ratios:
        verdict = "" if r.passed is None else ("  pass" if r.passed else "  FAIL")
        print(f"  {r.name}: {r.value:.2f}x (target {r.target}){verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
