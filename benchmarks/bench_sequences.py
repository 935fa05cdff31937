"""Section ``sequences``: SequenceDataSource batches against the in-memory gather of the same data.

Two cases, each over npy, HDF5, Zarr and zstd-compressed Zarr stores (page-cached):

* frame stacks: B anchors of ``offsets={"frame": [-3, -2, -1, 0]}`` over single
  uint8[84, 84] frames, against ``np.take`` of the same B records from an
  in-memory array of pre-stacked frames (N, 4, 84, 84) (target >= 0.8x);
* action chunks: B anchors with 2 observation and 16 action offsets, against the
  in-memory ``np.take`` of the same rows from arrays holding the steps
  (target >= 0.7x).

Both sides read the same anchors, from a pool of batches cycled through; the
repeats of the cases of a table are interleaved, so that load on a shared
machine drifts over all of them alike. Also
prints the bytes of the single-frame store against a store of pre-stacked
observations. Run alone: ``python benchmarks/bench_sequences.py [--quick]``, or
as the ``sequences`` section of ``benchmarks/run.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from bench_common import (  # noqa: E402
    Case,
    Config,
    SectionResult,
    files_under,
    time_steps,
)

import grain_replay as gr  # noqa: E402
from grain_replay.rl import SequenceDataSource  # noqa: E402

__all__ = ["run_sequences", "main"]

SECTION = "sequences"
STACK = [-3, -2, -1, 0]
OBS_OFFSETS = [-1, 0]
ACTION_OFFSETS = list(range(16))
FRAME_TARGET = 0.8
CHUNK_TARGET = 0.7
# name -> (format, write kwargs); targets apply to the uncompressed layouts.
LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "npy": ("npy", {}),
    "hdf5": ("hdf5", {}),
    "zarr": ("zarr", {}),
    "zarr-zstd": ("zarr", {"compression": "zstd"}),
}
POOL_BATCHES = 64
# Interleaved repeats per repeat of the configuration (see _interleaved).
INTERLEAVE = 5


def episode_flags(n: int, rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    """``terminated`` flags of episodes of random lengths in ``[lo, hi)``; the last one ends."""
    ends = np.cumsum(rng.integers(lo, hi, n // lo + 1))
    flags = np.zeros(n, bool)
    flags[ends[ends <= n] - 1] = True
    flags[-1] = True
    return flags


def frame_steps(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Atari-like single frames, 84 x 84 uint8, in episodes of 100 to 1000 steps."""
    rng = np.random.default_rng(seed)
    return {
        "frame": rng.integers(0, 256, (n, 84, 84), dtype=np.uint8),
        "terminated": episode_flags(n, rng, 100, 1000),
    }


def robot_steps(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A robot arm's steps: 14-dim state and action, in episodes of 50 to 500 steps."""
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n, 14)).astype(np.float32),
        "action": rng.standard_normal((n, 14)).astype(np.float32),
        "terminated": episode_flags(n, rng, 50, 500),
    }


def _store(root: str, dataset: str, layout: str, tree: dict[str, np.ndarray]) -> str:
    fmt, kw = LAYOUTS[layout]
    suffix = {"npy": "", "hdf5": ".h5", "zarr": ".zarr"}[fmt]
    path = os.path.join(root, f"{dataset}-{len(tree['terminated'])}-{layout}{suffix}")
    if not os.path.exists(path):
        gr.write(path, tree, format=fmt, **kw)
    return path


def _bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in files_under(path))


def _warm(path: str) -> None:
    for f in files_under(path):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def _interleaved(
    cfg: Config, dataset: str, cases: dict[str, tuple[str, str, int, Callable[[int], Any]]]
) -> dict[str, Case]:
    """Times several cases with their repeats interleaved, so load drift hits them alike.

    ``cases``: layout (``"layout:tag"`` for a second case of a layout) ->
    ``(method, kind, bytes per record, step)``. Each case is warmed up and
    sized on its own; then every repeat runs each case once, in turn. The
    repeats are ``INTERLEAVE`` times more and shorter than ``cfg`` says (same
    total time), so that a burst of load lands in few of them.
    """
    todo = {
        key: spec
        for key, spec in cases.items()
        if spec[1] != "source" or cfg.wants(f"{SECTION}/{dataset}/{key}/{spec[0]}")
    }
    sizes = {}
    step_no = 0
    short = dataclasses.replace(cfg, repeats=1, target_s=cfg.target_s / INTERLEAVE)
    for layout, (_, _, _, step) in todo.items():
        k, _ = time_steps(step, short)
        sizes[layout] = k
    times: dict[str, list[float]] = {layout: [] for layout in todo}
    for _ in range(cfg.repeats * INTERLEAVE):
        for layout, (_, _, _, step) in todo.items():
            t0 = time.perf_counter()
            for _ in range(sizes[layout]):
                step(step_no)
                step_no += 1
            times[layout].append(time.perf_counter() - t0)
    out = {}
    for key, (method, kind, nbytes, _) in todo.items():
        layout = key.split(":")[0]
        fmt = LAYOUTS[layout][0] if layout in LAYOUTS else "memory"
        out[key] = Case(
            f"{SECTION}/{dataset}/{layout}/{method}", SECTION, dataset, fmt, layout, method,
            kind, cfg.batch_size, nbytes, sizes[key], times[key],
        )  # fmt: skip
    return out


def run_sequences(
    cfg: Config,
    stores: dict[str, Any],
    res: SectionResult,
    log: Callable[[str], None],
    parts: tuple[str, ...] = ("frames", "chunks"),
) -> None:
    """Adds the cases and ratios of the section to ``res`` (``stores`` is not used).

    ``parts``: which of the two cases run, ``"frames"`` and/or ``"chunks"``.
    """
    del stores
    root = os.path.join(cfg.data_dir, SECTION)
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(cfg.seed)

    if "frames" in parts:
        _frame_stacks(cfg, root, rng, res, log)
    if "chunks" in parts:
        _action_chunks(cfg, root, rng, res)


def _frame_stacks(
    cfg: Config,
    root: str,
    rng: np.random.Generator,
    res: SectionResult,
    log: Callable[[str], None],
) -> None:
    n_frames = 2_048 if cfg.quick else 16_384
    b = cfg.batch_size
    frames = frame_steps(n_frames, cfg.seed)
    stack_bytes = len(STACK) * 84 * 84
    frame_ids = [rng.integers(0, n_frames, b) for _ in range(POOL_BATCHES)]
    paths = {layout: _store(root, "frames", layout, frames) for layout in LAYOUTS}
    view = SequenceDataSource(gr.open_source(paths["npy"]), {"frame": STACK})
    # Stacked as the view stacks them (edge padding at episode starts).
    prestacked = frames["frame"][view.sequence_steps(np.arange(len(view)))["frame"][0]]
    stacked_path = _store(root, "frames-prestacked", "npy", dict(frames, frame=prestacked))
    single, multi = _bytes(paths["npy"]), _bytes(stacked_path)
    res.extra["frame_stack_storage"] = {"single_bytes": single, "prestacked_bytes": multi}
    log(
        f"  frames store {single / 1e6:,.1f} MB vs pre-stacked {multi / 1e6:,.1f} MB "
        f"({multi / single:.2f}x)"
    )
    cases: dict[str, tuple[str, str, int, Callable[[int], Any]]] = {
        "memory": (
            "prestacked-gather", "limit", stack_bytes,
            lambda i: np.take(prestacked, frame_ids[i % POOL_BATCHES], axis=0),
        ),
    }  # fmt: skip
    frame_rows = [view.sequence_steps(i)["frame"][0].reshape(-1) for i in frame_ids]
    for layout, path in paths.items():
        _warm(path)
        src = gr.open_source(path)
        view = SequenceDataSource(src, {"frame": STACK})
        cases[layout] = (
            "SequenceDataSource", "source", stack_bytes,
            lambda i, v=view: v.read_batch(frame_ids[i % POOL_BATCHES]),
        )  # fmt: skip
        # The store's own read of the same B x 4 rows: what the view costs on top of it.
        cases[f"{layout}:rows"] = (
            "read_leaf-same-rows", "ceiling", stack_bytes,
            lambda i, s=src: s.read_leaf("frame", frame_rows[i % POOL_BATCHES]),
        )  # fmt: skip
    timed = _interleaved(cfg, "frames", cases)
    for case in timed.values():
        res.add(case)
    for layout in LAYOUTS:
        target = FRAME_TARGET if layout != "zarr-zstd" else None
        name = f"4-frame stacks: {layout} / pre-stacked gather"
        res.ratio(name, timed.get(layout), timed["memory"], target, "frames")
        res.ratio(
            f"4-frame stacks: {layout} / the store's read of the same rows",
            timed.get(layout), timed.get(f"{layout}:rows"), None, "frames vs store",
        )  # fmt: skip


def _steady_window_copy() -> None:
    """Times the steady state: a process loads the compiled window copy (numba) in the
    background on its first window read and reads in numpy until then; wait for it here."""
    try:
        from grain_replay.sources.reading import windows
    except ImportError:  # a tree from before the compiled copy (an A/B against it)
        return
    windows.loaded(wait=True)


def _action_chunks(cfg: Config, root: str, rng: np.random.Generator, res: SectionResult) -> None:
    n_steps = 20_000 if cfg.quick else 200_000
    b = cfg.batch_size
    steps = robot_steps(n_steps, cfg.seed)
    offsets = {"obs": OBS_OFFSETS, "action": ACTION_OFFSETS}
    chunk_bytes = 14 * 4 * (len(OBS_OFFSETS) + len(ACTION_OFFSETS))
    chunk_ids = [rng.integers(0, n_steps, b) for _ in range(POOL_BATCHES)]
    paths = {layout: _store(root, "robot", layout, steps) for layout in LAYOUTS}
    view = SequenceDataSource(gr.open_source(paths["npy"]), offsets)
    memory = {k: steps[k] for k in offsets}
    plans = [{k: r for k, (r, _) in view.sequence_steps(i).items()} for i in chunk_ids]

    def gather(i: int) -> dict[str, np.ndarray]:
        plan = plans[i % POOL_BATCHES]
        return {k: np.take(memory[k], plan[k], axis=0) for k in plan}

    cases = {"memory": ("gather-same-rows", "limit", chunk_bytes, gather)}
    _steady_window_copy()
    flat_plans = [{k: r.reshape(-1) for k, r in plan.items()} for plan in plans]
    for layout, path in paths.items():
        _warm(path)
        src = gr.open_source(path)
        view = SequenceDataSource(src, offsets)
        cases[layout] = (
            "SequenceDataSource", "source", chunk_bytes,
            lambda i, v=view: v.read_batch(chunk_ids[i % POOL_BATCHES]),
        )  # fmt: skip
        cases[f"{layout}:rows"] = (
            "read_leaf-same-rows", "ceiling", chunk_bytes,
            lambda i, s=src: {
                k: s.read_leaf(k, r) for k, r in flat_plans[i % POOL_BATCHES].items()
            },
        )  # fmt: skip
    timed = _interleaved(cfg, "robot", cases)
    for case in timed.values():
        res.add(case)
    for layout in LAYOUTS:
        target = CHUNK_TARGET if layout != "zarr-zstd" else None
        name = f"2 obs + 16 actions: {layout} / gather"
        res.ratio(name, timed.get(layout), timed["memory"], target, "chunks")
        res.ratio(
            f"2 obs + 16 actions: {layout} / the store's read of the same rows",
            timed.get(layout), timed.get(f"{layout}:rows"), None, "chunks vs store",
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small stores, short repeats")
    p.add_argument("--data", default=None, help="store directory (default: a temporary one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--only", choices=("frames", "chunks"), default=None,
        help="run only the frame stacks or only the action chunks (default: both)",
    )  # fmt: skip
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(
            quick=args.quick, data_dir=args.data or tmp, out_dir=tmp, only=None,
            sections=(SECTION,), transitions=0, image_records=0, batch_size=args.batch_size,
            repeats=args.repeats, target_s=0.02 if args.quick else 0.25,
            max_batches=20 if args.quick else 400,
        )  # fmt: skip
        res = SectionResult(SECTION, log=print)
        parts = ("frames", "chunks") if args.only is None else (args.only,)
        run_sequences(cfg, {}, res, print, parts)
    print("\n| ratio | value | target | pass |\n| --- | --- | --- | --- |")
    for r in res.ratios:
        target = "" if r.target is None else f">= {r.target}"
        passed = "" if r.passed is None else ("yes" if r.passed else "NO")
        print(f"| {r.name} | {r.value:.2f}x | {target} | {passed} |")
    for r in res.ratios:
        if r.name.startswith("2 obs + 16 actions") and r.name.endswith("/ gather") and r.target:
            verdict = "meets" if r.value >= r.target else "MISSES"
            print(
                f"action chunks, {r.name.split(':')[1].split('/')[0].strip()}: "
                f"{r.value:.2f}x the gather of the same rows, {verdict} the "
                f">= {r.target}x target"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
