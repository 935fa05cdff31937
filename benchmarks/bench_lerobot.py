"""LeRobotDataSource through make_data_loader vs LeRobotDataset through a torch DataLoader.

Batches of 256 frames, shuffled, the same number of workers on both sides, on the same
datasets (written by LeRobot's own writer when the lerobot venv is given, else by the
test fixture writer and then only this side is timed): numeric columns only, and with one
96x96 camera; each with and without ``delta_timestamps``. Prints frames/s (medians of the
repeats) and the ratios measured in this run; targets: >= 5x numeric, >= 2x with video.

Usage: python benchmarks/bench_lerobot.py [--peer-python .venv-lerobot/bin/python]
       [--workers 2] [--repeats 3] [--quick] [--keep DIR]
(``make bench-lerobot`` creates the lerobot venv and passes it.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from bench_common import PeerError, run_peer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grain_replay as gr  # noqa: E402

BATCH = 256
WARMUP = 4
NUMERIC_TARGET = 5.0
VIDEO_TARGET = 2.0
CAM = "observation.images.cam0"
CHUNK = [round(0.1 * i, 1) for i in range(16)]  # 16 future actions at 10 fps
DELTAS: dict[str, dict[str, list[float]] | None] = {
    "frames": None,
    "numeric-delta": {"observation.state": [-0.1, 0.0], "action": CHUNK},
    "video-delta": {CAM: [-0.1, 0.0], "observation.state": [-0.1, 0.0], "action": CHUNK},
}


def write(root: str, peer: str | None, episodes: int, length: int, cameras: int) -> str:
    if peer:
        script = os.path.join(ROOT, "tests", "helpers", "lerobot_peer.py")
        cmd = [peer, script, "write", root, "--episodes", str(episodes), "--length", str(length)]
        cmd += ["--cameras", str(cameras), "--size", "96"]
        run_peer(cmd[0], cmd[1], cmd[2:], timeout=1800)
        return "LeRobotDataset.create + add_frame + save_episode (libsvtav1, g=2)"
    sys.path.insert(0, ROOT)
    from tests.helpers.lerobot_fixture import write_dataset

    cams = {CAM: (96, 96)} if cameras else {}
    write_dataset(root, [length + e for e in range(episodes)], cameras=cams)
    return "test fixture writer (libx264, g=2)"


def ours(root: str, delta: Any, workers: int, batches: int, repeats: int, **kw: Any) -> list[float]:
    src = gr.LeRobotDataSource(root, delta_timestamps=delta, **kw)
    loader = gr.make_data_loader(
        src, batch_size=BATCH, shuffle=True, num_epochs=None, worker_count=workers
    )
    it = iter(loader)
    for _ in range(WARMUP):  # workers started and their read-ahead buffers in steady state
        next(it)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(batches):
            next(it)
        rates.append(batches * BATCH / (time.perf_counter() - t))
    del it, loader
    return rates


def peer_rates(
    peer: str, root: str, delta: Any, workers: int, batches: int, repeats: int, backend: str
) -> list[float]:
    cmd = [peer, os.path.join(ROOT, "benchmarks", "bench_lerobot_peer.py"), root]
    cmd += ["--batches", str(batches), "--workers", str(workers), "--repeats", str(repeats)]
    cmd += ["--backend", backend]
    if delta is not None:
        cmd += ["--delta", json.dumps(delta)]
    try:
        return list(json.loads(run_peer(cmd[0], cmd[1], cmd[2:], timeout=3600))["frames_per_s"])
    except PeerError as e:
        print(f"  LeRobot with video_backend={backend!r} failed: {e}", flush=True)
        return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peer-python", default=os.environ.get("LEROBOT_PYTHON"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small datasets, few batches")
    p.add_argument("--keep", default=None, help="write the datasets here and keep them")
    a = p.parse_args()
    peer = a.peer_python if a.peer_python and os.access(a.peer_python, os.X_OK) else None
    tmp = a.keep or tempfile.mkdtemp(prefix="bench_lerobot_")
    eps, length = (4, 120) if a.quick else (20, 200)
    veps, vlength = (3, 90) if a.quick else (8, 128)
    # Timed batches per repeat (after WARMUP): many more than the loaders buffer ahead.
    nb, vb = (8, 2) if a.quick else (32, 4)
    rows = []
    try:
        num_root, vid_root = os.path.join(tmp, "numeric"), os.path.join(tmp, "video")
        if not os.path.exists(num_root):
            how = write(num_root, peer, eps, length, cameras=0)
            write(vid_root, peer, veps, vlength, cameras=1)
        else:
            how = "kept datasets"
        print(f"datasets: {how}; workers={a.workers}, batch={BATCH}, repeats={a.repeats}")
        cases = [
            ("numeric", num_root, "frames", nb, {}, NUMERIC_TARGET),
            ("numeric", num_root, "numeric-delta", nb, {}, NUMERIC_TARGET),
            ("video 96x96", vid_root, "frames", vb, {"frame_cache_bytes": 0}, VIDEO_TARGET),
            ("video 96x96", vid_root, "video-delta", vb, {"frame_cache_bytes": 0}, VIDEO_TARGET),
            ("video 96x96 cached", vid_root, "frames", vb, {}, None),
        ]
        for data, root, dname, batches, kw, target in cases:
            delta = DELTAS[dname]
            mine = statistics.median(ours(root, delta, a.workers, batches, a.repeats, **kw))
            row: dict[str, Any] = {"case": f"{data} / {dname}", "ours": mine, "target": target}
            if peer:
                backends = ["pyav", "torchcodec"] if "video" in data else ["pyav"]
                for backend in backends:
                    got = peer_rates(peer, root, delta, a.workers, batches, a.repeats, backend)
                    if got:
                        row[f"lerobot[{backend}]"] = statistics.median(got)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if a.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| case | grain_replay frames/s | LeRobot frames/s | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        theirs = {k: v for k, v in row.items() if k.startswith("lerobot[")}
        peer_txt = ", ".join(f"{v:,.0f} ({k[8:-1]})" for k, v in theirs.items()) or "-"
        ratio = ", ".join(f"{row['ours'] / v:.1f}x" for v in theirs.values()) or "-"
        target = f">= {row['target']:.0f}x" if row["target"] else "-"
        print(f"| {row['case']} | {row['ours']:,.0f} | {peer_txt} | {ratio} | {target} |")
    print("(machine shared with other jobs: ratios are from this run, absolute rates are not.)")


if __name__ == "__main__":
    main()
