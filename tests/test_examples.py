"""The runnable examples, each exercised at toy size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from repo_scripts import EXAMPLES, load_script

TRAIN_LOOP = EXAMPLES / "train_loop.py"


@pytest.fixture(scope="module")
def train_loop() -> ModuleType:
    return load_script(TRAIN_LOOP)


def test_train_loop_loss_decreases_in_process(train_loop: ModuleType, tmp_path: Path) -> None:
    store = tmp_path / "replay.h5"
    toy = "--steps 60 --workers 0 --batch-size 64 --num-records 2048 --log-every 0"
    argv = [*toy.split(), "--store", str(store)]
    result = train_loop.main(argv)
    assert store.exists()  # written there because it was missing
    assert result["steps"] == 60
    assert result["final_loss"] < 0.7 * result["initial_loss"], result
    assert result["steps_per_s"] > 0

    again = train_loop.main(argv)  # the store now exists and is reused: same stream
    assert again["losses"] == pytest.approx(result["losses"], rel=1e-5)


def test_train_loop_rejects_batch_not_divisible_by_devices(train_loop: ModuleType) -> None:
    import jax

    if jax.device_count() == 1:
        pytest.skip("every batch size splits over one device")
    with pytest.raises(SystemExit):
        train_loop.main(["--batch-size", str(jax.device_count() + 1)])


def test_train_loop_script_with_workers(tmp_path: Path) -> None:
    store = tmp_path / "replay"
    toy = "--steps 60 --format npy --workers 2 --batch-size 64 --num-records 2048"
    cmd = [sys.executable, str(TRAIN_LOOP), *toy.split(), "--store", str(store)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"initial loss ([\d.]+) -> final loss ([\d.]+)", proc.stdout)
    assert match, proc.stdout
    initial, final = map(float, match.groups())
    assert final < 0.7 * initial, proc.stdout
    assert "2 worker(s)" in proc.stdout
