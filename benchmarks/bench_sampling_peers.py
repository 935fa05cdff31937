"""The peers' side of bench_sampling.py: torchrl and flashbax prioritized replay on the same data.

Runs in its own virtual environment (torch and flashbax's own jax must not enter
grain_replay's): ``make bench-peers`` builds ``.venv-peers/`` and runs it. Reads
the transitions that ``bench_sampling.py`` wrote (a directory of ``.npy`` leaves),
fills each library's prioritized buffer with them, and times, per batch of
``--batch`` rows: prioritized sample + read, and a priority update. Writes JSON.
Needs numpy; each peer is skipped (with the reason in the JSON) when not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
from bench_common import time_calls

LEAVES = ("obs", "action", "reward", "next_obs", "done")


def _load(data: str) -> dict[str, np.ndarray]:
    return {k: np.load(os.path.join(data, f"{k}.npy"), mmap_mode="r") for k in LEAVES}


def _warm(path: str) -> None:
    """Reads every file under ``path`` once (torchrl's memmap: reads from the page cache)."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                while fh.read(1 << 24):
                    pass


def bench_torchrl(arrays: dict[str, np.ndarray], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, PrioritizedReplayBuffer

    torch.set_num_threads(1)
    n = len(arrays["obs"])
    scratch = tempfile.mkdtemp(prefix="torchrl_memmap_", dir=args.scratch)
    storage = LazyMemmapStorage(n, scratch_dir=scratch)
    rb = PrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, eps=1e-6, storage=storage, batch_size=args.batch
    )
    fill = time.perf_counter()
    chunk = 65536
    for i in range(0, n, chunk):
        part = {
            k: torch.from_numpy(np.ascontiguousarray(v[i : i + chunk])) for k, v in arrays.items()
        }
        rb.extend(TensorDict(part, batch_size=[len(part["obs"])]))
    fill_s = time.perf_counter() - fill
    _warm(scratch)
    last: dict[str, Any] = {}

    def sample() -> None:
        last["s"], last["info"] = rb.sample(return_info=True)  # rows, index and weights

    rng = np.random.default_rng(0)

    def update() -> None:
        rb.update_priority(
            last["info"]["index"],
            torch.from_numpy((rng.random(args.batch) + 0.01).astype(np.float32)),
        )

    sample()
    s = last["s"]
    assert s["obs"].shape == (args.batch, arrays["obs"].shape[1]), s["obs"].shape
    try:
        return {
            "sample_read_s": time_calls(sample, args.repeats, args.per_repeat),
            "update_s": time_calls(update, args.repeats, args.per_repeat),
            "fill_s": fill_s,
            "version": __import__("torchrl").__version__,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def bench_flashbax(arrays: dict[str, np.ndarray], args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import flashbax as fbx
    import jax

    n = len(arrays["obs"])
    add_batch = 1000 if n % 1000 == 0 else 1
    buffer = fbx.make_prioritised_flat_buffer(
        max_length=n,
        min_length=1,
        sample_batch_size=args.batch,
        add_sequences=True,
        add_batch_size=add_batch,
        priority_exponent=0.6,
        device="cpu",
    )
    state = buffer.init({k: np.asarray(v[0]) for k, v in arrays.items()})
    add = jax.jit(buffer.add, donate_argnums=0)
    steps = n // add_batch
    chunk = max(1, min(steps, 65536 // add_batch))
    fill = time.perf_counter()
    for t in range(0, steps, chunk):
        # rows [t*add_batch, ...) laid out as add_batch parallel sequences of `chunk` steps
        part = {
            k: np.ascontiguousarray(v[t * add_batch : (t + chunk) * add_batch]).reshape(
                add_batch, -1, *v.shape[1:]
            )
            for k, v in arrays.items()
        }
        state = add(state, part)
    jax.block_until_ready(state)
    fill_s = time.perf_counter() - fill
    sample = jax.jit(buffer.sample)
    set_priorities = jax.jit(buffer.set_priorities, donate_argnums=0)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 100_000))
    last: dict[str, Any] = {}

    def do_sample() -> None:
        last["s"] = jax.block_until_ready(sample(state, next(keys)))

    rng = np.random.default_rng(0)

    def do_update() -> None:
        nonlocal state
        prio = rng.random(args.batch).astype(np.float32) + 0.01
        state = jax.block_until_ready(set_priorities(state, last["s"].indices, prio))

    do_sample()
    return {
        "sample_read_s": time_calls(do_sample, args.repeats, args.per_repeat),
        "update_s": time_calls(do_update, args.repeats, args.per_repeat),
        "fill_s": fill_s,
        "note": "flat buffer: a sample reads transition pairs (first, second)",
        "jax": jax.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="directory of the .npy leaves")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--per-repeat", type=int, default=50)
    parser.add_argument("--scratch", default=None, help="where torchrl's memmap goes")
    args = parser.parse_args(argv)
    arrays = _load(args.data)
    result: dict[str, Any] = {"rows": len(arrays["obs"]), "batch": args.batch}
    for name, fn in (("torchrl", bench_torchrl), ("flashbax", bench_flashbax)):
        try:
            result[name] = fn(arrays, args)
        except ImportError as e:
            result[name] = {"skipped": f"not installed: {e}"}
        print(f"{name}: done", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
