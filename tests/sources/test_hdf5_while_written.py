"""An HDF5 file that another process holds open for writing is said so, never read silently.

Each writer is a real process (``tests/helpers/h5_writer.py``) holding its file open,
driven line by line over pipes: the test waits for each of its answers (with a
deadline), never for time to pass.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from h5_writer import rows

import grain_replay as gr

HELPER = Path(__file__).parents[1] / "helpers" / "h5_writer.py"
DEADLINE_S = 60.0  # a ceiling on one answer of the writer (a loaded 2-core machine)


class Writer:
    """The writer process: send it a command, wait for its answer."""

    def __init__(self, path: Path, mode: str, *flags: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), str(path), mode, *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.expect("ready")

    def expect(self, answer: str) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + DEADLINE_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"the writer did not answer {answer!r} within {DEADLINE_S} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    self.proc.wait(DEADLINE_S)
                    err = self.proc.stderr.read() if self.proc.stderr else ""
                    pytest.fail(f"the writer exited ({self.proc.returncode}): {err}")
                assert line.strip() == answer
                return

    def send(self, command: str, answer: str | None = None) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        if answer is not None:
            self.expect(answer)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    started: list[Writer] = []
    yield started
    for w in started:
        w.stop()


def _check_rows(src: gr.HDF5DataSource, n: int) -> None:
    """Every row of ``src`` holds what the writer wrote there."""
    assert len(src) == n
    batch = src.read_batch(np.arange(n)[::-1])  # every row, in an order of its own
    np.testing.assert_array_equal(batch["obs"], rows("obs", 0, n)[::-1])
    np.testing.assert_array_equal(batch["act"], rows("act", 0, n)[::-1])
    np.testing.assert_array_equal(src[n - 1]["obs"], rows("obs", n - 1, n)[0])


def _said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("grain_replay") and r.levelno == level
    ]


def test_writer_holding_the_file_is_warned_and_its_flushed_rows_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    writers: list[Writer],
) -> None:
    writer = Writer(tmp_path / "held.h5", "plain")
    writers.append(writer)
    monkeypatch.chdir(tmp_path)  # a relative path: the warning names the absolute one
    with caplog.at_level(logging.INFO, logger="grain_replay"):
        src = gr.open_source("held.h5")
        _check_rows(src, 10)
        (warning,) = _said(caplog, logging.WARNING)
        assert str(tmp_path / "held.h5") in warning
        assert "open for writing in another process" in warning and "10 rows" in warning
        assert "flushes later will not be seen" in warning and "refresh()" in warning
        assert "Fix:" in warning and "swmr_mode = True" in warning

        # Flushed while held: not seen (HDF5 orders nothing between a plain writer's
        # flushes and a reader), and said once, not at every refresh.
        writer.send("grow all 20", "grown")
        assert src.refresh() == 10
        _check_rows(src, 10)
        copy = pickle.loads(pickle.dumps(src))  # a grain worker's copy opens its own handle
        _check_rows(copy, 10)
        assert len(_said(caplog, logging.WARNING)) == 1

        # The writer closes the file: the next refresh reads every row, nothing to say.
        writer.send("close", "closed")
        assert src.refresh() == 20
        _check_rows(src, 20)
        assert len(_said(caplog, logging.WARNING)) == 1


@pytest.mark.parametrize("flags", [(), ("--gzip",)], ids=["raw", "gzip"])
def test_swmr_writer_refresh_sees_the_rows_it_flushes(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    writers: list[Writer],
    flags: tuple[str, ...],
) -> None:
    path = tmp_path / "swmr.h5"
    writer = Writer(path, "swmr", *flags)
    writers.append(writer)
    with caplog.at_level(logging.INFO, logger="grain_replay"):
        src = gr.HDF5DataSource(path)
        _check_rows(src, 10)  # the handle is open: refresh must grow or reopen it
        assert not _said(caplog, logging.WARNING)
        (info,) = _said(caplog, logging.INFO)
        assert str(path) in info and "SWMR" in info and "refresh()" in info

        # One leaf ahead of the other: the rows both hold (a consistent prefix).
        writer.send("grow obs 20", "grown")
        assert src.refresh() == 10
        _check_rows(src, 10)
        writer.send("grow act 20", "grown")
        assert src.refresh() == 20
        _check_rows(src, 20)
        writer.send("grow all 45", "grown")
        assert src.refresh() == 45
        _check_rows(src, 45)
        assert len(_said(caplog, logging.INFO)) == 1 and not _said(caplog, logging.WARNING)


def test_writer_in_latest_format_not_swmr_is_refused_with_a_fix(
    tmp_path: Path, writers: list[Writer]
) -> None:
    path = tmp_path / "latest.h5"
    writers.append(Writer(path, "latest"))
    with pytest.raises(gr.WriterBusyError) as info:
        gr.HDF5DataSource(path)
    msg = str(info.value)
    assert str(path) in msg and "open for writing in another process" in msg
    assert "Fix:" in msg and "swmr_mode = True" in msg
    assert isinstance(info.value, BlockingIOError)


def test_writer_died_with_the_file_open_is_refused_with_h5clear(
    tmp_path: Path, writers: list[Writer]
) -> None:
    path = tmp_path / "died.h5"
    writer = Writer(path, "latest")
    writers.append(writer)
    writer.send("crash")
    assert writer.proc.wait(DEADLINE_S) == 0
    with pytest.raises(gr.InvalidStoreError) as info:
        gr.open_source(path)
    msg = str(info.value)
    assert str(path) in msg and "no process holds it" in msg
    assert "Fix:" in msg and f"h5clear -s {path}" in msg


@pytest.mark.parametrize("mode", ["plain", "swmr"])
def test_no_word_once_the_writer_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, writers: list[Writer], mode: str
) -> None:
    path = tmp_path / f"{mode}.h5"
    writer = Writer(path, mode)
    writers.append(writer)
    writer.send("grow all 13", "grown")
    writer.stop()
    assert writer.proc.returncode == 0
    with caplog.at_level(logging.DEBUG, logger="grain_replay"):
        src = gr.HDF5DataSource(path)
        _check_rows(src, 13)
        assert src.refresh() == 13
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.text


def test_replay_writer_holding_its_store_is_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ReplayWriter's stores are read through their commit protocol, not SWMR: a reader
    of one held open by its writer sees the committed rows, with nothing to warn of."""
    path = tmp_path / "replay.h5"
    with caplog.at_level(logging.INFO, logger="grain_replay"):
        with gr.ReplayWriter(path, "hdf5") as w:
            w.append({"obs": rows("obs", 0, 10), "act": rows("act", 0, 10)})
            w.flush()
            src = gr.HDF5DataSource(path)
            _check_rows(src, 10)
            w.append({"obs": rows("obs", 10, 25), "act": rows("act", 10, 25)})
            w.flush()
            assert src.refresh() == 25
            _check_rows(src, 25)
        assert not _said(caplog, logging.WARNING) and not _said(caplog, logging.INFO)
    assert os.path.exists(path)
