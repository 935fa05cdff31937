"""ZarrDataSource over S3 (a local moto server) against zarr-python's own reads, same run.

Usage: .venv/bin/python benchmarks/bench_s3.py [--n 100000] [--batch-size 256] [--repeats 5]

Starts moto's S3 server in a child process on 127.0.0.1 (its own interpreter
lock), uploads a 525-byte-transition store (obs f32[64], action i64, reward f32,
next_obs f32[64], done bool) in two compressed layouts, and times one batch of
random records read by

* ``gr read_batch`` cold: a zero-byte chunk cache, so every batch fetches every
  chunk it touches (the first epoch, or a store far larger than the cache), with
  the default ``max_concurrency`` (64) and with zarr's 10;
* ``gr read_batch`` steady: the default cache (it grows to fit a store of up to
  1/32 of RAM) after one pass over the store (the store's decoded size fits),
  and with a 16 MiB cache (it does not);
* ``zarr oindex``: ``arr.oindex[sorted unique idx]`` per leaf, with the plain
  storage options a user passes, and with the options grain_replay adds;
* ``zarr arr[i]``: one read per record per leaf (timed on a subset of each
  batch and scaled to the batch size; the table says so).

Requests are counted at the wire, by a counting HTTP proxy in front of the
server, in a separate untimed pass. Times are medians over ``--repeats``; the
repeats interleave the methods, so a change of load shifts them alike.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers")
)

import grain_replay as gr
from grain_replay import remote as remote_lib

BUCKET = "bench"


def make_tree(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((n, 64)).astype(np.float32),
        "action": rng.integers(0, 18, n).astype(np.int64),
        "reward": rng.standard_normal(n).astype(np.float32),
        "next_obs": rng.standard_normal((n, 64)).astype(np.float32),
        "done": rng.random(n) < 0.01,
    }


def upload_dir(server: Any, local: str, key: str) -> str:
    client = server.client()
    files = []
    for root, _, names in os.walk(local):
        for name in names:
            full = os.path.join(root, name)
            files.append((full, f"{key}/{os.path.relpath(full, local)}"))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda f: client.upload_file(f[0], BUCKET, f[1]), files))
    return f"s3://{BUCKET}/{key}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--row-subset", type=int, default=32, help="rows timed for arr[i]")
    parser.add_argument("--warm-batches", type=int, default=20, help="batches per steady repeat")
    args = parser.parse_args()

    import zarr
    from s3_server import HTTPProxy, S3Server

    n, bs = args.n, args.batch_size
    tree = make_tree(n)
    rng = np.random.default_rng(1)

    def new_batch() -> np.ndarray:
        return rng.choice(n, bs, replace=False)

    print(f"# ZarrDataSource over S3 (moto on 127.0.0.1), N={n:,}, batch {bs}, 525 B records")
    t0 = time.time()
    with S3Server(subprocess=True) as server, HTTPProxy(server.port) as proxy:
        server.create_bucket(BUCKET)
        plain = server.storage_options()  # what a user passes
        counted = server.storage_options()
        counted["client_kwargs"] = dict(counted["client_kwargs"], endpoint_url=proxy.endpoint_url)
        rows: list[tuple[str, ...]] = []
        with tempfile.TemporaryDirectory() as tmp:
            layouts = {
                "zstd, default 64 KiB chunks": {"compression": "zstd"},
                "zstd, chunk_rows=1024": {"compression": "zstd", "chunk_rows": 1024},
            }
            for li, (layout, kw) in enumerate(layouts.items()):
                local = gr.write_zarr(os.path.join(tmp, f"t{li}.zarr"), tree, **kw)
                t = time.time()
                url = upload_dir(server, local, f"t{li}.zarr")
                group = zarr.open_group(local, mode="r")
                chunks = {k: group[k].chunks[0] for k in tree}
                print(
                    f"\n## {layout}: rows per chunk {chunks}; "
                    f"{sum(len(f) for _, _, f in os.walk(local))} objects, "
                    f"uploaded in {time.time() - t:.1f}s"
                )
                rows.extend(bench_layout(layout, url, tree, plain, counted, proxy, args, new_batch))
        print_table(rows, bs)
    print(f"\nelapsed {time.time() - t0:.0f}s")


Reader = Callable[[np.ndarray], Any]


class Case:
    """One way of reading a batch: a reader for timing, one for counting at the wire."""

    def __init__(
        self,
        name: str,
        timed: Reader,
        counted: Reader,
        *,
        per_call: int = 1,
        scale: float = 1.0,
        note: str = "",
    ):
        self.name, self.timed, self.counted = name, timed, counted
        self.per_call, self.scale, self.note = per_call, scale, note
        self.times_ms: list[float] = []
        self.counts: dict[str, Any] = {}

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) * self.scale

    def run_once(self, new_batch: Callable[[], np.ndarray]) -> None:
        batches = [new_batch() for _ in range(self.per_call)]
        t = time.perf_counter()
        for idx in batches:
            self.timed(idx)
        self.times_ms.append((time.perf_counter() - t) * 1e3 / self.per_call)

    def count(self, proxy: Any, new_batch: Callable[[], np.ndarray]) -> None:
        self.counted(new_batch())  # opens the store: metadata requests are not the batch's
        proxy.reset_counts()
        with proxy.counting() as c:
            self.counted(new_batch())
        self.counts = {
            "GET": c["GET"] * self.scale,
            "HEAD": c["HEAD"] * self.scale,
            "inflight": proxy.max_in_flight,
        }


def bench_layout(
    layout: str,
    url: str,
    tree: dict[str, np.ndarray],
    plain: dict[str, Any],
    counted: dict[str, Any],
    proxy: Any,
    args: Any,
    new_batch: Callable[[], np.ndarray],
) -> list[tuple[str, ...]]:
    import zarr

    bs, sub = args.batch_size, args.row_subset
    keys = list(tree)
    tuned = remote_lib.effective_storage_options(url, plain)
    tuned_counted = remote_lib.effective_storage_options(url, counted)

    def gr_reader(opts: dict[str, Any], cache_bytes: int = 0, **kw: Any) -> Reader:
        src = gr.ZarrDataSource(url, storage_options=opts, cache_bytes=cache_bytes, **kw)
        if cache_bytes:  # one pass over the store first, as the first epoch does
            for start in range(0, len(src), 4096):
                src.read_batch(np.arange(start, min(len(src), start + 4096)))
        return src.read_batch

    def oindex_reader(opts: dict[str, Any]) -> Reader:
        group = zarr.open_group(url, mode="r", storage_options=opts)
        arrays = {k: group[k] for k in keys}

        def read(idx: np.ndarray) -> dict[str, np.ndarray]:
            uniq, inverse = np.unique(idx, return_inverse=True)
            return {k: a.oindex[uniq][inverse] for k, a in arrays.items()}

        return read

    def row_reader(opts: dict[str, Any]) -> Reader:
        group = zarr.open_group(url, mode="r", storage_options=opts)
        arrays = {k: group[k] for k in keys}

        def read(idx: np.ndarray) -> dict[str, np.ndarray]:
            return {k: np.stack([a[int(i)] for i in idx[:sub]]) for k, a in arrays.items()}

        return read

    wb = args.warm_batches
    decoded = sum(a.nbytes for a in tree.values())
    fits = min(1.0, (16 << 20) / decoded)
    cases = [
        Case("gr read_batch, cold (cache_bytes=0)", gr_reader(plain), gr_reader(counted)),
        Case(
            "gr read_batch, cold, max_concurrency=10 (zarr's)",
            gr_reader(plain, max_concurrency=10),
            gr_reader(counted, max_concurrency=10),
        ),
        Case(
            "gr read_batch, steady (default cache)",
            gr_reader(plain, 128 << 20),
            gr_reader(counted, 128 << 20),
            per_call=wb,
            note=f"after one pass over the store; its decoded {decoded / 1e6:.1f} MB fit",
        ),
        Case(
            "gr read_batch, steady (16 MiB cache)",
            gr_reader(plain, 16 << 20),
            gr_reader(counted, 16 << 20),
            per_call=wb,
            note=f"after one pass over the store; {fits:.0%} of it fits",
        ),
        Case(
            "zarr oindex[unique idx] per leaf, plain storage_options",
            oindex_reader(plain),
            oindex_reader(counted),
        ),
        Case(
            "zarr oindex[unique idx] per leaf, grain_replay's s3fs defaults",
            oindex_reader(tuned),
            oindex_reader(tuned_counted),
        ),
        Case(
            "zarr arr[i] per record per leaf, plain storage_options",
            row_reader(plain),
            row_reader(counted),
            scale=bs / sub,
            note=f"timed and counted on {sub} of the {bs} records, x{bs / sub:g}",
        ),
    ]
    idx = new_batch()
    for case in cases:  # same values everywhere, and every store opened before timing
        got = case.timed(idx)
        for k in keys:
            want = tree[k][idx[:sub]] if case.scale != 1 else tree[k][idx]
            np.testing.assert_array_equal(got[k], want, err_msg=case.name)
    # Repeats interleave the cases, so that a change of load on the machine
    # shifts every case alike.
    for _ in range(args.repeats):
        for case in cases:
            case.run_once(new_batch)
    for case in cases:
        case.count(proxy, new_batch)

    best = min(c.median_ms for c in cases if c.name.startswith("zarr"))
    out = []
    for c in cases:
        reps = [round(t * c.scale, 1) for t in c.times_ms]
        print(f"  {c.name}: {c.median_ms:,.1f} ms/batch, repeats {reps}, {c.counts}")
        out.append(
            (
                layout,
                c.name,
                f"{c.median_ms:,.1f}",
                f"{bs / c.median_ms * 1e3:,.0f}",
                f"{c.counts['GET']:,.0f}",
                f"{c.counts['HEAD']:,.0f}",
                str(c.counts["inflight"]),
                f"{best / c.median_ms:,.1f}x",
                c.note,
            )
        )
    return out


def print_table(rows: list[tuple[str, ...]], bs: int) -> None:
    head = (
        "layout",
        "method",
        "ms / batch (median)",
        "records/s",
        "GET / batch",
        "HEAD / batch",
        "max in flight",
        "vs best zarr baseline",
        "note",
    )
    print(f"\n| {' | '.join(head)} |")
    print(f"|{'|'.join(' --- ' for _ in head)}|")
    for r in rows:
        print(f"| {' | '.join(r)} |")


if __name__ == "__main__":
    main()
