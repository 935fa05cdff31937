"""grain-replay demo: a synthetic replay in each format, streamed back through the pipeline."""

from __future__ import annotations

import argparse
import os
import textwrap
import time

import numpy as np

from grain_replay.cli.commands import fmt_bytes, size_on_disk

__all__ = ["cmd_demo"]


def _demo_tree(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n, 17), dtype=np.float32)
    return {
        "obs": obs,
        "action": rng.uniform(-1, 1, (n, 6)).astype(np.float32),
        "reward": rng.standard_normal(n, dtype=np.float32),
        "next_obs": np.roll(obs, -1, axis=0),
        "done": rng.random(n) < 0.001,
    }


def cmd_demo(args: argparse.Namespace) -> int:
    """Writes a synthetic replay in each format and streams shuffled batches back."""
    import grain_replay as gr

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    n, b = args.records, args.batch_size
    tree = _demo_tree(n)
    row_bytes = sum(a.itemsize * int(np.prod(a.shape[1:])) for a in tree.values())
    print(f"grain_replay {gr.__version__} demo: {n:,} transitions of {row_bytes} B, batch {b}")
    print(f"writing to {out}")
    paths = {}
    for fmt, name in (("hdf5", "replay.h5"), ("npy", "replay_npy"), ("zarr", "replay.zarr")):
        t = time.perf_counter()
        paths[fmt] = gr.write(os.path.join(out, name), tree, overwrite=True)
        dt = time.perf_counter() - t
        print(f"  wrote {fmt:<5} {fmt_bytes(size_on_disk(paths[fmt])):>10} in {dt:.2f} s")

    import jax

    from grain_replay.device.put import sharded_device_put
    from grain_replay.loading import make_data_loader

    devices = jax.devices()
    expected = (n // b) * b
    print(
        f"streaming 1 shuffled epoch per format through grain.DataLoader "
        f"(worker_count={args.workers}) -> sharded_device_put over {len(devices)} "
        f"{devices[0].platform} device(s)"
    )
    if expected != n:
        print(
            f"  {n - expected} of the {n:,} records do not fill a last batch of {b}: "
            f"drop_remainder=True (the default) drops them, so {expected:,} are expected"
        )
    for fmt, path in paths.items():
        src = gr.open_source(path)
        t = time.perf_counter()
        raw = src.read_batch(np.random.default_rng(0).integers(0, n, b * 200))
        read_rate = b * 200 / (time.perf_counter() - t)
        loader = make_data_loader(
            src, batch_size=b, seed=0, num_epochs=1, worker_count=args.workers
        )
        t = time.perf_counter()
        seen = 0
        first = 0.0
        with sharded_device_put(loader, prefetch=2) as batches:
            for batch in batches:
                if not seen:
                    jax.block_until_ready(batch)
                    first = time.perf_counter() - t
                seen += batch["reward"].shape[0]
            jax.block_until_ready(batch)
        dt = time.perf_counter() - t
        assert raw["obs"].shape == (b * 200, 17)
        status = "ok" if seen == expected else f"MISMATCH (expected {expected:,})"
        steady = (seen - b) / max(dt - first, 1e-9)
        print(
            f"  {fmt:<5} read_batch {read_rate:>11,.0f} rec/s | loader+device_put "
            f"{steady:>9,.0f} rec/s after a first batch in {first:.1f} s"
            f"{' (workers starting)' if args.workers else ''}; {seen:,} records [{status}]"
        )
        if seen != expected:
            return 1
    notes = [
        "read_batch: one vectorized read of random records into host memory. "
        "loader+device_put: the whole pipeline (shuffled batches, read in the loader's "
        "workers, put on every device as one sharded jax.Array per leaf)."
    ]
    if devices[0].platform == "cpu":
        notes.append(
            f"The {len(devices)} devices are fake CPU devices (XLA_FLAGS="
            "--xla_force_host_platform_device_count): each device put is a host-to-host "
            "copy on the same cores that the workers read with, so here the pipeline runs "
            "far below read_batch. On GPUs and TPUs the copies go to the devices and "
            "overlap with the reads."
        )
    dropped = f" (the {n - expected} that do not fill a batch dropped)" if expected != n else ""
    notes.append(
        f"done: each format delivered one shuffled epoch of {expected:,} records{dropped} "
        "as sharded jax.Arrays."
    )
    for note in notes:
        print(textwrap.fill(note, width=100))
    return 0
