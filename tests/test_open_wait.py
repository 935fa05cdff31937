"""``gr.open_source(path, wait=...)``: a learner started before its actors waits for the store.

The learner calls ``open_source(wait=)`` before a writer process has made the store; the
writer appears after ~0.3 s, appends, and commits later still: the open returns once a
row is committed (for a many-writer store: once a writer has committed one).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grain_replay as gr

# Sleeps, makes the store (the first append creates a plain one with N = 0; a many-writer
# writer makes replay_store.json when it opens), sleeps again, commits 8 rows, and holds
# the store open until its stdin closes.
_WRITER = """
import sys, time
import numpy as np
import grain_replay as gr
path, bounded = sys.argv[1], sys.argv[2] == "bounded"
time.sleep(0.3)
kw = {"capacity": 100, "writer_id": "a"} if bounded else {}
w = gr.ReplayWriter(path, **kw)
w.append({"obs": np.arange(16, dtype=np.float32).reshape(8, 2)})
time.sleep(0.3)
w.flush()
sys.stdin.read()
w.close()
"""


def _spawn_writer(path: str, kind: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, path, kind], stdin=subprocess.PIPE, cwd=os.getcwd()
    )


@pytest.mark.parametrize(
    ("name", "kind", "cls"),
    [
        ("replay", "plain", gr.NpyDataSource),
        ("replay.h5", "plain", gr.HDF5DataSource),
        ("replay.zarr", "plain", gr.ZarrDataSource),
        ("buffer", "bounded", gr.PartsDataSource),
    ],
)
def test_a_learner_waits_for_a_writer_that_starts_after_it(
    tmp_path: Path, name: str, kind: str, cls: type
) -> None:
    if name.endswith(".zarr"):
        pytest.importorskip("zarr")
    path = str(tmp_path / name)
    proc = _spawn_writer(path, kind)
    try:
        assert not os.path.exists(path)  # the learner comes first
        start = time.monotonic()
        src = gr.open_source(path, wait=60)
        waited = time.monotonic() - start
        assert type(src) is cls
        assert len(src) == 8  # the commit, not the empty store made before it
        np.testing.assert_array_equal(src[7]["obs"], [14.0, 15.0])
        assert waited >= 0.3
        src.close()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0


def test_the_timeout_names_the_absolute_path_the_wait_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(gr.StoreNotFoundError) as info:
        gr.open_source("buf", wait=0.3)
    assert 0.3 <= time.monotonic() - start < 5
    text = str(info.value)
    assert f"'buf' ({tmp_path / 'buf'})" in text
    assert "after waiting 0.3 s" in text
    assert "Fix: start a writer" in text and "check the path" in text


def test_without_wait_a_missing_store_fails_at_once_naming_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for wait in (None, 0, 0.0):
        start = time.monotonic()
        with pytest.raises(gr.StoreNotFoundError, match="No replay store at") as info:
            gr.open_source("buf", wait=wait)
        assert time.monotonic() - start < 0.5
        assert f"'buf' ({tmp_path / 'buf'})" in str(info.value)
    for name in ("buf.h5", "buf.zarr"):  # the sources' own errors name it too
        cls = gr.HDF5DataSource if name.endswith(".h5") else gr.ZarrDataSource
        with pytest.raises(gr.StoreNotFoundError) as info:
            cls(name)
        assert str(tmp_path / name) in str(info.value)


def test_a_store_without_a_committed_row_is_waited_for_then_named(tmp_path: Path) -> None:
    path = str(tmp_path / "replay")
    with gr.ReplayWriter(path) as w:
        w.append({"obs": np.zeros((4, 2), np.float32)})  # the store is made, N = 0
        with pytest.raises(gr.StoreNotFoundError, match="no writer has committed a row"):
            gr.open_source(path, wait=0.2)
        w.flush()
        assert len(gr.open_source(path, wait=0.2)) == 4


@pytest.mark.parametrize("kind", ["partial", "parts"])
def test_a_store_being_made_is_waited_for_not_refused(tmp_path: Path, kind: str) -> None:
    path = str(tmp_path / "replay")
    if kind == "partial":  # a write of it still running (this process): .partial, no store
        partial = f"{path}.{os.getpid()}.0badc0de.partial"
        os.makedirs(partial)
        with pytest.raises(gr.UnfinishedWriteError):
            gr.open_source(path)
    else:  # a many-writer store before its replay_store.json
        os.makedirs(os.path.join(path, "writers"))
        os.makedirs(os.path.join(path, "ordinals"))

    def write() -> None:
        time.sleep(0.3)
        rows = {"obs": np.ones((5, 2), np.float32)}
        if kind == "partial":
            gr.write(path, rows)
        else:
            with gr.ReplayWriter(path, capacity=100, writer_id="a") as w:
                w.append(rows)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        src = gr.open_source(path, wait=30)
        assert len(src) == 5
    finally:
        writer.join()


def test_a_store_made_between_the_look_and_the_open_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the race CI hit: the look found no folder, a writer made the many-writer store's
    # folders, and the open saw a folder with no .npy file (InvalidStoreError, not a wait)
    from grain_replay import opening

    path = str(tmp_path / "buffer")
    real = opening._not_yet
    looks: list[int] = []

    def not_yet(p: Any) -> str | None:
        looks.append(1)
        if len(looks) == 1:  # the first look: nothing there yet; then the writer's mkdir
            os.makedirs(os.path.join(path, "writers"))
            return None
        return real(p)

    monkeypatch.setattr(opening, "_not_yet", not_yet)
    with pytest.raises(gr.StoreNotFoundError, match="creating"):
        gr.open_source(path, wait=0.2)
    assert len(looks) >= 2
    with gr.ReplayWriter(path, capacity=100, writer_id="a") as w:  # and it opens once made
        w.append({"obs": np.ones((5, 2), np.float32)})
    assert len(gr.open_source(path, wait=5)) == 5


def test_a_foreign_folder_is_still_refused_while_waiting(tmp_path: Path) -> None:
    path = tmp_path / "not_a_store"
    (path / "sub").mkdir(parents=True)
    (path / "notes.txt").write_text("x")
    with pytest.raises(gr.InvalidStoreError, match=r"no \.npy file"):
        gr.open_source(str(path), wait=0.2)


@pytest.mark.parametrize(
    ("wait", "error"),
    [
        (-1, gr.InvalidArgumentError),
        (-0.5, gr.InvalidArgumentError),
        (math.nan, gr.InvalidArgumentError),
        ("5", gr.ArgumentTypeError),
        (True, gr.ArgumentTypeError),
        ([1], gr.ArgumentTypeError),
    ],
)
def test_bad_waits_are_refused_with_the_fix(tmp_path: Path, wait: Any, error: type) -> None:
    with pytest.raises(error, match=r"wait.*Fix: pass e\.g\. wait=60\.0"):
        gr.open_source(str(tmp_path / "x"), wait=wait)


def test_a_numpy_wait_and_an_existing_store_open_at_once(tmp_path: Path) -> None:
    path = gr.write(str(tmp_path / "replay"), {"obs": np.zeros((3, 1), np.float32)})
    start = time.monotonic()
    assert len(gr.open_source(path, wait=np.float64(30))) == 3
    assert len(gr.open_source(path, wait=math.inf)) == 3
    assert time.monotonic() - start < 5
