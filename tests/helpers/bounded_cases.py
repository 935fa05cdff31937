"""The (format, worker_count) cases of the tests that read a bounded store while writers evict."""

from __future__ import annotations

import pytest

# Workers with HDF5 and Zarr only in the slow run: their readers are the same in a worker.
FORMATS_AND_WORKERS = [
    ("npy", 0),
    ("npy", 2),
    ("hdf5", 0),
    ("zarr", 0),
    pytest.param("hdf5", 2, marks=pytest.mark.slow),
    pytest.param("zarr", 2, marks=pytest.mark.slow),
]
