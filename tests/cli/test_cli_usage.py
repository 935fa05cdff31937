"""The CLI as a newcomer meets it: --help, one-line errors, read-only info, labelled bars, demo."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.cli import build_parser, commands, main


def _tree(n: int = 300) -> dict[str, Any]:
    return {
        "obs": np.arange(n * 4, dtype=np.float32).reshape(n, 4),
        "reward": np.ones(n, np.float32),
        "done": np.arange(n) % 50 == 49,
    }


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("grain-replay: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- --help --------------------------------------------------------------------------------


def test_every_argument_of_every_command_has_help_text():
    parser = build_parser()
    commands = _subparsers(parser)
    assert set(commands) >= {"info", "convert", "verify", "demo"}
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)


@pytest.mark.parametrize("command", [None, "info", "convert", "verify", "demo"])
def test_help_is_plain_text(command: str | None, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"] if command is None else [command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out  # no reST
    assert out.startswith("usage: grain-replay")


def test_convert_help_lists_compressions_and_gives_units_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "{blosc,gzip,lzf,zstd}" in out
    assert "HDF5: gzip, lzf; Zarr: zstd, gzip, blosc" in out
    assert "--block-bytes BYTES" in out and "(default: 67108864 = 64 MiB)" in out


def test_demo_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: demo_out)", "(default: 200000)", "(default: 256)", "(default: 2)"):
        assert default in out


def test_verify_help_explains_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out
    for code in ("0  ", "1  ", "2  "):
        assert f"\n  {code}" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"grain-replay {gr.__version__}"


# -- convert: checks before drawing, one line per failure ------------------------------------


def test_convert_onto_existing_destination_names_the_flag_and_draws_nothing(tmp_path: Path, capsys):
    src = gr.write(tmp_path / "a.h5", _tree())
    dst = gr.write(tmp_path / "b.zarr", _tree(10))
    assert main(["convert", src, dst]) == 2  # the progress bar is on
    err = capsys.readouterr().err
    line = _one_error_line(err)
    assert "--overwrite" in line and "overwrite=True" not in line
    assert "convert to" not in err and "%" not in err  # no bar was drawn
    assert len(gr.open_source(dst)) == 10


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--compression", "lzf"], "compression must be one of"),  # lzf is HDF5's, not Zarr's
        (["--chunk-rows", "0"], "chunk_rows must be a positive int"),
        (["--format", "npy", "--compression", "gzip"], "cannot be chunked or compressed"),
    ],
)
def test_convert_bad_option_is_one_error_line_before_any_bar(
    tmp_path: Path, capsys, args: list[str], phrase: str
):
    src = gr.write(tmp_path / "a.h5", _tree())
    dst = tmp_path / "b.zarr"
    assert main(["convert", src, str(dst), *args]) == 2
    err = capsys.readouterr().err
    assert phrase in _one_error_line(err)
    assert "convert to" not in err
    assert sorted(os.listdir(tmp_path)) == ["a.h5"]


def test_convert_unknown_compression_is_an_argparse_error(tmp_path: Path, capsys):
    src = gr.write(tmp_path / "a.h5", _tree())
    with pytest.raises(SystemExit) as info:
        main(["convert", src, str(tmp_path / "b.h5"), "--compression", "zstdd"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "error: argument --compression: invalid choice: 'zstdd'" in err


def test_convert_under_a_file_is_one_error_line(tmp_path: Path, capsys):
    src = gr.write(tmp_path / "a.h5", _tree())
    assert main(["convert", src, str(tmp_path / "a.h5" / "b.h5"), "--quiet"]) == 2
    _one_error_line(capsys.readouterr().err)


def test_convert_progress_counts_records_with_a_label(tmp_path: Path, monkeypatch):
    bars: list[_Recorder] = []
    monkeypatch.setattr(commands, "_progress", lambda *a: bars.append(_Recorder(*a)) or bars[-1])
    src = gr.write(tmp_path / "a.h5", _tree(300))
    assert main(["convert", src, str(tmp_path / "b.zarr"), "--block-bytes", "1000"]) == 0
    (bar,) = bars
    assert (bar.total, bar.unit, bar.desc) == (300, "records", "convert to zarr")
    assert sum(bar.updates) == 300 and len(bar.updates) > 1 and bar.closed


# -- verify ----------------------------------------------------------------------------------


class _Recorder:
    def __init__(self, total: int, desc: str, enabled: bool, unit: str) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.updates: list[int] = []
        self.closed = False

    def update(self, n: int) -> None:
        self.updates.append(n)

    def close(self) -> None:
        self.closed = True


def test_verify_progress_counts_bytes_with_a_label(tmp_path: Path, monkeypatch):
    bars: list[_Recorder] = []
    monkeypatch.setattr(commands, "_progress", lambda *a: bars.append(_Recorder(*a)) or bars[-1])
    n = 100_000
    path = gr.write(
        tmp_path / "s.h5",
        {"obs": np.zeros((n, 3), np.float32), "action": np.zeros(n, np.int64)},
    )
    assert main(["verify", path]) == 0
    (bar,) = bars
    assert bar.unit == "B" and "bytes" in bar.desc
    assert bar.total == n * (3 * 4 + 8)  # bytes, not records x leaves
    assert sum(bar.updates) == bar.total and bar.closed


def test_verify_progress_bar_shows_bytes(tmp_path: Path, capsys):
    path = gr.write(tmp_path / "s.h5", {"obs": np.zeros((1000, 256), np.float32)})
    assert main(["verify", path]) == 0
    err = capsys.readouterr().err
    # 1,024,000 bytes = 0.98 MiB (tqdm scales by 1024 for bytes); records would read "1.00k".
    assert "verify (bytes read): 100%" in err and "0.98M/0.98M" in err and "B/s" in err


# -- info ------------------------------------------------------------------------------------


def test_info_writes_nothing_unless_asked(tmp_path: Path, capsys):
    store = tmp_path / "store"
    store.mkdir()
    path = gr.write(store / "s.h5", _tree())
    before = sorted(os.listdir(store))
    mtime = os.stat(store).st_mtime_ns
    assert main(["info", path]) == 0
    assert "episodes: 6" in capsys.readouterr().out
    assert sorted(os.listdir(store)) == before and os.stat(store).st_mtime_ns == mtime
    assert main(["info", path, "--cache-episodes"]) == 0
    assert sorted(os.listdir(store)) == sorted([*before, "s.h5.episodes.npz"])


def test_info_on_a_read_only_npy_store(tmp_path: Path, capsys):
    path = gr.write(tmp_path / "s", _tree())
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            os.chmod(os.path.join(root, name), 0o555 if name in dirs else 0o444)
    os.chmod(path, 0o555)
    try:
        before = sorted(os.listdir(path))
        assert main(["info", path, "--json"]) == 0
        assert '"count": 6' in capsys.readouterr().out
        assert sorted(os.listdir(path)) == before
    finally:
        os.chmod(path, 0o755)


# -- demo ------------------------------------------------------------------------------------


def test_demo_says_what_it_drops_and_what_cpu_numbers_mean(tmp_path: Path, capsys):
    argv = ["demo", "--out", str(tmp_path), "--records", "1000", "--batch-size", "64"]
    assert main([*argv, "--workers", "0"]) == 0
    out = capsys.readouterr().out
    # 1000 = 15 * 64 + 40: the 40 that do not fill a batch are dropped, and it says so.
    assert "40 of the 1,000 records do not fill a last batch of 64" in out
    assert "drop_remainder=True" in out
    assert out.count("960 records [ok]") == 3
    assert "every record of every format was delivered once" not in out
    flat = " ".join(out.split())
    assert "one shuffled epoch of 960 records (the 40 that do not fill a batch dropped)" in flat
    assert "fake CPU devices" in flat and "read_batch: one vectorized read" in flat
    assert sorted(os.listdir(tmp_path)) == ["replay.h5", "replay.zarr", "replay_npy"]
