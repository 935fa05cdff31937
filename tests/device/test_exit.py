"""Iterators and writers left open when a script ends: the process exits with 0.

A daemon thread still inside XLA at interpreter exit (the device puts of
``sharded_device_put``, a device writer's copies) aborted the process: rc 134,
``terminate called after throwing an instance of ''`` / ``FATAL: exception not rethrown``,
in about one run in ten to twenty. ``grain_replay.pipeline.shutdown`` closes what is
still open before jax's own exit handlers run. Each script below runs in fresh
interpreters, several at once; a hook the script registers first (so it runs last)
prints the package's threads still alive then.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr

REPO = Path(__file__).resolve().parents[2]
PARALLEL = 3  # interpreters at once (the CI machine has 2 cores)
RUN_TIMEOUT_S = 240.0

# Registered before anything else: atexit runs it last, after grain_replay's and jax's hooks.
_REPORT = """\
import atexit, sys, threading

def _report():
    ours = ("sharded_device_put", "grain_replay")
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith(ours))
    print("alive at exit:", alive, flush=True)

atexit.register(_report)
"""

DEVICE_PUT = (
    _REPORT
    + """
import jax
import grain_replay as gr

if __name__ == "__main__":
    path, workers, prefetch, resident = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    loader = gr.make_data_loader(
        gr.open_source(path), batch_size=64, shuffle=True, seed=0, num_epochs=None,
        worker_count=workers,
    )
    it = iter(loader)
    next(it)
    if resident == "1":  # windows of 4 batches: the default 64's gather compiles for seconds
        from grain_replay.device import resident as resident_module
        resident_module._MAX_WINDOW = 4
    d = gr.sharded_device_put(loader, prefetch=prefetch, resident=resident == "1")
    jax.block_until_ready(next(d))
    print("ok", flush=True)
"""
)

SAMPLING = (
    _REPORT
    + """
import jax
import grain_replay as gr

if __name__ == "__main__":
    loader = gr.make_data_loader(
        gr.open_source(sys.argv[1]), batch_size=64, worker_count=2,
        sampling=gr.UniformReplay(samples_per_insert=64.0),  # a rate limit: its publisher
    )
    it = iter(loader)
    next(it)
    d = gr.sharded_device_put(it)
    jax.block_until_ready(next(d))
    print("ok", flush=True)
"""
)

WRITER = (
    _REPORT
    + """
import jax.numpy as jnp
import grain_replay as gr

def block(i):
    return {"obs": jnp.full((16, 4), i, jnp.float32), "step": jnp.arange(16) + 16 * i}

if __name__ == "__main__":
    w = gr.ReplayWriter(sys.argv[1], format="npy")
    for i in range(8):
        w.append(block(i))
    w.flush()
    for i in range(8, 64):
        w.append(block(i))
    print("ok", w.committed, len(w), flush=True)
"""
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("exit") / "store")
    n = 4096
    gr.write(path, {"obs": np.random.default_rng(0).random((n, 32), np.float32),
                    "act": np.arange(n, dtype=np.int32)})  # fmt: skip
    return path


def _run(tmp_path: Path, script: str, args: list[str], devices: int, runs: int) -> list[Any]:
    """Runs ``script`` ``runs`` times (``PARALLEL`` at once) with ``devices`` CPU devices."""
    file = tmp_path / "script.py"
    file.write_text(script)
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])

    def one(_: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(file), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=RUN_TIMEOUT_S,
        )

    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(one, range(runs)))


def _assert_clean_exits(procs: list[Any]) -> None:
    bad = [
        f"rc {p.returncode}:\n{p.stderr[-2000:]}"
        for p in procs
        if p.returncode != 0 or "FATAL" in p.stderr or "terminate called" in p.stderr
    ]
    assert not bad, f"{len(bad)} of {len(procs)} runs failed at exit:\n" + "\n".join(bad)
    for p in procs:
        assert "ok" in p.stdout, p.stdout + p.stderr
        assert "alive at exit: []" in p.stdout, p.stdout  # every thread was stopped


@pytest.mark.parametrize(
    ("devices", "runs"),
    [
        (8, 3),
        (1, 2),
        pytest.param(8, 50, marks=pytest.mark.slow, id="8-50"),
        pytest.param(1, 50, marks=pytest.mark.slow, id="1-50"),
    ],
)
@pytest.mark.timeout(1800)
def test_a_sharded_device_put_left_open_exits_cleanly(
    tmp_path: Path, store: str, devices: int, runs: int
) -> None:
    # The script of the report: a loader iterator and a device iterator, neither closed.
    _assert_clean_exits(_run(tmp_path, DEVICE_PUT, [store, "0", "2", "0"], devices, runs))


def test_loader_workers_under_a_device_put_left_open_exit_cleanly(
    tmp_path: Path, store: str
) -> None:
    _assert_clean_exits(_run(tmp_path, DEVICE_PUT, [store, "2", "2", "0"], 8, 1))


def test_a_resident_iterator_left_open_exits_cleanly(tmp_path: Path, store: str) -> None:
    _assert_clean_exits(_run(tmp_path, DEVICE_PUT, [store, "0", "2", "1"], 8, 1))


def test_a_rate_limited_sampling_iterator_with_workers_left_open_exits_cleanly(
    tmp_path: Path,
) -> None:
    # One learner a store may publish its progress: a store of its own.
    path = tmp_path / "store"
    gr.write(str(path), {"obs": np.zeros((1024, 4), np.float32)})
    _assert_clean_exits(_run(tmp_path, SAMPLING, [str(path)], 8, 1))
    learners = tmp_path / "store.learners"
    assert not learners.exists() or not list(learners.iterdir())  # its progress withdrawn


def test_a_replay_writer_left_open_after_device_appends_exits_cleanly(tmp_path: Path) -> None:
    stores = [tmp_path / f"w{i}" for i in range(2)]
    procs = [_run(tmp_path, WRITER, [str(s)], 8, 1)[0] for s in stores]
    _assert_clean_exits(procs)
    for path, p in zip(stores, procs):
        committed, appended = map(int, p.stdout.split("ok", 1)[1].split()[:2])
        assert (committed, appended) == (128, 1024)
        # An unclosed writer's contract: what flush() committed is there, intact (its
        # __del__ may commit more if it is collected; at exit it is not, before as now).
        src = gr.open_source(str(path))
        assert committed <= len(src) <= appended
        rows = src.read_batch(np.arange(len(src)))
        np.testing.assert_array_equal(rows["step"], np.arange(len(src)))
        np.testing.assert_array_equal(rows["obs"][:, 0], np.arange(len(src)) // 16)
