"""grain-replay info | verify | stats over a bounded, many-writer store."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.cli import main

sys.path.insert(0, str(Path(__file__).parent.parent / "helpers"))
from parts_child import make_rows


@pytest.fixture
def store(tmp_path: Path) -> str:
    path = str(tmp_path / "store")
    a = gr.ReplayWriter(path, capacity=100, writer_id="a", segment_rows=25)
    b = gr.ReplayWriter(path, writer_id="b")
    for k in range(10):
        a.append(make_rows("a", 20 * k, 20))
        b.append(make_rows("b", 20 * k, 20))
        a.flush()
        b.flush()
    a.close()
    yield path
    b.close()


def test_info_shows_writers_live_and_evicted_rows_and_disk_use(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", store, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_records"] == 300 and info["evicted_records"] == 100
    assert info["store_id"] == gr.open_source(store).store_id and len(info["store_id"]) == 32
    a, b = info["writers"]
    assert (a["writer_id"], a["live"], a["evicted"], a["committed"]) == ("a", 100, 100, 200)
    assert (b["writer_id"], b["live"], b["evicted"], b["capacity"]) == ("b", 200, 0, None)
    assert a["holder"] is None and b["holder"]["pid"] == os.getpid()  # b is still open
    assert 0 < a["size_on_disk"] < info["size_on_disk"]
    assert main(["info", store]) == 0
    text = capsys.readouterr().out
    assert "writers: 2 (live records 300, evicted 100)" in text
    assert f"store id: {info['store_id']}" in text
    assert "a: 100 live, 100 evicted, 200 committed, capacity 100" in text


def test_verify_checks_every_part_and_names_the_damaged_one(
    store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", store, "--quiet"]) == 0
    assert "300 live records of 2 writers" in capsys.readouterr().out
    src = gr.open_source(store)
    writer, _, _, seg = src.segments()[1]
    with open(os.path.join(seg, "vec.npy"), "r+b") as f:
        f.seek(os.path.getsize(f.name) - 8)  # the last committed row's data
        f.write(b"\xff" * 8)
    assert main(["verify", store, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"writer {writer!r}" in err and seg in err and "vec" in err


def test_stats_cover_the_live_rows(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    stats = gr.compute_stats(gr.open_source(store), keys=["seq"])
    live = np.concatenate([np.arange(100, 200), np.arange(200)])
    assert int(stats["seq"]["count"]) == 300
    np.testing.assert_allclose(stats["seq"]["mean"], live.mean())
    assert main(["stats", store, "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_records"] == 300 and out["leaves"]["seq"]["min"] == 0
