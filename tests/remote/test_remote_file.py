"""RetryingFile, the file object h5py reads remote HDF5 files through (local fsspec here)."""

from __future__ import annotations

import threading
from typing import Any

from grain_replay.errors import InvalidStoreError
from grain_replay.remote import Remote, RetryingFile, RetryOptions


def test_last_error_is_kept_per_thread(tmp_path: Any) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"0123456789")
    url = f"file://{path}"
    f = RetryingFile(url, {}, Remote(url, {}, RetryOptions(retries=0), kind="HDF5 file"))
    assert f.read(4) == b"0123" and f.last_error is None
    mine = InvalidStoreError("this thread's failure")
    f.last_error = mine
    seen: list[Any] = []
    other = threading.Thread(target=lambda: seen.append(f.last_error))
    other.start()
    other.join()
    assert seen == [None]  # another thread does not see (or clear) this thread's error
    assert f.last_error is mine
