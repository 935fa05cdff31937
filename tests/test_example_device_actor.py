"""examples/device_actor.py at toy size: JAX CartPoles saved from the device to a bounded store."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from repo_scripts import EXAMPLES, load_script

import grain_replay as gr

SCRIPT = EXAMPLES / "device_actor.py"


@pytest.fixture(scope="module")
def device_actor() -> ModuleType:
    return load_script(SCRIPT)


def test_device_actor_saves_every_step_to_a_bounded_store(
    device_actor: ModuleType, tmp_path: Path
) -> None:
    store = tmp_path / "replay"
    argv = "--envs 64 --steps 60 --capacity 1000 --flush-every 25".split()
    result = device_actor.main([*argv, "--store", str(store)])
    assert result["rows"] == 1000 and result["steps_per_s"] > 0
    src = gr.open_source(str(store))
    assert len(src) == 1000  # 60 x 64 rows appended, the newest 1000 kept
    batch = src.read_batch(np.arange(len(src)))
    assert batch["obs"].shape == (1000, 4) and batch["obs"].dtype == np.float32
    assert batch["action"].dtype == np.int32 and set(np.unique(batch["action"])) <= {0, 1}
    np.testing.assert_array_equal(batch["reward"], np.ones(1000, np.float32))
    assert batch["done"].dtype == np.bool_
    # Rows are in append order: the last 64 rows are the last step, env by env, and a
    # step's obs is the previous step's next_obs unless that episode ended.
    prev, last = slice(-128, -64), slice(-64, None)
    same = ~batch["done"][prev]
    np.testing.assert_array_equal(batch["obs"][last][same], batch["next_obs"][prev][same])
    assert result["episodes"] > 0 and result["mean_return"] >= 8


def test_device_actor_dynamics_match_gymnasium(device_actor: ModuleType) -> None:
    gym = pytest.importorskip("gymnasium")
    import jax

    env = gym.make("CartPole-v1").unwrapped
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        state = rng.uniform(-0.2, 0.2, 4).astype(np.float32)
        action = int(rng.integers(2))
        env.state = state.astype(np.float64)
        want, _, terminated, _, _ = env.step(action)
        got, fell = jax.jit(device_actor.physics_step)(state, np.int32(action))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
        assert bool(fell) == terminated


def test_device_actor_no_write_prints_steps_per_second(
    device_actor: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    result = device_actor.main("--envs 64 --steps 5 --no-write".split())
    assert result["rows"] is None and result["steps"] == 5
    out = capsys.readouterr().out
    assert re.search(r"5 steps x 64 envs in [\d.]+ s: \d+ steps/s", out), out
    assert "not saved" in out


@pytest.mark.parametrize("flag", ["--envs", "--steps", "--capacity", "--flush-every"])
def test_device_actor_refuses_non_positive_flags(device_actor: ModuleType, flag: str) -> None:
    with pytest.raises(SystemExit):
        device_actor.main([flag, "0"])
