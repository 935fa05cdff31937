"""Reading a whole store back in tests."""

from __future__ import annotations

import numpy as np

import grain_replay as gr


def read_all(path: str) -> dict[str, np.ndarray]:
    """Every committed row of the store at ``path``, one read per leaf."""
    src = gr.open_source(path)
    try:
        return src.read_batch(np.arange(len(src)))
    finally:
        src.close()
