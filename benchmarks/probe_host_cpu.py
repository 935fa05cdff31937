# ruff: noqa: E501  (an ad hoc probe)
"""Probe: the consuming process's CPU per batch on the host-fed path (issue 41 point 1).

``make_data_loader(worker_count=w)`` + ``sharded_device_put(sharding on one device)``,
batches consumed back to back (no training step, 4 in flight), batch 256, for ``mlp``
(transitions, 525 B a row) and ``conv`` (84x84x4 uint8 frames). Variants, timed in turns
(one window each per round, so that they see the same machine):

- ``leaves``: ``packed=False``, one put per leaf;
- ``packed``: ``packed=True``, the loader's batches as they are (the consumer packs them);
- ``laid``: ``packed=True`` and the loader lays each batch out as the packed buffer
  (``lay_out_lanes()``, what ``sharded_device_put`` asks of a loader on one device).

Per batch, medians of ``--repeats`` windows: the CPU of the main thread, of the variant's
``sharded_device_put`` producer thread (the loader's ``next``, the conversion, the put),
and, measured apart, the put of one packed buffer of a transfer's bytes and the unpack
program's dispatch (on CPU the put is a copy, the unpack a CPU program). ``host`` =
main + producer - put - unpack: the Python/numpy work that moving the bytes does not need.
The loader's workers are other processes: not counted.

    python benchmarks/probe_host_cpu.py [--only mlp|conv] [--workers 0,4] [--seconds S] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import jax
import numpy as np

sys.path.insert(0, "benchmarks")
from bench_device_replay import frames, transitions

import grain_replay as gr
from grain_replay.device.converter import Converter


class _AsIs:
    """The loader's iterator without ``lay_out_lanes``: its batches stay as read."""

    def __init__(self, it: Any) -> None:
        self.it = it

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        return next(self.it)

    def get_state(self) -> Any:
        return self.it.get_state()

    def set_state(self, s: Any) -> None:
        self.it.set_state(s)

    def close(self) -> None:
        self.it.close()


def _window(fed: Any, producer: int, k: int) -> dict[str, float]:
    main = time.pthread_getcpuclockid(threading.main_thread().ident)
    c0 = (time.clock_gettime(main), time.clock_gettime(producer))
    t = time.perf_counter()
    held = []
    for _ in range(k):
        held.append(next(fed))
        if len(held) > 4:
            jax.block_until_ready(held.pop(0))
    jax.block_until_ready(held)
    wall = time.perf_counter() - t
    out = {
        "main": time.clock_gettime(main) - c0[0],
        "producer": time.clock_gettime(producer) - c0[1],
        "wall": wall,
    }
    return {c: 1e6 * v / k for c, v in out.items()}


def _put_costs(batch: Any, sharding: Any, packed: bool) -> tuple[float, float, int]:
    """(put us, unpack us) per batch of the transfers, and the batches a transfer."""
    conv = Converter(sharding, packed=packed)
    group, _ = conv.transfers(batch)
    nbytes = sum(v.nbytes for v in batch.values()) * group
    buf = np.zeros((-(-nbytes // 512), 128), np.uint32)
    dev = jax.devices()[0]
    n, held = 200, []
    t = time.thread_time()
    for _ in range(n):
        held.append(jax.device_put(buf, dev))
        if len(held) > 4:
            jax.block_until_ready(held.pop(0))
    put = (time.thread_time() - t) / n / group
    unpack = 0.0
    if packed:
        checked = [conv._validated(batch) for _ in range(group)]
        lay = conv._layout([p for _, ps in checked for p in ps], tuple(t for t, _ in checked))
        d = jax.device_put(np.zeros((lay.rows, 128), np.uint32), lay.buffer_sharding)
        jax.block_until_ready(lay.unpack(d))
        t = time.thread_time()
        for _ in range(n):
            held.append(lay.unpack(d))
            if len(held) > 4:
                jax.block_until_ready(held.pop(0))
        unpack = (time.thread_time() - t) / n / group
    jax.block_until_ready(held)
    return 1e6 * put, 1e6 * unpack, group


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="")
    p.add_argument("--workers", default="0,4")
    p.add_argument("--variants", default="leaves,packed,laid")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"jax {jax.__version__} backend {jax.default_backend()}", flush=True)
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)),
        jax.sharding.PartitionSpec("data"),
    )
    with tempfile.TemporaryDirectory() as root:
        for name, tree in (("mlp", transitions(50_000)), ("conv", frames(2_000))):
            if args.only and args.only != name:
                continue
            gr.write(f"{root}/{name}", tree)
            src = gr.open_source(f"{root}/{name}")
            batch = src.read_batch(np.arange(256))
            costs = {
                False: _put_costs(batch, sharding, False),
                True: _put_costs(batch, sharding, True),
            }
            for w in [int(x) for x in args.workers.split(",")]:
                runs: dict[str, tuple[Any, int, float, bool]] = {}
                for v in args.variants.split(","):
                    it = iter(
                        gr.make_data_loader(
                            src, batch_size=256, num_epochs=None, seed=1, worker_count=w
                        )
                    )
                    before = {t.ident for t in threading.enumerate()}
                    fed = gr.sharded_device_put(
                        it if v == "laid" else _AsIs(it), sharding, packed=v != "leaves"
                    )
                    next(fed)
                    new = [
                        t
                        for t in threading.enumerate()
                        if t.ident not in before and t.name == "sharded_device_put"
                    ]
                    producer = time.pthread_getcpuclockid(new[0].ident)
                    first = _window(fed, producer, 16)
                    k = max(16, int(args.seconds / max(first["wall"] * 1e-6, 1e-6)))
                    runs[v] = (fed, producer, k, v != "leaves")
                wins: dict[str, list[dict[str, float]]] = {v: [] for v in runs}
                for _ in range(args.repeats):
                    for v, (fed, producer, k, _) in runs.items():
                        wins[v].append(_window(fed, producer, k))
                for v, (fed, _, _, packed) in runs.items():
                    fed.close()
                    med = {c: statistics.median(x[c] for x in wins[v]) for c in wins[v][0]}
                    put, unpack, group = costs[packed]
                    host = med["main"] + med["producer"] - put - unpack
                    print(
                        f"{name} w{w} {v:6s} group {group:2d}: us/batch main {med['main']:6.1f}"
                        f"  producer {med['producer']:6.1f}  wall {med['wall']:7.1f}"
                        f" | put {put:5.1f} unpack {unpack:5.1f} -> host {host:6.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
