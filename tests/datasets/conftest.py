"""Fixtures the RL view tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def minari_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``MINARI_DATASETS_PATH`` set to a fresh folder for one test module, restored after."""
    root = str(tmp_path_factory.mktemp("minari"))
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = root
    yield root
    if old is None:
        del os.environ["MINARI_DATASETS_PATH"]
    else:
        os.environ["MINARI_DATASETS_PATH"] = old
