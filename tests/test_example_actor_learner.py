"""examples/actor_learner.py at toy size: the last line, the plot, the store, --resume."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import grain_replay as gr

pytest.importorskip("gymnasium")
pytest.importorskip("orbax.checkpoint")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "actor_learner.py"
LAST = re.compile(r"final mean return \(last 20 episodes\): (\S+)")
TOY = "--actors 2 --hidden 32 --min-size 200 --flush-every 16 --publish-every 8".split()


def _cmd(store: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), *TOY, "--store", str(store), *extra]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(SCRIPT.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _final(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    match = LAST.fullmatch(last)
    assert match, f"last line is {last!r}"
    return float(match.group(1))


def _result(stdout: str) -> dict[str, object]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _episodes(store: Path) -> list[dict[str, float]]:
    out = []
    for path in sorted((store / "episodes").glob("actor-*.jsonl")):
        out.extend(json.loads(line) for line in path.read_text().splitlines())
    return out


def test_actor_learner_runs_plots_and_prints_the_last_line(tmp_path: Path) -> None:
    store, png = tmp_path / "run", tmp_path / "returns.png"
    done = _run(_cmd(store, "--env-steps", "2000", "--seed", "3", "--plot", str(png)))
    final = _final(done.stdout)
    episodes = _episodes(store)
    assert len({e["actor"] for e in episodes}) == 2  # both actors played and logged
    last20 = sorted(episodes, key=lambda e: (e["env_step"], e["actor"]))[-20:]
    assert final == pytest.approx(np.mean([e["return"] for e in last20]))
    assert all(8 <= e["return"] <= 500 for e in episodes)  # CartPole-v1's range
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    replay = gr.open_source(store / "replay")
    assert sorted(m.writer_id for m in replay.writers) == ["actor-0", "actor-1"]
    assert [m.committed for m in replay.writers] == [1000, 1000]  # every env step committed
    result = _result(done.stdout)
    assert result["updates"] == (2000 - 200) * 32 // 64
    # The actors declare the limit in the store: they hold from their first row, before
    # the learner exists, at min_size + tolerance / r = 200 + 640 / 32 rows (tolerance
    # 10 % of min_size * r), plus a flush of 16 rows each; the learner's prefetched
    # batches (2 of 64 rows, tolerance 640) let in at most as many.
    assert gr.RateLimit.of_store(store / "replay") == gr.RateLimit(200, 32.0)
    assert 200 <= result["first_batch_committed_rows"] <= 200 + (128 + 640) / 32 + 2 * 16
    assert (store / "ckpt" / str(result["updates"])).is_dir()  # the last checkpoint


def test_actor_learner_refuses_an_existing_run_without_resume(tmp_path: Path) -> None:
    store = tmp_path / "run"
    (store / "replay").mkdir(parents=True)
    done = subprocess.run(
        _cmd(store, "--env-steps", "2000"), capture_output=True, text=True, timeout=120, env=_env()
    )
    assert done.returncode != 0
    assert "--resume" in done.stderr and str(store) in done.stderr


@pytest.mark.slow  # two runs of the example: 202 s here at a load average of ~23 on 2 cores
def test_actor_learner_resumes_after_the_learner_is_killed(tmp_path: Path) -> None:
    store = tmp_path / "run"
    cmd = _cmd(store, "--env-steps", "12000", "--ckpt-every", "150", "--seed", "1")
    learner = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + 180
        while not any(p.name.isdigit() for p in (store / "ckpt").glob("*")):
            assert learner.poll() is None, learner.stdout.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        learner.send_signal(signal.SIGKILL)
        learner.wait(timeout=30)
    finally:
        if learner.poll() is None:
            learner.kill()
        learner.wait()
    # The actors notice that their learner is gone and stop; their ids are free again.
    deadline = time.monotonic() + 60
    replay = store / "replay"
    while _held(replay):
        assert time.monotonic() < deadline, "the actors outlived their learner"
        time.sleep(0.2)
    killed_at = sum(m.committed for m in gr.open_source(replay).writers)
    assert killed_at < 12000  # killed mid-run: the actors had more to play

    done = _run([*cmd, "--resume"])
    match = re.search(r"resumed from the checkpoint at update (\d+)", done.stdout)
    assert match and int(match.group(1)) >= 150, done.stdout[-2000:]
    result = _result(done.stdout)
    assert result["resumed_from"] == int(match.group(1))
    assert result["updates"] == (12000 - 200) * 32 // 64  # the same run, finished
    assert [m.committed for m in gr.open_source(replay).writers] == [6000, 6000]
    _final(done.stdout)


def _held(replay: Path) -> bool:
    """Whether any actor still holds its writer id (a live process has its lock)."""
    import fcntl

    for lock in replay.glob("writers/*/lock"):
        with open(lock, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    return False


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_actor_learner", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EPISODES = [
    {"env_step": 40 * i, "return": float(10 + i % 7 * 60), "actor": i % 2} for i in range(60)
]


@pytest.mark.parametrize("matplotlib", [True, False], ids=["matplotlib", "pillow"])
def test_actor_learner_plot_is_a_png_with_or_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, matplotlib: bool
) -> None:
    if matplotlib:
        pytest.importorskip("matplotlib")
    else:
        pytest.importorskip("PIL")
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    png = tmp_path / "returns.png"
    _example().plot_returns(str(png), EPISODES, "toy")
    from PIL import Image

    with Image.open(png) as image:
        assert image.format == "PNG"
        assert image.size == (700, 400)
        pixels = np.asarray(image.convert("L"))
    assert (pixels < 128).mean() > 0.002  # something was drawn on the white page


def test_actor_learner_mean_of_the_last_20_episodes() -> None:
    module = _example()
    assert module.mean_last(EPISODES) == pytest.approx(
        np.mean([e["return"] for e in EPISODES[-20:]])
    )
    assert module.mean_last([]) == 0.0
    assert [module.actor_quota(10, 3, k) for k in range(3)] == [4, 3, 3]


def test_actor_learner_epsilon_falls_to_final_then_to_end() -> None:
    eps = _example().epsilon_at
    quota = 1000  # exploration over the first 160 steps
    assert eps(0, quota, 0.16, 0.04, 0.01) == 1.0
    assert eps(80, quota, 0.16, 0.04, 0.01) == pytest.approx(0.52)
    assert eps(160, quota, 0.16, 0.04, 0.01) == pytest.approx(0.04)
    assert eps(580, quota, 0.16, 0.04, 0.01) == pytest.approx(0.025)
    assert eps(999, quota, 0.16, 0.04, 0.01) == pytest.approx(0.01, abs=1e-4)
    assert eps(5000, quota, 0.16, 0.04, 0.01) == pytest.approx(0.01)  # held past the quota
    curve = [eps(s, quota, 0.16, 0.04, 0.01) for s in range(quota)]
    assert (np.diff(curve) <= 0).all()
    assert eps(500, quota, 0.16, 0.04, 0.04) == pytest.approx(0.04)  # end = final: the zoo's


def test_actor_learner_flush_waits_while_the_learner_runs(tmp_path: Path) -> None:
    import threading

    module = _example()
    path = str(tmp_path / "replay")
    limit = gr.RateLimit(min_size=4, samples_per_insert=1.0, tolerance=4)
    w = gr.ReplayWriter(path, "npy", capacity=100, writer_id="actor-0", rate_limit=limit,
                        rate_limit_timeout=0.05)  # fmt: skip
    w.append({"x": np.zeros(8, np.float32)})
    assert module.flush(w, os.getppid()) is True  # 1 * (8 - 4) - 0 <= 4: not held
    w.append({"x": np.zeros(1, np.float32)})  # 1 * (9 - 4) - 0 > 4: held, no learner yet
    # A learner that is gone (the actor's parent changed) ends the wait: False.
    assert module.flush(w, -1) is False and w.committed == 8
    # While the learner runs, the flush waits for it: one batch drawn lets the row in.
    it = iter(
        gr.make_data_loader(
            gr.open_source(path), batch_size=2, num_epochs=None,
            sampling=gr.UniformReplay(rate_limit=limit),
        )
    )  # fmt: skip
    timer = threading.Timer(0.2, next, (it,))
    timer.start()
    try:
        assert module.flush(w, os.getppid()) is True and w.committed == 9
    finally:
        timer.join()
        it.close()
        w.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--min-size", "-1"], "--min-size must be 0 or more, got -1"),
        (["--eval-every", "-5"], "--eval-every must be 0 (none) or positive, got -5"),
        (["--eval-episodes", "0"], "--eval-episodes must be positive, got 0"),
        (["--eval-every", "0"], "--keep-best needs evaluations"),
        (["--end-epsilon", "1.5"], "--end-epsilon must be in [0, 1], got 1.5"),
        (["--final-epsilon", "-0.1"], "--final-epsilon must be in [0, 1], got -0.1"),
        (["--env-steps", "1000", "--min-size", "1000"], "must be below --env-steps 1000"),
    ],
)
def test_actor_learner_refuses_bad_flags(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _example().parse_args(flags)
    assert message in capsys.readouterr().err


def _controller(module: ModuleType, weights: list[float], hidden: int = 4) -> dict[str, np.ndarray]:
    """Q parameters of a fixed linear controller: push right iff ``weights . obs > 0``."""
    params = {k: np.zeros_like(v) for k, v in module.init_params(0, hidden).items()}
    w = np.array(weights, np.float32)
    params["w1"][:, 0], params["w1"][:, 1] = w, -w
    params["w2"][0, 0] = params["w2"][1, 1] = 1.0
    params["w3"][0, 1] = params["w3"][1, 0] = 1.0  # Q(right) = relu(z), Q(left) = relu(-z)
    return params


def test_actor_learner_greedy_return_scores_the_greedy_policy() -> None:
    module = _example()
    balance = _controller(module, [0.0, 0.0, 10.0, 1.0])  # pole angle and its velocity
    assert module.greedy_return(balance, 3, seed=0) == 500.0  # CartPole-v1's cap, every time
    left = _controller(module, [0.0, 0.0, 0.0, 0.0])
    left["b3"][0] = 1.0  # always push left: the pole falls within a few steps
    assert module.greedy_return(left, 3, seed=0) < 20
    # A weaker controller: its score depends on the episodes, which the seed fixes.
    weak = _controller(module, [0.0, 0.0, 1.0, 1.0])
    scores = [module.greedy_return(weak, 3, seed=0) for _ in range(2)]
    assert scores[0] == scores[1] and 100 < scores[0] < 500


def test_actor_learner_keep_best_switches_the_actors_to_the_best_and_back(
    tmp_path: Path,
) -> None:
    import argparse

    module = _example()
    balance = _controller(module, [0.0, 0.0, 10.0, 1.0])  # scores 500
    left = _controller(module, [0.0, 0.0, 0.0, 0.0])
    left["b3"][0] = 1.0  # scores ~10
    args = argparse.Namespace(eval_episodes=2, seed=0, keep_best=True)
    path = tmp_path / "params.npz"
    module.publish_params(path, left, 0)
    first = {"params": left, "score": np.array(-1.0), "playing": np.array(False)}
    # The newest parameters beat the best so far: they are the best, actors follow them.
    best = module._evaluate(args, {"params": balance, "best": first}, 1000, path)
    assert float(best["score"]) == 500.0 and not best["playing"]
    np.testing.assert_array_equal(best["params"]["w1"], balance["w1"])
    # Newer ones score worse: the actors get the best parameters, published now.
    best = module._evaluate(args, {"params": left, "best": best}, 2000, path)
    assert best["playing"] and float(best["score"]) == 500.0
    published, stamp = module.load_params(path)
    np.testing.assert_array_equal(published["w1"], balance["w1"])
    assert stamp == 2000
    # As good as the best again: it becomes the best, the actors follow the newest.
    best = module._evaluate(args, {"params": balance, "best": best}, 3000, path)
    assert not best["playing"]
    # --no-keep-best: the actors always follow the newest parameters.
    args.keep_best = False
    best = module._evaluate(args, {"params": left, "best": best}, 4000, path)
    assert not best["playing"] and float(best["score"]) == 500.0
    assert module.load_params(path)[1] == 2000  # nothing published by the evaluation
