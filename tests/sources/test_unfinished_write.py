"""A store whose write never finished is refused with UnfinishedWriteError, not "not found".

``gr.write`` makes a store under ``<path>.<pid>.<random>.partial`` and renames it into
place once complete, metadata last; a crash leaves the ``.partial`` and no store.
The crash is simulated in-process: the swap into place fails, and the clean-up
that would remove the ``.partial`` is skipped, as a killed process skips it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import grain_replay as gr
from grain_replay.writers import atomic

FORMATS = {"hdf5": "store.h5", "npy": "store", "zarr": "store.zarr"}
SOURCES = {"hdf5": gr.HDF5DataSource, "npy": gr.NpyDataSource, "zarr": gr.ZarrDataSource}
TREE = {"obs": np.arange(12, dtype=np.float32).reshape(6, 2), "act": np.arange(6)}


class _Killed(BaseException):
    """The write's process dies here."""


def _kill_write(
    monkeypatch: pytest.MonkeyPatch, path: Path, fmt: str, overwrite: bool = False
) -> None:
    """Runs ``gr.write`` until the swap into place, and dies there."""

    def die(partial: str, path: str) -> None:
        raise _Killed

    with monkeypatch.context() as m:
        m.setattr(atomic, "_commit", die)
        m.setattr(atomic, "remove_path", lambda p: None)  # nobody cleans up after a kill
        with pytest.raises(_Killed):
            gr.write(path, TREE, format=fmt, overwrite=overwrite)


def _crashed_write(monkeypatch: pytest.MonkeyPatch, path: Path, fmt: str) -> str:
    """A first write of ``path`` killed before its swap; returns the ``.partial`` left."""
    _kill_write(monkeypatch, path, fmt)
    left = [n for n in os.listdir(path.parent) if n.endswith(".partial")]
    assert len(left) == 1 and not path.exists()
    return str(path.parent / left[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_open_source_of_an_interrupted_write_says_unfinished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    path = tmp_path / FORMATS[fmt]
    partial = _crashed_write(monkeypatch, path, fmt)
    dead = partial.replace(f".{os.getpid()}.", ".999999999.")  # its writer is gone
    os.rename(partial, dead)
    for open_ in (gr.open_source, SOURCES[fmt]):
        with pytest.raises(gr.UnfinishedWriteError) as info:
            open_(str(path))
        msg = str(info.value)
        assert str(path) in msg and dead in msg  # the absolute path, and what is left
        assert "metadata was never committed" in msg
        assert "interrupted" in msg and "re-run the write" in msg and "delete" in msg
        # Code that caught "not found" (or a bad store) before still catches it.
        assert isinstance(info.value, FileNotFoundError)
        assert isinstance(info.value, gr.InvalidStoreError)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_running_write_is_named_as_possibly_still_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    path = tmp_path / FORMATS[fmt]
    partial = _crashed_write(monkeypatch, path, fmt)  # named by this (live) process
    with pytest.raises(gr.UnfinishedWriteError, match="may still be writing") as info:
        gr.open_source(str(path))
    assert partial in str(info.value) and f"process {os.getpid()}" in str(info.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_rewritten_store_opens_and_an_old_store_wins_over_a_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    path = tmp_path / FORMATS[fmt]
    partial = _crashed_write(monkeypatch, path, fmt)
    atomic.remove_path(partial)  # the fix the message gives: delete it ...
    gr.write(str(path), TREE, format=fmt)  # ... and re-run the write
    _kill_write(monkeypatch, path, fmt, overwrite=True)  # an overwrite killed before its swap
    with gr.open_source(str(path)) as src:  # the old store, whole
        np.testing.assert_array_equal(src.read_batch(np.arange(6))["act"], TREE["act"])


def test_a_missing_path_without_a_partial_is_still_not_found(tmp_path: Path) -> None:
    (tmp_path / "storex.123.abcd1234.partial").mkdir()  # another path's write
    (tmp_path / "store.old.partial").mkdir()  # not a write's temp name
    with pytest.raises(gr.StoreNotFoundError):
        gr.open_source(str(tmp_path / "store"))


def test_a_foreign_directory_beside_a_partial_still_opens(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    np.save(tmp_path / "store" / "x.npy", np.arange(4))  # no grain_replay metadata
    (tmp_path / "store.123.abcd1234.partial").mkdir()
    with gr.open_source(str(tmp_path / "store")) as src:
        assert len(src) == 4
