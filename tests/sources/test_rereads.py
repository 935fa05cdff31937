"""The one re-read-while-written loop every format shares (sources/reading/rereads.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from grain_replay.sources.reading import rereads
from grain_replay.sources.reading.rereads import RereadPolicy, read_while_written


def _sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(rereads.time, "sleep", slept.append)
    return slept


def _static(tmp_path: Any) -> str:
    path = str(tmp_path / "f")
    open(path, "wb").close()
    old = time.time() - 60
    os.utime(path, (old, old))
    return path


def test_the_schedules() -> None:
    assert rereads.doubling(0.005, 6) == (0.005, 0.01, 0.02, 0.04, 0.08)
    assert rereads.growing(0.5, 4) == (0.5, 1.0, 1.5)
    assert RereadPolicy(rereads.growing(1.0, 8), (OSError,)).reads == 8


def test_ungated_reads_a_static_file_again_on_schedule_then_raises_the_last_error(
    tmp_path, monkeypatch
):
    path, slept, calls = _static(tmp_path), _sleeps(monkeypatch), []

    def read() -> None:
        calls.append(1)
        raise OSError(f"torn {len(calls)}")

    with pytest.raises(OSError, match="torn 4"):
        read_while_written(read, RereadPolicy((1.0, 2.0, 3.0), (OSError,)), path=path)
    assert len(calls) == 4 and slept == [1.0, 2.0, 3.0]


def test_a_torn_value_is_read_again_and_one_that_stays_raises_checks_error(tmp_path, monkeypatch):
    path, slept = _static(tmp_path), _sleeps(monkeypatch)
    values = iter([1, 2, 3])
    policy = RereadPolicy((0.1, 0.2), (OSError,))

    def check(v: int) -> Exception | None:
        return None if v == 3 else ValueError(f"torn {v}")

    assert read_while_written(lambda: next(values), policy, path=path, check=check) == 3
    with pytest.raises(ValueError, match="torn 1"):
        read_while_written(lambda: 1, policy, path=path, check=check)
    assert slept == [0.1, 0.2] * 2


def test_gated_gives_up_at_once_on_a_static_file_and_never_retries_what_it_must_not(
    tmp_path, monkeypatch
):
    path, slept, calls = _static(tmp_path), _sleeps(monkeypatch), []
    policy = RereadPolicy(
        (1.0,) * 5, (OSError,), never_retried=(FileNotFoundError,), while_written_s=0.2
    )

    def read() -> None:
        calls.append(1)
        raise OSError("corrupt")

    with pytest.raises(OSError, match="corrupt"):
        read_while_written(read, policy, path=path)
    os.utime(path)  # written just now: a missing file still fails at once

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        read_while_written(missing, policy, path=path)
    assert len(calls) == 2 and not slept


def test_other_exceptions_propagate_at_once(tmp_path, monkeypatch):
    path, slept = _static(tmp_path), _sleeps(monkeypatch)

    def read() -> None:
        raise KeyError("not retried")

    with pytest.raises(KeyError):
        read_while_written(read, RereadPolicy((1.0,), (OSError,)), path=path)
    assert not slept
