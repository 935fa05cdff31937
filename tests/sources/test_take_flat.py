"""The one-pass batch gather (``Handle.take_flat``): same rows, timing, errors, fallbacks."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from torchrl_fixture import write_dump

import grain_replay as gr
from grain_replay.sources.reading import readahead, readers


def _misaligned_npz(tmp_path: Any) -> tuple[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    arrays = {
        "a": rng.integers(0, 9, 50).astype(np.int64),
        "b": rng.standard_normal((50, 2, 3)).astype(np.float32),
        "c": rng.random(50) < 0.5,
    }
    path = str(tmp_path / "m.npz")
    np.savez(path, **arrays)
    return path, arrays


def test_misaligned_npz_members_read_whole_rows_in_their_shape(tmp_path: Any) -> None:
    path, arrays = _misaligned_npz(tmp_path)
    src = gr.open_source(path)
    kinds = {k: type(r).__name__ for k, r in src._get_handle().readers.items()}
    assert "_ByteRows" in kinds.values()  # the case under test: a misaligned member
    idx = np.array([49, 0, 7, 7, -1])
    got = src.read_batch(idx, check=False)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype and got[k].shape == (5, *a.shape[1:])
        np.testing.assert_array_equal(got[k], a[idx])
        np.testing.assert_array_equal(src.read_leaf(k, idx), a[idx])
    empty = src.read_batch(np.zeros(0, np.int64))
    assert {k: v.shape for k, v in empty.items()} == {
        k: (0, *a.shape[1:]) for k, a in arrays.items()
    }
    with pytest.raises(IndexError):
        src.read_batch([50], check=False)
    with pytest.raises(gr.RecordIndexError):
        src.read_batch([50])


def test_nested_tree_is_still_built_and_flat_tree_is_the_dict(tmp_path: Any) -> None:
    store = gr.write_npy(str(tmp_path / "s"), {"obs": {"x": np.arange(6.0)}, "r": np.arange(6)})
    got = gr.open_source(store).read_batch([1, 2])
    assert set(got) == {"obs", "r"} and got["obs"]["x"].tolist() == [1.0, 2.0]
    path, _ = _misaligned_npz(tmp_path)
    flat = gr.open_source(path).read_batch([3])
    assert list(flat) == ["a", "b", "c"]


def test_wrapped_torchrl_rows_wrap_inside_the_take(tmp_path: Any) -> None:
    n = 40
    tree = {"obs": np.arange(n * 3, dtype=np.float32).reshape(n, 3), "r": np.arange(n)}
    store = write_dump(str(tmp_path / "rb"), tree, cursor=13, write_count=n + 13)
    src = gr.open_source(store)
    oldest_first = {k: np.concatenate([v[13:], v[:13]]) for k, v in tree.items()}
    idx = np.array([0, n - 1, 26, 27, 5], np.int64)
    for check in (True, False):
        got = src.read_batch(idx, check=check)
        for k, v in oldest_first.items():
            np.testing.assert_array_equal(got[k], v[idx])
    # Unchecked indices out of range wrap, as the reorder's remainder did: never outside.
    got = src.read_batch(np.array([n + 2, -1]), check=False)
    np.testing.assert_array_equal(got["r"], oldest_first["r"][[2, n - 1]])


def test_wrapped_torchrl_rows_through_a_leaf_reader_count_from_the_end(tmp_path: Any) -> None:
    """A leaf without a plain take (cold rows, chunked readers) gets the negative rows
    of the wrapped order resolved before its reader's take; other leaves take them as
    they are. Both read the oldest-first records."""
    n = 40
    tree = {"obs": np.arange(n * 3, dtype=np.float32).reshape(n, 3), "r": np.arange(n)}
    store = write_dump(str(tmp_path / "rb"), tree, cursor=13, write_count=n + 13)
    src = gr.open_source(store)
    handle = src._get_handle()
    seen: list[np.ndarray] = []
    reader = handle.readers["r"]
    real_take = reader.take

    def take(indices: np.ndarray) -> np.ndarray:
        seen.append(indices.copy())
        return real_take(indices)

    reader.plan = None  # "r" through its reader
    reader.take = take  # type: ignore[method-assign]
    oldest_first = {k: np.concatenate([v[13:], v[:13]]) for k, v in tree.items()}
    idx = np.array([0, 26, 27, n - 1, 3], np.int64)
    got = src.read_batch(idx, check=False)
    for k, v in oldest_first.items():
        np.testing.assert_array_equal(got[k], v[idx])
    assert seen and seen[0].min() >= 0  # rows in [0, N) for the reader
    with pytest.raises(IndexError):  # past the negative rows: numpy refuses, nothing is read
        src.read_batch(np.array([2 * n]), check=False)


def test_the_process_id_is_kept_and_follows_a_fork() -> None:
    """The handle's process is known without a getpid() system call a batch, and a forked
    child (whose handle must be its own) knows its own id."""
    code = (
        "import os, sys\n"
        "from grain_replay.sources.surface import current_pid\n"
        "assert current_pid() == os.getpid()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if current_pid() == os.getpid() != os.getppid() else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stderr)


def test_one_gather_in_time_every_is_timed_per_mapped_leaf(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evicted rows are still noticed: each warm mapped leaf is timed once in TIME_EVERY."""
    store = gr.write_npy(str(tmp_path / "s"), {"a": np.arange(100.0), "b": np.arange(100)})
    src = gr.open_source(store)
    src.read_batch(np.arange(100))
    handle = src._get_handle()
    aheads = [r.plan[2] for r in handle.readers.values() if r.plan is not None]
    if not aheads or any(a is None for a in aheads):
        pytest.skip("no read-ahead on this platform (no libc madvise)")
    for a in aheads:
        a.cold = False
    timed: list[int] = []
    monkeypatch.setattr(readahead.RowReadAhead, "finish", lambda self, n, s: timed.append(n))
    for _ in range(2 * readers.TIME_EVERY):
        src.read_batch([1, 2, 3])
    assert timed == [3] * (2 * len(aheads))


def test_cold_leaf_goes_through_its_reader(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store = gr.write_npy(str(tmp_path / "s"), {"a": np.arange(100.0), "b": np.arange(100)})
    src = gr.open_source(store)
    handle = src._get_handle()
    taken: list[str] = []
    real = readers.ArrayReader.take

    def take(self: readers.ArrayReader, indices: np.ndarray) -> np.ndarray:
        taken.append("x")
        return real(self, indices)

    monkeypatch.setattr(readers.ArrayReader, "take", take)
    plan = handle.readers["b"].plan
    if plan is None or plan[2] is None:
        pytest.skip("no read-ahead on this platform (no libc madvise)")
    plan[2].cold = True
    got = src.read_batch([4, 5])
    assert got["b"].tolist() == [4, 5] and taken  # the cold leaf read (ahead) by its reader


def test_a_failing_leaf_is_named(tmp_path: Any) -> None:
    store = gr.write_npy(str(tmp_path / "s"), {"a": np.arange(10.0), "b": np.arange(10)})
    src = gr.open_source(store)

    class Broken(readers.LeafReader):
        def take(self, indices: np.ndarray) -> np.ndarray:
            raise OSError("disk gone")

    handle = src._get_handle()
    handle.readers = {**handle.readers, "b": Broken()}
    with pytest.raises(gr.InvalidStoreError, match=r"leaf 'b'.*disk gone.*Fix:"):
        src.read_batch([1])
