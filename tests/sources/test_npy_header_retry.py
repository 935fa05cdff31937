"""The .npy header parse survives CPython 3.11.7's spurious SystemError (gh-106905)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from grain_replay.errors import InvalidStoreError
from grain_replay.store import formats


def _flaky(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[int]:
    """numpy's v1 header parser raising SystemError ``failures`` times, then working."""
    real = np.lib.format.read_array_header_1_0
    calls = [0]

    def parse(f):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] <= failures:
            f.read(5)  # leave the stream somewhere else, as a failed parse does
            raise SystemError("AST constructor recursion depth mismatch (before=1, after=0)")
        return real(f)

    monkeypatch.setattr(np.lib.format, "read_array_header_1_0", parse)
    return calls


def test_spurious_system_error_is_retried(tmp_path, monkeypatch):
    path = str(tmp_path / "obs.npy")
    np.save(path, np.arange(12, dtype=np.float32).reshape(3, 4))
    calls = _flaky(monkeypatch, failures=2)
    shape, dtype, fortran, offset = formats.read_npy_header(path, "obs")
    assert (shape, dtype, fortran) == ((3, 4), np.dtype(np.float32), False)
    assert offset == 128 and calls[0] == 3


def test_header_read_again_from_its_start_in_a_stream(monkeypatch):
    buf = io.BytesIO()
    np.save(buf, np.zeros((2, 3), np.int16))
    buf.seek(0)
    _flaky(monkeypatch, failures=1)
    assert formats.parse_npy_header(buf) == ((2, 3), False, np.dtype(np.int16))
    assert buf.tell() == 128


def test_a_system_error_that_persists_names_the_file_and_leaf(tmp_path, monkeypatch):
    path = str(tmp_path / "obs.npy")
    np.save(path, np.zeros(3))
    _flaky(monkeypatch, failures=100)
    with pytest.raises(InvalidStoreError, match=r"obs\.npy.*leaf 'obs'.*np\.save"):
        formats.read_npy_header(path, "obs")
