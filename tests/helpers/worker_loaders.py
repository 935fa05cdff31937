"""The store and loader defaults the worker-path tests share (test_worker_loader,
test_worker_groups)."""

from __future__ import annotations

from typing import Any

import grain
import numpy as np
import pytest
from conformance import make_tree

import grain_replay as gr

NO_SHARDING = grain.sharding.NoSharding()


def id_store(tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    """A 100-row npy store of ``make_tree`` leaves plus ``id`` (int64: each row's index)."""
    tree = make_tree(100)
    tree["id"] = np.arange(100, dtype=np.int64)
    p = str(tmp_path_factory.mktemp(name) / "s.npy")
    gr.write(p, tree, format="npy")
    return p


def worker_loader(source: Any, **kwargs: Any) -> grain.DataLoader:
    """``make_data_loader`` with the tests' defaults: no sharding, batches of 8, seed 5, two
    epochs, two workers (each overridable)."""
    kwargs.setdefault("shard_options", NO_SHARDING)
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("seed", 5)
    kwargs.setdefault("num_epochs", 2)
    kwargs.setdefault("worker_count", 2)
    return gr.make_data_loader(source, **kwargs)
