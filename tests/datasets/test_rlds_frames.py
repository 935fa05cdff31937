"""The decoded-frame cache of RLDS image leaves: decoded once, read back bit for bit, bounded."""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

import numpy as np
import pytest

pytest.importorskip("PIL")

from rlds_fixture import write_rlds

import grain_replay as gr
from grain_replay.datasets.rlds import frames as frames_lib
from grain_replay.datasets.rlds import readers as readers_lib
from grain_replay.datasets.rlds.index import CACHE_FOLDER
from grain_replay.errors import InvalidArgumentError

LENGTHS = (5, 3, 7, 4, 6)
IMAGES = ["observation/image", "observation/image_1"]  # a JPEG and a PNG camera


@pytest.fixture
def ds(tmp_path: Any) -> tuple[str, dict[str, np.ndarray]]:
    root = str(tmp_path / "toy_rlds" / "1.0.0")
    return root, write_rlds(root, lengths=LENGTHS, size=8)


def _decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = readers_lib.decode_image

    def decode(*a: Any, **k: Any) -> np.ndarray:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(readers_lib, "decode_image", decode)
    return calls


def _frame_files(root: str) -> list[str]:
    folder = os.path.join(root, CACHE_FOLDER)
    return sorted(f for f in os.listdir(folder) if f.startswith("frames-"))


def _flat(batch: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: batch["observation"][k.split("/")[1]] for k in IMAGES}


def test_frames_are_decoded_once_and_read_back_equal(
    ds: tuple[str, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, data = ds
    n = sum(LENGTHS)
    ids = np.array([3, 3, 0, n - 1, 11, 7])
    calls = _decodes(monkeypatch)
    src = gr.RLDSDataSource(root, keys=IMAGES, progress=False)
    cold = _flat(src.read_batch(ids))
    assert len(calls) == 2 * len(set(ids.tolist()))  # a duplicate missing twice: decoded once
    assert len(_frame_files(root)) == 2
    calls.clear()
    warm = _flat(src.read_batch(ids))
    fresh = _flat(gr.RLDSDataSource(root, keys=IMAGES, progress=False).read_batch(ids))
    assert calls == []  # every frame from the cache, also for a new source
    plain = gr.RLDSDataSource(root, keys=IMAGES, progress=False, frame_cache_bytes=0)
    off = _flat(plain.read_batch(ids))
    for k in IMAGES:
        np.testing.assert_array_equal(cold[k], data[k][ids])
        for got in (warm, fresh, off):
            np.testing.assert_array_equal(got[k], cold[k])
    # A batch of some cached and some new steps decodes only the new ones.
    calls.clear()
    both = _flat(src.read_batch([3, 1, 2]))
    assert len(calls) == 2 * 2
    for k in IMAGES:
        np.testing.assert_array_equal(both[k], data[k][[3, 1, 2]])


def test_frame_cache_off_writes_nothing_and_bad_budget_is_refused(
    ds: tuple[str, dict[str, np.ndarray]],
) -> None:
    root, data = ds
    src = gr.RLDSDataSource(root, keys=IMAGES, progress=False, frame_cache_bytes=0)
    np.testing.assert_array_equal(
        src.read_batch([2])["observation"]["image"][0], data["observation/image"][2]
    )
    assert _frame_files(root) == []
    with pytest.raises(InvalidArgumentError, match="frame_cache_bytes must be >= 0"):
        gr.RLDSDataSource(root, progress=False, frame_cache_bytes=-1)


def test_budget_caches_the_leaves_that_fit_and_logs_the_others(
    ds: tuple[str, dict[str, np.ndarray]], caplog: pytest.LogCaptureFixture
) -> None:
    root, data = ds
    one = 4096 + sum(LENGTHS) * (frames_lib.SLOT_HEADER + 8 * 8 * 3)
    caplog.set_level(logging.INFO, logger="grain_replay.datasets.rlds.source")
    src = gr.RLDSDataSource(root, keys=IMAGES, progress=False, frame_cache_bytes=one + 10)
    got = _flat(src.read_batch([4, 9]))
    assert (
        _frame_files(root) == [f for f in _frame_files(root) if "observation_image-" in f]
        and len(_frame_files(root)) == 1
    )
    assert "'observation/image_1'" in caplog.text and "raise frame_cache_bytes" in caplog.text
    for k in IMAGES:
        np.testing.assert_array_equal(got[k], data[k][[4, 9]])
    assert os.path.getsize(os.path.join(root, CACHE_FOLDER, _frame_files(root)[0])) == one


def _cache_file(root: str) -> str:
    (name,) = [f for f in _frame_files(root) if "observation_image-" in f]
    return os.path.join(root, CACHE_FOLDER, name)


def test_slot_without_its_header_is_decoded_again(
    ds: tuple[str, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed between the frame write and the header write: the step is missed."""
    root, data = ds
    keys = ["observation/image"]
    gr.RLDSDataSource(root, keys=keys, progress=False).read_batch([5, 6])
    path = _cache_file(root)
    slot = frames_lib.SLOT_HEADER + 8 * 8 * 3
    with open(path, "r+b") as f:
        f.seek(4096 + 6 * slot)
        f.write(bytes(frames_lib.SLOT_HEADER))
    calls = _decodes(monkeypatch)
    got = gr.RLDSDataSource(root, keys=keys, progress=False).read_batch([5, 6])
    assert len(calls) == 1
    np.testing.assert_array_equal(got["observation"]["image"], data["observation/image"][[5, 6]])


def test_cache_of_another_boot_or_signature_is_replaced(
    ds: tuple[str, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, data = ds
    keys = ["observation/image"]
    gr.RLDSDataSource(root, keys=keys, progress=False).read_batch([1])
    path = _cache_file(root)

    def generation() -> str:
        with open(path, "rb") as f:
            return str(json.loads(f.read(4096).rstrip(b"\n"))["generation"])

    first = generation()
    gr.RLDSDataSource(root, keys=keys, progress=False).read_batch([1])
    assert generation() == first  # same boot, same dataset: reused
    monkeypatch.setattr(frames_lib, "boot_id", lambda: "another-boot")
    calls = _decodes(monkeypatch)
    got = gr.RLDSDataSource(root, keys=keys, progress=False).read_batch([1])
    assert generation() != first and len(calls) == 1
    np.testing.assert_array_equal(got["observation"]["image"][0], data["observation/image"][1])
    # A damaged header page: replaced too.
    with open(path, "r+b") as f:
        f.write(b"{not json")
    calls.clear()
    again = gr.RLDSDataSource(root, keys=keys, progress=False).read_batch([1])
    assert len(calls) == 1
    np.testing.assert_array_equal(again["observation"]["image"][0], data["observation/image"][1])


def test_truncated_cache_file_is_missed_not_a_crash(
    ds: tuple[str, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, data = ds
    keys = ["observation/image"]
    src = gr.RLDSDataSource(root, keys=keys, progress=False)
    n = sum(LENGTHS)
    src.read_batch(np.arange(n))
    os.truncate(_cache_file(root), 4096 + 3 * (frames_lib.SLOT_HEADER + 8 * 8 * 3))
    calls = _decodes(monkeypatch)
    got = src.read_batch(np.arange(n))  # the open reader: steps 0-2 cached, the rest short
    assert len(calls) == n - 3
    np.testing.assert_array_equal(got["observation"]["image"], data["observation/image"])


def test_write_failure_turns_the_cache_off_with_a_warning(
    ds: tuple[str, dict[str, np.ndarray]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, data = ds

    def full(*a: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    src = gr.RLDSDataSource(root, keys=["observation/image"], progress=False)
    src.open()
    monkeypatch.setattr(frames_lib.os, "pwrite", full)
    with caplog.at_level(logging.WARNING, logger="grain_replay.datasets.rlds.frames"):
        got = src.read_batch([2, 8])
        again = src.read_batch([2, 8])
    assert caplog.text.count("No space left") == 1
    assert "frame_cache_bytes=0" in caplog.text
    for b in (got, again):
        np.testing.assert_array_equal(b["observation"]["image"], data["observation/image"][[2, 8]])


def test_no_disk_space_for_the_cache_decodes_as_before(
    ds: tuple[str, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, data = ds

    class Full:
        f_bavail = 0
        f_frsize = 4096

    monkeypatch.setattr(frames_lib.os, "statvfs", lambda path: Full())
    monkeypatch.setenv("XDG_CACHE_HOME", os.path.join(root, "..", "user-cache"))
    src = gr.RLDSDataSource(root, keys=IMAGES, progress=False)
    got = _flat(src.read_batch([0, 10]))
    assert _frame_files(root) == []
    for k in IMAGES:
        np.testing.assert_array_equal(got[k], data[k][[0, 10]])


def test_workers_fill_one_cache_the_main_process_reads(
    ds: tuple[str, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, data = ds
    n = sum(LENGTHS)
    src = gr.RLDSDataSource(root, keys=IMAGES, progress=False)
    loader = gr.make_data_loader(src, batch_size=5, shuffle=False, worker_count=2)
    batches = list(loader)
    got = {k: np.concatenate([b["observation"][k.split("/")[1]] for b in batches]) for k in IMAGES}
    calls = _decodes(monkeypatch)
    warm = _flat(gr.RLDSDataSource(root, keys=IMAGES, progress=False).read_batch(np.arange(n)))
    assert calls == []
    for k in IMAGES:
        np.testing.assert_array_equal(got[k], data[k][:n])
        np.testing.assert_array_equal(warm[k], data[k][:n])


@pytest.mark.parametrize("budget", [None, 0])
def test_read_into_fills_images_in_place_cold_warm_and_uncached(
    ds: tuple[str, dict[str, np.ndarray]], budget: int | None
) -> None:
    root, data = ds
    ids = np.array([3, 3, 0, sum(LENGTHS) - 1, 11])
    kw = {} if budget is None else {"frame_cache_bytes": budget}
    src = gr.RLDSDataSource(root, keys=IMAGES, progress=False, **kw)
    for _ in range(2):  # cold (decoded into out, then cached), then warm (read back)
        out = {k: np.full((len(ids), *data[k].shape[1:]), 7, np.uint8) for k in IMAGES}
        bases = {k: out[k].__array_interface__["data"][0] for k in IMAGES}
        src.read_into(ids, out)
        for k in IMAGES:
            assert out[k].__array_interface__["data"][0] == bases[k]
            np.testing.assert_array_equal(out[k], data[k][ids])
    strided = np.zeros((len(ids) * 2, *data[IMAGES[0]].shape[1:]), np.uint8)[::2]
    src.read_into(ids, {IMAGES[0]: strided})  # not contiguous: read, then copied in
    np.testing.assert_array_equal(strided, data[IMAGES[0]][ids])
